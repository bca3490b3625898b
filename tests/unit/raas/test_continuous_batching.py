"""Continuous batching in the transformers engine: requests queued while a batch decodes join
it (prefilled on their own, caches left-padded to one length), keep exact logprobs and their
seeded tokens, are answered as soon as their row ends, and never join across a weight change.
Real tiny model; requests are queued from inside the running batch (a forward hook on the
engine thread) so that they arrive mid-batch by construction, not by timing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from astraflow.raas.engines.base import EngineOutput, GenerationRequest
from astraflow.raas.engines.batching import Pending, _Control
from astraflow.raas.engines.transformers import TransformersEngine
from fixtures.raas import assert_exact_logprobs, tiny_engine


def _prompt(engine: TransformersEngine, text: str) -> tuple[int, ...]:
    return tuple(engine.context.tokenizer.encode(text))


def _on_forward(engine: TransformersEngine, call: int, fn: Callable[[], None]) -> Any:
    """Run ``fn`` on the engine thread just before the model's ``call``-th forward pass."""
    seen = [0]

    def hook(module: Any, args: Any, kwargs: Any) -> None:
        seen[0] += 1
        if seen[0] == call:
            fn()

    return engine.model.register_forward_pre_hook(hook, with_kwargs=True)


def _jobs(requests: Sequence[GenerationRequest], order: list[str], tag: str) -> list[Pending]:
    """Jobs that note ``tag`` in ``order`` when answered (on the engine thread)."""
    jobs = [Pending(r) for r in requests]
    for job in jobs:
        job.future.add_done_callback(lambda _, t=tag: order.append(t))
    return jobs


async def _outputs(jobs: Sequence[Pending]) -> list[EngineOutput]:
    return list(await asyncio.gather(*(asyncio.wrap_future(j.future) for j in jobs)))


async def test_requests_queued_mid_batch_join_it_with_exact_logprobs(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path, batch_wait_ms=0.0, max_batch_size=8)
    try:
        long = [
            GenerationRequest(_prompt(engine, p), max_new_tokens=40, min_new_tokens=40, seed=i)
            for i, p in enumerate(["1+2=", "12+34="])
        ]
        late = [  # longer and shorter prompts than the running batch's; greedy, tempered, seeded
            GenerationRequest(_prompt(engine, "123+456+789="), max_new_tokens=12, seed=7),
            GenerationRequest(_prompt(engine, "9"), max_new_tokens=3, min_new_tokens=3, seed=8),
            GenerationRequest(_prompt(engine, "5*5="), max_new_tokens=10, temperature=0.0),
            GenerationRequest(_prompt(engine, "7-2="), max_new_tokens=10, temperature=0.7, seed=9),
        ]
        order: list[str] = []
        first, joining = _jobs(long, order, "long"), _jobs(late, order, "late")
        hook = _on_forward(engine, 4, lambda: engine._put(*joining))  # in the 3rd decode step
        try:
            engine._put(*first)
            outputs = await _outputs(first + joining)
        finally:
            hook.remove()
        assert engine.metrics()["batches"] == 1, "the late requests ran in a batch of their own"
        assert order == ["late"] * 4 + ["long"] * 2, "joined rows waited for the batch's end"
        for request, out in zip(long + late, outputs, strict=True):
            assert_exact_logprobs(engine.model, request, out)
        assert [len(o.token_ids) for o in outputs[:2]] == [40, 40]
        assert len(outputs[3].token_ids) == 3
        for request, out in zip(late, outputs[2:], strict=True):  # as if decoded alone
            if request.seed is not None or request.temperature == 0:
                (alone,) = await engine.generate([request])
                assert out.token_ids.tolist() == alone.token_ids.tolist()
    finally:
        await engine.close()


async def test_a_weight_change_queued_mid_batch_waits_and_closes_joins(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path, batch_wait_ms=0.0, max_batch_size=8)
    try:
        order: list[str] = []
        (running,) = _jobs([GenerationRequest(_prompt(engine, "3+3="), max_new_tokens=20,
                                              min_new_tokens=20)], order, "running")  # fmt: skip
        (before,) = _jobs([GenerationRequest(_prompt(engine, "1="), max_new_tokens=2)], order,
                          "before")  # fmt: skip
        (after,) = _jobs([GenerationRequest(_prompt(engine, "2="), max_new_tokens=2)], order,
                         "after")  # fmt: skip
        control = _Control(lambda: order.append("control"))  # e.g. a weight swap
        hook = _on_forward(engine, 3, lambda: engine._put(before, control, after))
        try:
            engine._put(running)
            await _outputs([running, before, after])
            await asyncio.wrap_future(control.future)
        finally:
            hook.remove()
        # `before` joined the running batch; the change ran after it; `after` did not jump it
        assert order == ["before", "running", "control", "after"]
        assert engine.metrics()["batches"] == 2
    finally:
        await engine.close()


async def test_continuous_batching_off_answers_at_the_batch_end(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path, batch_wait_ms=0.0, max_batch_size=8, continuous=False)
    try:
        order: list[str] = []
        (running,) = _jobs([GenerationRequest(_prompt(engine, "3+3="), max_new_tokens=20,
                                              min_new_tokens=20)], order, "running")  # fmt: skip
        (late,) = _jobs([GenerationRequest(_prompt(engine, "1="), max_new_tokens=2)], order,
                        "late")  # fmt: skip
        hook = _on_forward(engine, 3, lambda: engine._put(late))
        try:
            engine._put(running)
            await _outputs([running, late])
        finally:
            hook.remove()
        assert order == ["running", "late"] and engine.metrics()["batches"] == 2
    finally:
        await engine.close()


async def test_rows_with_one_prompt_share_one_prefill_and_decode_as_if_alone(
    tmp_path: Path,
) -> None:
    """A group's ``n`` samples of one prompt: the prefill runs each distinct prompt once, and
    every row's tokens and logprobs are those it gets decoded on its own."""
    engine = tiny_engine(tmp_path, batch_wait_ms=50.0, max_batch_size=32)
    try:
        prompts = [_prompt(engine, p) for p in ("1+2=", "12+34=", "7*8=")]
        requests = [
            GenerationRequest(p, max_new_tokens=6, min_new_tokens=2, seed=10 * i + k)
            for i, p in enumerate(prompts)
            for k in range(4)
        ]
        rows: list[int] = []
        embed = engine.model.get_input_embeddings()
        hook = embed.register_forward_hook(lambda _m, args, _o: rows.append(args[0].shape[0]))
        try:
            outputs = await engine.generate(requests)
        finally:
            hook.remove()
        assert engine.metrics()["batches"] == 1
        assert rows[0] == 3, f"the prefill ran {rows[0]} rows for 3 distinct prompts"
        assert rows[1] == 12
        for request, out in zip(requests, outputs, strict=True):
            assert_exact_logprobs(engine.model, request, out)
            (alone,) = await engine.generate([request])
            assert out.token_ids.tolist() == alone.token_ids.tolist()
    finally:
        await engine.close()
