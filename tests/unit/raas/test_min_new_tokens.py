"""``min_new_tokens``: EOS (and stop strings) cannot end a generation early; the logprobs stay
those of the full distribution, so the trainer's recomputation still matches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from astraflow.raas.engines.base import EngineContext, GenerationRequest, build_engine
from astraflow.raas.engines.decoding import sample_next
from astraflow.raas.engines.transformers import TransformersEngine
from astraflow.workflows.api import SamplingParams
from fixtures.models import tiny_spec
from fixtures.raas import recompute_logprobs


def test_a_banned_token_is_never_drawn_but_keeps_its_logprob() -> None:
    # token 0 (say EOS) has almost all the mass
    logits = torch.tensor([[8.0, 0.0, 0.0, 0.0]]).repeat(64, 1)
    banned = torch.zeros(64, 4, dtype=torch.bool)
    banned[:32, 0] = True
    shared = torch.Generator().manual_seed(0)
    params = (torch.ones(64), torch.zeros(64, dtype=torch.long), torch.ones(64))
    tokens, lps = sample_next(logits, *params, [None] * 64, shared, banned)
    assert (tokens[:32] != 0).all(), "banned rows never draw token 0"
    assert (tokens[32:] == 0).float().mean() > 0.9, "other rows are untouched"
    full = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(lps, full), "logprobs of the unrestricted distribution"
    greedy, _ = sample_next(logits, torch.zeros(64), *params[1:], [None] * 64, shared, banned)
    assert (greedy[:32] != 0).all() and (greedy[32:] == 0).all()


def _engine(tmp_path: Path) -> TransformersEngine:
    from astraflow.models import build_tokenizer

    spec = tiny_spec()
    context = EngineContext(
        policy="p", tokenizer=build_tokenizer(spec), work_dir=tmp_path, model=spec, seed=1
    )
    engine = build_engine({"type": "transformers", "device": "cpu"}, context)
    assert isinstance(engine, TransformersEngine)
    return engine


async def test_no_generation_ends_before_its_minimum(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    tok = engine.context.tokenizer
    eos = tok.eos_token_id
    prompt = tuple(tok.encode("1+2="))
    try:
        free = await engine.generate(
            [GenerationRequest(prompt, max_new_tokens=40, seed=s) for s in range(48)]
        )
        early = [o for o in free if o.finish_reason == "stop" and len(o.token_ids) < 12]
        assert early, "precondition: without a minimum some generations end early"
        held = await engine.generate(
            [
                GenerationRequest(prompt, max_new_tokens=40, min_new_tokens=12, seed=s)
                for s in range(48)
            ]
        )
        for out in held:
            assert len(out.token_ids) >= 12
            assert eos not in out.token_ids[:11].tolist()
            if out.finish_reason == "stop":
                assert int(out.token_ids[-1]) == eos
            ref = recompute_logprobs(engine.model, prompt, out.token_ids.tolist(), 1.0)
            np.testing.assert_allclose(out.logprobs, ref, atol=2e-5)
        cpu_before = engine.metrics()["cpu_s"]
        exact = await engine.generate(
            [
                GenerationRequest(prompt, max_new_tokens=9, min_new_tokens=9, seed=s)
                for s in range(8)
            ]
        )
        assert {len(o.token_ids) for o in exact} == {9}
        assert {o.finish_reason for o in exact} == {"length"}
        metrics = engine.metrics()
        assert metrics["busy_s"] > 0, "generation time is counted"
        # the engine thread's own CPU, read from outside it: it grows as it generates
        assert metrics["cpu_s"] > cpu_before > 0
    finally:
        await engine.close()
    assert engine.metrics()["cpu_s"] >= metrics["cpu_s"], "a counter: it never goes back"


async def test_stop_strings_wait_for_the_minimum_too(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    tok = engine.context.tokenizer
    prompt = tuple(tok.encode("1"))
    try:
        (free,) = await engine.generate([GenerationRequest(prompt, 30, temperature=0.0)])
        text = tok.decode(free.token_ids.tolist(), skip_special_tokens=True)
        stop = text[0]
        (held,) = await engine.generate(
            [GenerationRequest(prompt, 30, min_new_tokens=6, temperature=0.0, stop=(stop,))]
        )
        assert len(held.token_ids) >= 6
        held_text = tok.decode(held.token_ids.tolist(), skip_special_tokens=True)
        assert held.finish_reason == "length" or stop in held_text[5:]
    finally:
        await engine.close()


def test_sampling_params_carry_the_minimum_to_the_request() -> None:
    params = SamplingParams(max_new_tokens=5, min_new_tokens=3)
    assert GenerationRequest.from_sampling([4, 5], params).min_new_tokens == 3
    assert SamplingParams().min_new_tokens == 0
