"""One optimizer update on a tiny real model: direction, invariances and the statistics."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from astraflow.trainer.backends.local import LocalBackend
from astraflow.trainer.batching import Packing
from astraflow.trainer.config import LossConfig, OptimizerConfig
from astraflow.trainer.losses import token_logprobs
from astraflow.trainer.optim import build_optimizer
from astraflow.trainer.step import PolicyUpdate
from fixtures.trainer import text_sample, with_model_logprobs


def _update(model: torch.nn.Module, loss: LossConfig, budget: int = 4096, lr: float = 1e-2,
            ref: torch.nn.Module | None = None, sgd: bool = False) -> PolicyUpdate:  # fmt: skip
    backend = LocalBackend("cpu")
    model = backend.wrap(model)
    opt = (
        torch.optim.SGD(model.parameters(), lr=lr)
        if sgd  # linear in the gradient: Adam would amplify fp32 noise where |g| ~ eps
        else build_optimizer(model, OptimizerConfig(lr=lr))
    )
    return PolicyUpdate(backend, model, opt, loss, Packing(budget, 0), ref_model=ref)


def _completion_logp(model: torch.nn.Module, tok: Any, prompt: str, completion: str) -> float:
    ids = tok.encode(prompt + completion, add_special_tokens=False)
    x = torch.tensor([ids])
    with torch.no_grad():
        logp = token_logprobs(model(input_ids=x).logits, x)
    return float(logp[0, len(ids) - len(completion) :].sum())


def test_grpo_step_raises_rewarded_and_lowers_penalised(
    tiny_model: torch.nn.Module, tiny_tokenizer: Any
) -> None:
    tok = tiny_tokenizer
    batch = [
        with_model_logprobs(tiny_model, text_sample(tok, "1+2=", "3", reward=1.0)),
        with_model_logprobs(tiny_model, text_sample(tok, "1+2=", "5", reward=0.0)),
    ]
    good0 = _completion_logp(tiny_model, tok, "1+2=", "3")
    bad0 = _completion_logp(tiny_model, tok, "1+2=", "5")
    update = _update(tiny_model, LossConfig(type="grpo"), lr=3e-3)
    x = torch.tensor([tok.encode("1+2=3", add_special_tokens=False)])
    with torch.no_grad():  # the policy's entropy where it chose the answer (before the update)
        before = torch.distributions.Categorical(logits=tiny_model(input_ids=x).logits[0, -2])
    stats = update.run(batch)
    assert stats["is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy data
    assert stats["trained_tokens"] == 2 and stats["reward_mean"] == 0.5
    assert stats["entropy"] == pytest.approx(float(before.entropy()), rel=1e-4)
    good1 = _completion_logp(tiny_model, tok, "1+2=", "3")
    bad1 = _completion_logp(tiny_model, tok, "1+2=", "5")
    assert good1 > good0 + 1e-3
    assert bad1 < bad0 - 1e-3


def test_micro_batching_equals_one_big_batch(
    tiny_model: torch.nn.Module, tiny_tokenizer: Any
) -> None:
    tok = tiny_tokenizer
    batch = [
        text_sample(tok, "12+3=", "15", reward=1.0, group="a"),
        text_sample(tok, "12+3=", "16", reward=0.0, group="a"),
        text_sample(tok, "4+4=", "8", reward=1.0, group="b"),
        text_sample(tok, "4+4=", "9999", reward=0.5, group="b"),
        text_sample(tok, "4+4=", "0", reward=0.0, group="b"),
    ]
    batch = [with_model_logprobs(tiny_model, s) for s in batch]
    twin = copy.deepcopy(tiny_model)
    big = _update(tiny_model, LossConfig(tis_cap=2.0), budget=4096, lr=0.5, sgd=True)
    small = _update(twin, LossConfig(tis_cap=2.0), budget=9, lr=0.5, sgd=True)
    for _ in range(2):
        a, b = big.run(batch), small.run(batch)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for (name, p), q in zip(tiny_model.named_parameters(), twin.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name


def test_behaviour_logprobs_at_a_temperature_are_matched(
    tiny_model: torch.nn.Module, tiny_tokenizer: Any
) -> None:
    s = text_sample(tiny_tokenizer, "7+1=", "8", reward=1.0)
    t = text_sample(tiny_tokenizer, "7+1=", "9", reward=0.0)
    batch = [with_model_logprobs(tiny_model, x, temperature=0.7) for x in (s, t)]
    stats = _update(tiny_model, LossConfig()).run(batch)
    assert stats["is_ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert stats["is_ratio_min"] == pytest.approx(1.0, abs=1e-5)
    # the same logprobs read at temperature 1 would not match
    cold = [x.model_copy(update={"meta": {}}) for x in batch]
    assert _update(copy.deepcopy(tiny_model), LossConfig()).run(cold)["is_ratio_max"] != (
        pytest.approx(1.0, abs=1e-3)
    )


def test_stale_samples_get_tis_and_m2po(tiny_model: torch.nn.Module, tiny_tokenizer: Any) -> None:
    tok = tiny_tokenizer
    fresh = with_model_logprobs(tiny_model, text_sample(tok, "2+2=", "4444", reward=1.0))
    stale = fresh.model_copy(update={"logprobs": fresh.logprobs - 1.5 * fresh.loss_mask})
    other = with_model_logprobs(tiny_model, text_sample(tok, "2+2=", "5555", reward=0.0))
    loss = LossConfig(tis_cap=2.0, m2po_threshold=0.2)
    stats = _update(tiny_model, loss).run([stale, other], trainer_version=1)
    # stale tokens: ratio e^1.5 > 2; squared log-ratio 2.25: masking 3 of the 4 leaves a
    # mean of 2.25 / 5 > 0.2, so all 4 go (and no kept token is capped)
    assert stats["is_ratio_max"] == pytest.approx(float(torch.tensor(1.5).exp()), rel=1e-4)
    assert stats["m2po_masked_frac"] == pytest.approx(0.5)
    assert stats["trained_tokens"] == 4 and stats["is_capped_frac"] == 0.0
    assert stats["staleness_mean"] == 1.0


def test_kl_to_reference_starts_at_zero_and_grows(
    tiny_model: torch.nn.Module, tiny_tokenizer: Any
) -> None:
    ref = copy.deepcopy(tiny_model).requires_grad_(False)
    batch = [
        with_model_logprobs(tiny_model, text_sample(tiny_tokenizer, "3+3=", "6", reward=1.0)),
        with_model_logprobs(tiny_model, text_sample(tiny_tokenizer, "3+3=", "7", reward=0.0)),
    ]
    update = _update(tiny_model, LossConfig(kl_coef=0.1), ref=ref)
    assert update.run(batch)["kl"] == pytest.approx(0.0, abs=1e-7)
    assert update.run(batch)["kl"] > 1e-6


def test_sft_lowers_nll(tiny_model: torch.nn.Module, tiny_tokenizer: Any) -> None:
    batch = [text_sample(tiny_tokenizer, "5+5=", "10"), text_sample(tiny_tokenizer, "1+1=", "2")]
    update = _update(tiny_model, LossConfig(type="sft"), lr=1e-2)
    first = update.run(batch)["loss"]
    for _ in range(20):
        last = update.run(batch)["loss"]
    assert last < first * 0.5
