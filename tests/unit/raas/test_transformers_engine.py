"""The transformers engine with a real tiny model: exact logprobs, batching, stops, errors,
and weight updates from a real weight store that land between batches, never inside one."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from astraflow.errors import NotFoundError, ServiceUnavailableError, ValidationError
from astraflow.raas.engines.base import (
    EngineContext,
    EngineOutput,
    GenerationRequest,
    build_engine,
)
from astraflow.raas.engines.batching import Pending
from astraflow.raas.engines.transformers import TransformersEngine
from astraflow.weights import WeightClient
from fixtures.models import tiny_spec
from fixtures.raas import (
    PolicyStore,
    RecordedPulls,
    assert_exact_logprobs,
    recompute_logprobs,
    tiny_engine,
)


def _prompt(engine: TransformersEngine, text: str) -> tuple[int, ...]:
    return tuple(engine.context.tokenizer.encode(text))


async def test_logprobs_match_a_recomputation_by_the_model(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path)
    try:
        requests = [
            GenerationRequest(_prompt(engine, p), max_new_tokens=12, temperature=t, top_k=k)
            for p, t, k in [("1+2=", 1.0, 0), ("22+1=", 0.6, 5), ("3=", 1.3, 0), ("9", 0.0, 0)]
        ]
        outputs = await engine.generate(requests)
        for request, out in zip(requests, outputs, strict=True):
            assert out.version == 0 and len(out.token_ids) == len(out.logprobs) >= 1
            assert_exact_logprobs(engine.model, request, out)
            eos = engine.context.tokenizer.eos_token_id
            ended_by_eos = int(out.token_ids[-1]) == eos
            assert out.finish_reason == ("stop" if ended_by_eos else "length")
            assert ended_by_eos or len(out.token_ids) == 12
    finally:
        await engine.close()


async def test_seeded_requests_repeat_exactly_alone_or_batched(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path)
    try:
        seeded = [
            GenerationRequest(_prompt(engine, "1+1="), max_new_tokens=10, seed=i) for i in range(4)
        ]
        together = await engine.generate(seeded)
        alone = [(await engine.generate([r]))[0] for r in seeded]
        for a, b in zip(together, alone, strict=True):
            assert a.token_ids.tolist() == b.token_ids.tolist()
        assert len({tuple(o.token_ids.tolist()) for o in together}) > 1  # seeds differ
    finally:
        await engine.close()


async def test_concurrent_calls_are_decoded_as_one_batch(tmp_path: Path) -> None:
    # continuous batching off: requests left over from a full batch would join it instead
    engine = tiny_engine(tmp_path, batch_wait_ms=50.0, max_batch_size=16, continuous=False)
    sizes: list[int] = []
    original = engine._run_batch

    def spy(batch):  # type: ignore[no-untyped-def]
        sizes.append(len(batch))
        original(batch)

    engine._run_batch = spy  # type: ignore[method-assign]
    try:
        request = GenerationRequest(_prompt(engine, "2+2="), max_new_tokens=4)
        await asyncio.gather(*(engine.generate([request]) for _ in range(12)))
        assert sizes == [12]
        await asyncio.gather(*(engine.generate([request] * 10) for _ in range(2)))
        assert sizes[1:] == [16, 4]  # max_batch_size caps a batch
    finally:
        await engine.close()


async def test_stop_strings_end_a_generation_and_stay_in_it(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path)
    tok = engine.context.tokenizer
    try:
        free = (
            await engine.generate(
                [
                    GenerationRequest(
                        _prompt(engine, "1"), max_new_tokens=30, seed=7, temperature=0.0
                    )
                ]
            )
        )[0]
        text = tok.decode(free.token_ids.tolist(), skip_special_tokens=True)
        assert len(text) >= 4, "the greedy continuation must be long enough to cut"
        stop = text[2:4]
        cut = (
            await engine.generate(
                [
                    GenerationRequest(
                        _prompt(engine, "1"), max_new_tokens=30, temperature=0.0, stop=(stop,)
                    )
                ]
            )
        )[0]
        cut_text = tok.decode(cut.token_ids.tolist(), skip_special_tokens=True)
        assert cut.finish_reason == "stop"
        assert cut_text.endswith(stop) and text.startswith(cut_text)
    finally:
        await engine.close()


async def test_bad_prompts_fail_only_their_own_request(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path, batch_wait_ms=30.0)
    try:
        good = GenerationRequest(_prompt(engine, "1+2="), max_new_tokens=3)
        too_big = GenerationRequest((5, 6, 10_000), max_new_tokens=3)
        too_long = GenerationRequest((5,) * 128, max_new_tokens=3)  # context is 128
        results = await asyncio.gather(
            engine.generate([good]),
            engine.generate([too_big]),
            engine.generate([too_long]),
            engine.generate([GenerationRequest((), max_new_tokens=3)]),
            return_exceptions=True,
        )
        assert isinstance(results[0], list) and len(results[0][0].token_ids) >= 1
        assert isinstance(results[1], ValidationError) and "10000" in str(results[1])
        assert isinstance(results[2], ValidationError) and "context" in str(results[2])
        assert isinstance(results[3], ValidationError) and "empty" in str(results[3])
        near_end = (await engine.generate([GenerationRequest((5,) * 126, max_new_tokens=50)]))[0]
        assert len(near_end.token_ids) <= 2 and near_end.finish_reason in ("stop", "length")
    finally:
        await engine.close()


async def test_closed_engine_refuses_and_fails_pending_requests(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path)
    await engine.close()
    with pytest.raises(ServiceUnavailableError, match="closed"):
        await engine.generate([GenerationRequest((5, 6), max_new_tokens=2)])


async def test_engine_built_from_store_assets_loads_and_applies_deltas(
    tmp_path: Path, policy_store: PolicyStore
) -> None:
    """No model of its own: architecture from the assets, weights loaded, then a delta pull
    into the live state dict; outputs are tagged and scored by the right version."""
    client = WeightClient(policy_store.root)
    assets = client.fetch_assets("policy", tmp_path / "assets")
    from transformers import AutoTokenizer

    context = EngineContext(
        policy="policy",
        tokenizer=AutoTokenizer.from_pretrained(assets),
        work_dir=tmp_path / "engine",
        assets_dir=assets,
    )
    engine = build_engine({"type": "transformers", "device": "cpu"}, context)
    request = GenerationRequest((5, 14, 6, 17), max_new_tokens=8, seed=11)
    try:
        assert engine.version == -1
        with pytest.raises(ServiceUnavailableError, match="no weights"):
            await engine.generate([request])
        await engine.load(client.load("policy", 0), 0)
        first = (await engine.generate([request]))[0]
        assert first.version == 0
        policy_store.publish_perturbed(1)
        await engine.apply(client, "policy", 1)
        second = (await engine.generate([request]))[0]
        assert second.version == 1
        for out, version in ((first, 0), (second, 1)):
            ref = recompute_logprobs(
                policy_store.model_at(version), request.prompt_ids, out.token_ids.tolist(), 1.0
            )
            np.testing.assert_allclose(out.logprobs, ref, atol=2e-5)
        state = engine.model.state_dict()  # type: ignore[attr-defined]
        for name, tensor in policy_store.states[1].items():
            assert bool((state[name] == tensor).all()), name
    finally:
        await engine.close()
        client.close()


def _bf16_engine(tmp_path: Path, **config: Any) -> tuple[PolicyStore, WeightClient, Any]:
    """A real weight store publishing bfloat16, its client, and a CPU transformers engine
    built from the store's assets (``config``: more engine options)."""
    from transformers import AutoTokenizer

    store = PolicyStore(tmp_path / "weights", dtype="bfloat16")
    client = WeightClient(store.root)
    assets = client.fetch_assets("policy", tmp_path / "assets")
    context = EngineContext(policy="policy", tokenizer=AutoTokenizer.from_pretrained(assets),
                            work_dir=tmp_path / "engine", assets_dir=assets)  # fmt: skip
    engine = build_engine({"type": "transformers", "device": "cpu", **config}, context)
    return store, client, engine


