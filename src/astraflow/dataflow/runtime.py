"""Runs a ``DataflowService`` under asyncio: one writer thread, long-poll takes, a sweeper.

    handler ──await call(fn, req)──► [writer thread] service.fn(req) ──► reply
    take:    loop { ev = event[policy]; batch = call(take); if batch: return it;
                    wait(ev, remaining) or time out → None }
    lease:   the same loop while the sync round, or (async) the staleness budget, leaves the
             lease empty (woken when the round opens or gets tasks back, or when a trainer
             takes or announces; ``regulation.sync_lease_hold_s``)
    sweeper: every interval until stopped: call(sweep)  (lease and batch expiry)

Every SQLite access happens on the writer thread, so the event loop never blocks on it; a
buffer change (submit, re-buffered batch) sets the policy's event and wakes its long-polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import TypeVar

from astraflow.dataflow.regulation import BUDGET
from astraflow.dataflow.rounds import BLOCKED
from astraflow.dataflow.service import DataflowService, TakenBatch
from astraflow.records import (
    HandBackReply,
    HandBackRequest,
    LeaseReply,
    LeaseRequest,
    PolicyVersion,
    TakeBatchRequest,
    WatchVersionsRequest,
)

__all__ = ["WRITER_TIMES", "ServiceRuntime"]

log = logging.getLogger(__name__)

WRITER_TIMES: ContextVar[list[tuple[float, float]] | None] = ContextVar(
    "writer_times", default=None
)
"""Per request (set by the app): (seconds queued for, seconds run on) the writer per call."""

R = TypeVar("R")


class ServiceRuntime:
    """The service's asyncio adapter (start in the app's lifespan, stop on shutdown)."""

    def __init__(self, service: DataflowService) -> None:
        self.service = service
        self.max_take_timeout_s = service.config.limits.max_take_timeout_s
        self.sweep_interval_s = min(0.5, service.config.lease.ttl_s / 4)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dataflow-writer")
        self._events: dict[str, asyncio.Event] = {}
        self._takers: dict[tuple[str, str], set[asyncio.Event]] = {}
        """The hang-up events of the takes waiting, per (policy, trainer)."""
        self._round = asyncio.Event()
        self._announced = asyncio.Event()
        """Replaced and set at each announcement: wakes the version watches."""
        self.lease_hold_s = service.config.regulation.sync_lease_hold_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Hook buffer changes to this loop and start the sweeper."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._stop = asyncio.Event()

        def wake(policy: str) -> None:  # called on the writer thread
            loop.call_soon_threadsafe(self._wake, policy)

        self.service.on_buffer_change = wake

        def round_changed() -> None:  # called on the writer thread
            loop.call_soon_threadsafe(self._wake_round)

        self.service.on_round_change = round_changed
        self._round = asyncio.Event()
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="dataflow-sweeper")

    async def stop(self) -> None:
        """Stop the sweeper and wait for the writer thread to finish its work."""
        if self._stop is not None:
            self._stop.set()
        self._wake_round()  # held leases answer now
        self.announced()  # and version watches
        if self._sweeper is not None:
            await self._sweeper
        self.service.on_buffer_change = None
        self.service.on_round_change = None
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)

    async def call(self, fn: Callable[..., R], *args: object) -> R:
        """Run a service method on the writer thread (timed into :data:`WRITER_TIMES`)."""
        loop = self._loop or asyncio.get_running_loop()
        queued = time.perf_counter()
        began = 0.0

        def run() -> R:
            nonlocal began
            began = time.perf_counter()
            return fn(*args)

        try:
            return await loop.run_in_executor(self._executor, run)
        finally:
            times = WRITER_TIMES.get()
            if times is not None and began:
                times.append((began - queued, time.perf_counter() - began))

    def _event(self, policy: str) -> asyncio.Event:
        ev = self._events.get(policy)
        if ev is None:
            ev = self._events[policy] = asyncio.Event()
        return ev

    def _wake(self, policy: str) -> None:
        ev = self._events.pop(policy, None)
        if ev is not None:
            ev.set()

    def _wake_round(self) -> None:
        ev, self._round = self._round, asyncio.Event()
        ev.set()

    async def lease(self, req: LeaseRequest) -> LeaseReply:
        """A lease; in sync mode one the round leaves empty is held until the round changes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lease_hold_s
        while True:
            ev = self._round  # taken before trying: no wake-up is lost
            reply = await self.call(self.service.lease, req)
            remaining = deadline - loop.time()
            waits = reply.reason.startswith((BLOCKED, BUDGET))  # for a round, a version
            held = not reply.tasks and not reply.refresh and waits
            if not held or remaining <= 0 or (self._stop is not None and self._stop.is_set()):
                return reply
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), remaining)

    async def take_batch(
        self, req: TakeBatchRequest, gone: asyncio.Event | None = None
    ) -> TakenBatch | None:
        """Long-poll: a batch as soon as one qualifies, or None after the timeout, or as soon
        as ``gone`` is set (the trainer hung up: a stopping trainer is given no batch)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(req.timeout_s, self.max_take_timeout_s)
        s = self.service
        gone = gone if gone is not None else asyncio.Event()
        key = (req.policy, req.trainer_id)
        self._takers.setdefault(key, set()).add(gone)
        handle = await self.call(s.wait_started, req.trainer_id, req.policy, req.trainer_version)
        try:
            while True:
                ev = self._event(req.policy)  # taken before trying: no wake-up is lost
                got = await self.call(s.take_batch, req)
                if got is not None and gone.is_set():  # taken as the trainer hung up
                    await self.call(s.give_back, got[0])
                    return None
                remaining = deadline - loop.time()
                if got is not None or remaining <= 0:
                    return got
                if await _first(ev, gone, remaining) is gone:
                    return None
        finally:
            takers = self._takers.get(key)
            if takers is not None:
                takers.discard(gone)
                if not takers:
                    del self._takers[key]
            with contextlib.suppress(RuntimeError):  # the writer is gone when shutting down
                await self.call(s.wait_ended, req.trainer_id, req.policy, handle)

    def announced(self) -> None:
        """A version was announced: the version watches look again."""
        ev, self._announced = self._announced, asyncio.Event()
        ev.set()

    async def watch_versions(
        self, req: WatchVersionsRequest, gone: asyncio.Event | None = None
    ) -> dict[str, PolicyVersion]:
        """Long-poll: the latest versions once one named in ``req.known`` is newer than the
        version given for it, at the timeout, when ``gone`` is set or the service stops."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(req.timeout_s, self.max_take_timeout_s)
        gone = gone if gone is not None else asyncio.Event()
        while True:
            ev = self._announced  # taken before looking: no announcement is missed
            latest = await self.call(self.service.versions)
            newer = any(v.version > req.known[p] for p, v in latest.items() if p in req.known)
            remaining = deadline - loop.time()
            stopping = self._stop is not None and self._stop.is_set()
            if newer or not req.known or remaining <= 0 or stopping or gone.is_set():
                return latest
            await _first(ev, gone, remaining)

    async def hand_back(self, req: HandBackRequest) -> HandBackReply:
        """End the trainer's waiting takes (they give no batch), then buffer its open
        batches again but those it still holds."""
        for gone in self._takers.get((req.policy, req.trainer_id), ()):
            gone.set()
        return await self.call(self.service.hand_back, req)

    async def _sweep_loop(self) -> None:
        assert self._stop is not None
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.sweep_interval_s)
            if self._stop.is_set():
                return
            try:
                await self.call(self.service.sweep)
            except Exception:  # the sweeper must outlive one bad sweep; it is logged
                log.exception("sweep failed")


async def _first(a: asyncio.Event, b: asyncio.Event, timeout_s: float) -> asyncio.Event | None:
    """Wait until ``a`` or ``b`` is set (``b`` wins a tie) or ``timeout_s``; which one (None:
    neither)."""
    waiters = [asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
    return b if b.is_set() else a if a.is_set() else None
