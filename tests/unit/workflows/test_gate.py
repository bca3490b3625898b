"""Gate: a per-event-loop concurrency limit."""

from __future__ import annotations

import asyncio

import pytest

from astraflow.workflows.gate import Gate


def test_gate_bounds_holders_and_works_across_loops() -> None:
    gate = Gate(2)
    peak = 0
    inside = 0

    async def job() -> None:
        nonlocal inside, peak
        async with gate:
            inside += 1
            peak = max(peak, inside)
            await asyncio.sleep(0.01)
            inside -= 1

    async def many() -> None:
        await asyncio.gather(*(job() for _ in range(6)))

    asyncio.run(many())
    asyncio.run(many())  # a second loop: an asyncio.Semaphore would be bound to the first
    assert peak == 2
    with pytest.raises(ValueError, match="limit"):
        Gate(0)