@pytest.mark.parametrize(("choice", "computes"), [("auto", "float32"), ("published", "bfloat16")])
async def test_bf16_weights_compute_in_float32_on_cpu_and_stay_bit_exact(
    tmp_path: Path, choice: str, computes: str
) -> None:
    """Weights published in bfloat16: on a CPU the engine computes in float32 by default
    (dtype 'auto'), holding exactly the published values; delta pulls still apply to the
    published tensors, refresh after refresh."""
    import torch

    from astraflow.models import build_model

    store, client, engine = _bf16_engine(tmp_path, dtype=choice)
    request = GenerationRequest((5, 14, 6, 17), max_new_tokens=8, seed=11)
    try:
        await engine.load(client.load("policy", 0), 0)
        for version in (0, 1, 2):
            if version:
                store.publish_perturbed(version, seed=version)
                await engine.apply(client, "policy", version)
            model = engine.model  # type: ignore[attr-defined]
            assert model.dtype == getattr(torch, computes)
            state = model.state_dict()
            for name, tensor in store.states[version].items():
                assert tensor.dtype == torch.bfloat16
                assert torch.equal(state[name], tensor.to(state[name].dtype)), (version, name)
            out = (await engine.generate([request]))[0]
            assert out.version == version
            # built in the dtype it computes in (buffers such as rotary frequencies too),
            # holding the published values
            reference = build_model(store.spec.model_copy(update={"dtype": computes}))
            reference.load_state_dict(store.states[version], strict=False)
            ref = recompute_logprobs(reference, request.prompt_ids, out.token_ids.tolist(), 1.0)
            # bf16 arithmetic: a cached decode and a full recomputation round differently
            atol = 2e-5 if computes == "float32" else 5e-2
            np.testing.assert_allclose(out.logprobs, ref, atol=atol)
    finally:
        await engine.close()
        client.close()
        store.close()


