"""One ``generate`` call of several requests (a group of ``n`` samples): answers in request
order, a bad request fails the call with its own error and leaves the engine serving, and a
caller that gives up takes its queued requests out of the engine. Real transformers engine,
tiny model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from astraflow.errors import ValidationError
from astraflow.raas.engines.base import GenerationRequest
from fixtures.raas import tiny_engine


def _prompt(engine: object) -> tuple[int, ...]:
    return tuple(engine.context.tokenizer.encode("1+2="))  # type: ignore[attr-defined]


async def test_a_call_answers_in_request_order(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path, batch_wait_ms=1.0)
    try:
        prompt = _prompt(engine)
        sizes = [3, 1, 4, 2]
        requests = [GenerationRequest(prompt, max_new_tokens=n, min_new_tokens=n) for n in sizes]
        outputs = await engine.generate(requests)
        assert [len(o.token_ids) for o in outputs] == sizes
        assert await engine.generate([]) == []
    finally:
        await engine.close()


async def test_a_bad_request_fails_its_call_and_the_engine_serves_on(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path, batch_wait_ms=1.0)
    try:
        prompt = _prompt(engine)
        vocab = len(engine.context.tokenizer)
        bad = GenerationRequest((*prompt, vocab + 5), max_new_tokens=2)
        with pytest.raises(ValidationError, match=str(vocab + 5)):
            await engine.generate([GenerationRequest(prompt, max_new_tokens=2), bad])
        (out,) = await engine.generate([GenerationRequest(prompt, max_new_tokens=2)])
        assert len(out.token_ids) >= 1
    finally:
        await engine.close()


async def test_a_caller_that_gives_up_takes_its_queued_requests_out(tmp_path: Path) -> None:
    # one row per batch: the second call waits in the queue behind the first
    engine = tiny_engine(tmp_path, batch_wait_ms=1.0, max_batch_size=1)
    try:
        prompt = _prompt(engine)
        long = GenerationRequest(prompt, max_new_tokens=24, min_new_tokens=24)
        first = asyncio.create_task(engine.generate([long]))
        while engine.metrics()["batches"] < 1:  # the first call's batch is running
            await asyncio.sleep(0.001)
        queued = asyncio.create_task(engine.generate([long, long, long]))
        await asyncio.sleep(0)  # its requests are queued
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert len((await first)[0].token_ids) == 24
        await engine.generate([GenerationRequest(prompt, max_new_tokens=1)])
        metrics = engine.metrics()
        # two rows were decoded, the first call's and the last one's (which may join the first
        # batch if it arrives before that batch's loop has ended): none of the cancelled three
        assert metrics["batches"] * metrics["mean_batch_size"] == 2, metrics
    finally:
        await engine.close()


async def test_calls_answered_in_one_step_wake_the_callers_loop_once(tmp_path: Path) -> None:
    """Sixteen calls (a node's tasks, each a group) answered at the same decode step: the
    engine thread hands their answers to the loop in one wake-up, not sixteen."""
    engine = tiny_engine(tmp_path, batch_wait_ms=50.0, max_batch_size=64)
    loop = asyncio.get_running_loop()
    wakes = 0
    threadsafe = loop.call_soon_threadsafe

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal wakes
        wakes += 1
        return threadsafe(*args, **kwargs)

    try:
        prompt = _prompt(engine)
        group = [GenerationRequest(prompt, max_new_tokens=3, min_new_tokens=3)] * 4
        await engine.generate(group)  # warm: the model's first batch
        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        batches = engine.metrics()["batches"]
        outputs = await asyncio.gather(*(engine.generate(group) for _ in range(16)))
        assert engine.metrics()["batches"] == batches + 1  # one batch, every row 3 tokens
        assert all(len(o.token_ids) == 3 for out in outputs for o in out)
        assert wakes == 1, wakes
    finally:
        loop.call_soon_threadsafe = threadsafe  # type: ignore[method-assign]
        await engine.close()
