"""The engine's batching window stretched by ``batch_gap_ms``: requests that trickle in one by
one (as agents' calls through the endpoint do) share one batch, and ``batch_max_wait_ms``
still closes a batch while requests keep coming. Real transformers engine, tiny model."""

from __future__ import annotations

import asyncio
from pathlib import Path

from astraflow.raas.engines.base import GenerationRequest
from astraflow.raas.engines.transformers import TransformersEngine
from fixtures.raas import tiny_engine


async def _trickle(engine: TransformersEngine, n: int, apart_s: float) -> None:
    """``n`` one-request calls, each sent ``apart_s`` after the previous one."""
    prompt = tuple(engine.context.tokenizer.encode("1+2="))
    calls = []
    for i in range(n):
        if i:
            await asyncio.sleep(apart_s)
        request = GenerationRequest(prompt, max_new_tokens=2, seed=i)
        calls.append(asyncio.create_task(engine.generate([request])))
    outputs = await asyncio.gather(*calls)
    assert all(len(o) == 1 and len(o[0].token_ids) >= 1 for o in outputs)


async def test_requests_arriving_within_the_gap_share_one_batch(tmp_path: Path) -> None:
    # a 1 ms window alone would run each request arriving 30 ms apart on its own
    engine = tiny_engine(tmp_path, batch_wait_ms=1.0, batch_gap_ms=500.0, batch_max_wait_ms=20000.0)
    try:
        await _trickle(engine, 6, apart_s=0.03)
        metrics = engine.metrics()
        assert metrics["batches"] == 1 and metrics["mean_batch_size"] == 6
    finally:
        await engine.close()


async def test_the_stretched_window_is_capped(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path, batch_wait_ms=1.0, batch_gap_ms=60000.0, batch_max_wait_ms=50.0)
    try:
        await _trickle(engine, 4, apart_s=0.4)  # arrivals keep coming, 1.2 s in all
        assert engine.metrics()["batches"] >= 2, "a batch waits batch_max_wait_ms at most"
    finally:
        await engine.close()