async def test_a_version_not_served_leaves_the_published_copy_for_the_next_delta(
    tmp_path: Path,
) -> None:
    """A refresh to a version the store does not serve (a relay gone past it) fails before
    anything is written; the float32 engine's copy of the bf16 tensors still holds the old
    version, so the next refresh is a delta on it, not a full snapshot (a cross-region run
    pulled 1-6.6 MB full snapshots over its link after each such miss)."""
    import torch

    store, client, engine = _bf16_engine(tmp_path)
    source = RecordedPulls(client)

    try:
        await engine.load(client.load("policy", 0), 0)
        store.publish_perturbed(1, seed=1)
        with pytest.raises(NotFoundError, match="v00000007"):
            await engine.apply(source, "policy", 7)
        assert engine.version == 0
        for version in (1, 2):
            if version == 2:
                store.publish_perturbed(2, seed=2)
            await engine.apply(source, "policy", version)
            state = engine.model.state_dict()  # type: ignore[attr-defined]
            for name, tensor in store.states[version].items():
                assert torch.equal(state[name], tensor.to(state[name].dtype)), (version, name)
        assert source.pulls == [(0, 7, "not found"), (0, 1, "chain"), (1, 2, "chain")]
    finally:
        await engine.close()
        client.close()
        store.close()


