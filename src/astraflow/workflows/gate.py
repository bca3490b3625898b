"""A concurrency limit that works from whichever event loop awaits it.

Rewards and sandboxes are built once and may be awaited from several event loops over their
life (a node restarting its loop, tests); an ``asyncio.Semaphore`` binds to the first loop
that waits on it, so ``Gate`` keeps one per loop. It bounds how many blocking jobs a
component hands to worker threads at once, so waiting work never occupies executor threads.
"""

from __future__ import annotations

import asyncio
import weakref

__all__ = ["Gate"]


class Gate:
    """``async with gate:`` admits at most ``limit`` holders per event loop."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a gate needs limit >= 1, got {limit}")
        self.limit = limit
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        sem = self._by_loop.get(loop)
        if sem is None:
            sem = self._by_loop[loop] = asyncio.Semaphore(self.limit)
        return sem

    async def __aenter__(self) -> None:
        await self._semaphore().acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._semaphore().release()