async def test_weight_updates_land_between_batches_only(
    tmp_path: Path, policy_store: PolicyStore
) -> None:
    """Generations racing a refresh each come from exactly one version, the one they name."""
    client = WeightClient(policy_store.root)
    spec = policy_store.spec
    context = EngineContext(
        policy="policy", tokenizer=policy_store.tokenizer, work_dir=tmp_path, model=spec
    )
    engine = build_engine({"type": "transformers", "device": "cpu", "batch_wait_ms": 1.0}, context)
    policy_store.publish_perturbed(1, fraction=0.3)
    try:
        await engine.apply(client, "policy", 0)  # from its own init weights: a full copy
        applied = asyncio.Event()

        async def racer(i: int) -> list[tuple[tuple[int, ...], EngineOutput, bool]]:
            """Requests one after another until one is sent after the refresh returned."""
            got: list[tuple[tuple[int, ...], EngineOutput, bool]] = []
            await asyncio.sleep(0.002 * i)
            while True:
                after = applied.is_set()
                prompt = (5, 14, 6 + (i + len(got)) % 3, 17)
                out = (await engine.generate([GenerationRequest(prompt, max_new_tokens=16)]))[0]
                got.append((prompt, out, after))
                if after:
                    return got
                await asyncio.sleep(0.002)

        racing = [asyncio.create_task(racer(i)) for i in range(12)]
        await asyncio.sleep(0.01)
        await engine.apply(client, "policy", 1)
        applied.set()
        outs = [o for r in await asyncio.gather(*racing) for o in r]
        assert {o.version for _, o, _ in outs} == {0, 1}
        assert all(o.version == 1 for _, o, after in outs if after)
        models = {v: policy_store.model_at(v) for v in (0, 1)}
        for prompt, out, _ in outs:
            ref = recompute_logprobs(models[out.version], prompt, out.token_ids.tolist(), 1.0)
            np.testing.assert_allclose(out.logprobs, ref, atol=2e-5)
    finally:
        await engine.close()
        client.close()


async def test_a_refresh_mid_batch_starts_new_rows_on_new_weights_while_old_rows_finish(
    tmp_path: Path, policy_store: PolicyStore
) -> None:
    """Double-buffered models: a refresh does not wait for the running batch's longest row.
    A request that joins after the swap decodes on the new version (its own lane) and ends
    while the row already decoding goes on, on the old version, to its end; each is exact
    under the version it names. The next pull writes into the old model only once that row
    has ended."""
    client = WeightClient(policy_store.root)
    context = EngineContext(
        policy="policy", tokenizer=policy_store.tokenizer, work_dir=tmp_path,
        model=policy_store.spec,
    )  # fmt: skip
    engine = build_engine({"type": "transformers", "device": "cpu", "batch_wait_ms": 0.0}, context)
    policy_store.publish_perturbed(1, fraction=0.3)
    policy_store.publish_perturbed(2, fraction=0.3, seed=2)
    policy_store.publish_perturbed(3, fraction=0.3, seed=3)
    order: list[str] = []
    long = Pending(GenerationRequest((5, 14, 6, 17), max_new_tokens=120, min_new_tokens=120))
    late = Pending(GenerationRequest((5, 14, 7, 17), max_new_tokens=4, min_new_tokens=4))
    long.future.add_done_callback(lambda _: order.append("long"))
    late.future.add_done_callback(lambda _: order.append("late"))
    pulls: list[tuple[int | None, bool]] = []
    go = threading.Event()

    class Watched:
        """The store, noting at each pull whether the long row had ended."""

        def load(self, policy: str, version: int) -> dict[str, Any]:
            return client.load(policy, version)

        def pull(self, policy: str, tensors: Any, have: int | None, want: int | None = None) -> Any:
            pulls.append((want, long.future.done()))
            return client.pull(policy, tensors, have, want)

    try:
        old = engine.model  # version 0; its spare model is made mid-batch, by the refresh
        calls = [0]
        put = threading.Event()

        def hook(module: Any, args: Any, kwargs: Any) -> None:  # the engine thread
            calls[0] += 1
            if not put.is_set():  # `late` goes in once the swap to version 1 ran or is next
                if engine.version != 1 and calls[0] >= 80:  # hold the long row till then
                    deadline = time.monotonic() + 60
                    while engine.version != 1 and not (pulls and not engine._jobs.empty()):
                        assert time.monotonic() < deadline, "the refresh never reached it"
                        time.sleep(0.001)
                if engine.version == 1 or calls[0] >= 80:
                    engine._put(late)
                    put.set()
            elif late.future.done() and not go.is_set():
                assert go.wait(60), "the test never let the old row go on"

        handle = old.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            engine._put(long)
            while calls[0] < 2:  # the batch decodes: the refresh (its spare model too) lands
                await asyncio.sleep(0.001)  # between two of its steps
            await engine.apply(Watched(), "policy", 1)
            await asyncio.wrap_future(late.future)
            assert order == ["late"], "the new request waited for the running batch's end"
            # the long row is held at its next step on the old model: the next refresh may
            # not write into that model yet
            refresh = asyncio.create_task(engine.apply(Watched(), "policy", 2))
            await asyncio.sleep(0.3)
            assert [w for w, _ in pulls] == [1] and not refresh.done()
            go.set()
            await refresh
            outs = await asyncio.gather(asyncio.wrap_future(long.future),
                                        asyncio.wrap_future(late.future))  # fmt: skip
        finally:
            handle.remove()
        assert pulls == [(1, False), (2, True)]
        assert order == ["late", "long"] and engine.metrics()["batches"] == 1
        assert [o.version for o in outs] == [0, 1] and len(outs[0].token_ids) == 120
        for job, out in zip((long, late), outs, strict=True):
            assert_exact_logprobs(policy_store.model_at(out.version), job.request, out)
        after = GenerationRequest((5, 14, 8, 17), max_new_tokens=8)
        (out,) = await engine.generate([after])
        assert out.version == 2
        assert_exact_logprobs(policy_store.model_at(2), after, out)
        await engine.apply(client, "policy", 3)  # into the spare made mid-batch (v1, then v2)
        (out,) = await engine.generate([after])
        assert out.version == 3
        assert_exact_logprobs(policy_store.model_at(3), after, out)
    finally:
        go.set()
        await engine.close()
        client.close()


@pytest.mark.gpu
@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs a CUDA device (none here)"
)
async def test_cuda_engine_samples_on_the_device_with_exact_logprobs(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path, device="cuda")
    try:
        prompt = _prompt(engine, "1+2=")
        seeded = [GenerationRequest(prompt, max_new_tokens=10, seed=i) for i in range(4)]
        outputs = await engine.generate(seeded)
        again = await engine.generate(seeded[:1])
        assert outputs[0].token_ids.tolist() == again[0].token_ids.tolist()
        cpu_model = engine.model.to("cpu")  # type: ignore[attr-defined]
        for out in outputs:
            ref = recompute_logprobs(cpu_model, prompt, out.token_ids.tolist(), 1.0)
            np.testing.assert_allclose(out.logprobs, ref, atol=1e-4)
    finally:
        await engine.close()


async def test_close_cuts_a_running_batch_short(tmp_path: Path) -> None:
    from astraflow.models import build_tokenizer

    # a long batch: no EOS allowed before 4000 tokens (a SmolLM2 batch on CPU is minutes)
    spec = tiny_spec(max_position_embeddings=4096)
    context = EngineContext(
        policy="p", tokenizer=build_tokenizer(spec), work_dir=tmp_path, model=spec, seed=3
    )
    engine = build_engine({"type": "transformers", "device": "cpu"}, context)
    assert isinstance(engine, TransformersEngine)
    prompt = tuple(context.tokenizer.encode("1+1="))
    long = GenerationRequest(prompt, max_new_tokens=4000, min_new_tokens=4000)
    running = asyncio.ensure_future(engine.generate([long, long]))
    while engine.metrics()["batches"] < 1:  # the batch is on the engine thread
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    await engine.close()  # returns after the current step, not after 4000 of them
    outputs = await running
    assert [o.finish_reason for o in outputs] == ["abort", "abort"]
    assert all(len(o.token_ids) < 4000 for o in outputs)
