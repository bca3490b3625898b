"""A dedicated engine thread that batches concurrent requests and orders weight changes.

Workflows call ``generate`` from the event loop at any time; the requests queue up here.
The thread takes the first one, keeps collecting for ``batch_wait_s`` (or until
``max_batch_size``), then runs the batch. With ``batch_gap_s`` the window stretches while
requests keep arriving less than that apart (to ``batch_max_wait_s`` at most): callers whose
requests reach the queue one by one (agents over HTTP, each call parsed and rendered in
turn) still share one batch instead of splitting it at an arbitrary point. Weight changes
(``call``) queue on the same thread, so they run *between* batches, never inside one, and
every token of a batch comes from one weight version; a change marked ``overlap`` (one that
leaves the running rows' weights alone, like the transformers engine's swap to its spare
model) runs between two decode steps instead, without closing the batch to new requests.

    generate() ─┐                  ┌─► control jobs first (load / apply weights)
    generate() ─┼─► queue ─► thread ┤
    call(fn)  ──┘                  └─► one batch ─► futures resolved on the caller's loop

``close`` stops the thread; pending and later requests fail with ``ServiceUnavailableError``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from astraflow.errors import AstraflowError, ServiceUnavailableError, ValidationError
from astraflow.raas.engines.base import EngineOutput, GenerationRequest, check_prompt

__all__ = ["BatchingEngine", "Pending"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Pending:
    """One queued generation request and where its result goes."""

    request: GenerationRequest
    future: Future[EngineOutput] = field(default_factory=Future)
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class _Control:
    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)
    overlap: bool = False
    """May run between two decode steps of a running batch (it does not touch what the batch
    decodes with, e.g. a swap to a second model); else it waits for the batch to end."""


class _Stop:
    pass


class _Waker:
    """Runs callbacks on one event loop from other threads, with one wake-up for all that are
    handed over together: the engine thread defers the answers of one decode step and kicks
    the loop once after it, so 16 calls answered at one step wake the callers' loop once, not
    16 times (each wake-up is a write to the loop's self-pipe, and the loop's thread then
    contends with the engine's for the GIL)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self._pending: list[Callable[[], None]] = []
        self._scheduled = False

    def call(self, fn: Callable[[], None], *, defer: bool = False) -> None:
        """Run ``fn`` on the loop soon; with ``defer``, at the next ``kick`` (dropped if the
        loop has closed: nobody waits then)."""
        with self._lock:
            self._pending.append(fn)
            if defer or self._scheduled:
                return
            self._scheduled = True
        self._schedule()

    def kick(self) -> None:
        """Wake the loop for what was deferred (if it is not woken already)."""
        with self._lock:
            if self._scheduled or not self._pending:
                return
            self._scheduled = True
        self._schedule()

    def _schedule(self) -> None:
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the loop is gone")
            loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the caller's loop already closed
            with self._lock:
                self._pending.clear()
                self._scheduled = False

    def _run(self) -> None:
        with self._lock:
            todo, self._pending = self._pending, []
            self._scheduled = False
        for fn in todo:
            try:
                fn()
            except Exception:  # one callback must not keep the others from running
                log.exception("engine callback failed")


_Job = Pending | _Control | _Stop


class BatchingEngine(abc.ABC):
    """Shared machinery of in-process engines: one thread, a batching queue, ordered control.

    Subclasses implement ``_run_batch`` (called on the engine thread with a non-empty list,
    resolving every ``Pending.future``) and may run setup on the thread via ``call``.
    """

    def __init__(
        self,
        *,
        name: str,
        max_batch_size: int,
        batch_wait_s: float,
        batch_gap_s: float = 0.0,
        batch_max_wait_s: float = 1.0,
    ) -> None:
        self._name = name
        self._max_batch = max_batch_size
        self._wait_s = batch_wait_s
        self._gap_s = batch_gap_s
        self._max_wait_s = max(batch_max_wait_s, batch_wait_s)
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._lock = threading.Lock()  # no job can be queued behind the stop marker
        self._batches = 0
        self._batched = 0
        self._busy_s = 0.0
        self._cpu_s = 0.0  # the engine thread's CPU seconds, last read
        self._wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Waker] = (
            weakref.WeakKeyDictionary()
        )
        """One per callers' loop: answers of one decode step wake it once."""
        self._wakers_lock = threading.Lock()
        self._holding = False  # engine thread: answers wait for ``_release_wakes``
        self._held: set[_Waker] = set()
        self._backlog: list[_Job] = []
        """Jobs taken off the queue that run before it (met while collecting or joining)."""
        self._joins_closed = False
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- caller side

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[EngineOutput]:
        """Queue every request and wait for all of them (see ``Engine.generate``).

        The caller's loop is woken once per call, when the last request is answered or the
        first one fails, not once per request (a group of ``n`` samples is one call), and calls
        answered together wake it once between them (``_Waker``). The
        first failure in request order is raised and the requests still queued or running are
        cancelled; a caller cancelled while waiting cancels them all too.
        """
        jobs = [Pending(r) for r in requests]
        if not jobs:
            return []
        loop = asyncio.get_running_loop()
        with self._wakers_lock:  # callers may run several loops, each on its own thread
            waker = self._wakers.get(loop)
            if waker is None:
                waker = self._wakers[loop] = _Waker(loop)
        settled: asyncio.Future[None] = loop.create_future()
        left = len(jobs)
        lock = threading.Lock()

        def settle() -> None:
            if not settled.done():
                settled.set_result(None)

        def answered(future: Future[EngineOutput]) -> None:  # the engine thread, mostly
            nonlocal left
            failed = not future.cancelled() and future.exception() is not None
            with lock:
                left -= 1
                last = left == 0
            if last or failed:
                self._wake(waker, settle)

        for job in jobs:
            job.future.add_done_callback(answered)
        self._put(*jobs)
        try:
            await settled
        finally:
            for job in jobs:  # cancelled, or one failed: what has not run yet never will
                job.future.cancel()
        for job in jobs:
            if job.future.done() and not job.future.cancelled():
                exc = job.future.exception()
                if exc is not None:
                    raise exc
        return [job.future.result() for job in jobs]

    async def call(self, fn: Callable[[], T], *, overlap: bool = False) -> T:
        """Run ``fn`` on the engine thread between batches; return its result. With
        ``overlap``, between two decode steps of a running batch (joins stay open): for what
        leaves the rows already decoding untouched."""
        job = _Control(fn, overlap=overlap)
        self._put(job)
        result: T = await asyncio.wrap_future(job.future)
        return result

    def metrics(self) -> dict[str, float]:
        """Batches run, their mean size (how well concurrent requests were batched), the
        seconds spent generating (``busy_s``: busy fraction = its growth / wall time) and the
        engine thread's CPU seconds so far, read now, mid-batch too (``cpu_s``: what
        generating and loading weights cost, apart from the process's other threads)."""
        mean = self._batched / self._batches if self._batches else 0.0
        return {
            "batches": float(self._batches),
            "mean_batch_size": mean,
            "busy_s": self._busy_s,
            "cpu_s": self._thread_cpu_s(),
        }

    def _thread_cpu_s(self) -> float:
        """CPU seconds of the engine thread: a counter that never goes back (once the
        thread has ended, or where there is no per-thread clock, its last reading)."""
        ident = self._thread.ident
        if ident is not None and self._thread.is_alive():
            # OSError: the thread ended just now; AttributeError: no per-thread clock here
            with contextlib.suppress(OSError, AttributeError):
                now = time.clock_gettime(time.pthread_getcpuclockid(ident))
                self._cpu_s = max(self._cpu_s, now)
        return self._cpu_s

    def call_blocking(self, fn: Callable[[], T], timeout_s: float | None = None) -> T:
        """Run ``fn`` on the engine thread from a thread that is not an event loop's."""
        job = _Control(fn)
        self._put(job)
        result: T = job.future.result(timeout=timeout_s)
        return result

    async def close(self) -> None:
        """Stop the thread after the running batch; fail everything still queued."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            self._jobs.put(_Stop())
        await asyncio.to_thread(self._thread.join)
        self._shutdown()

    def _put(self, *jobs: _Job) -> None:
        with self._lock:
            if self._closed.is_set():
                raise ServiceUnavailableError(f"the engine of policy {self._name!r} is closed")
            for job in jobs:
                self._jobs.put(job)

    # ----------------------------------------------------------------- engine thread

    @abc.abstractmethod
    def _run_batch(self, batch: list[Pending]) -> None:
        """Generate for every pending request and resolve its future (engine thread)."""

    @staticmethod
    def _admit(
        batch: list[Pending], vocab: int, context_len: int | None
    ) -> list[tuple[Pending, int]]:
        """The jobs whose prompt the model can take, each with its new-token budget; every
        other job fails with its validation error."""
        admitted: list[tuple[Pending, int]] = []
        for job in batch:
            try:
                admitted.append((job, check_prompt(job.request, vocab, context_len)))
            except ValidationError as exc:
                job.future.set_exception(exc)
        return admitted

    def _shutdown(self) -> None:  # noqa: B027  # optional hook, empty by default
        """Release resources after the thread stopped (override when needed)."""

    def _more(self, room: int) -> list[Pending]:
        """Engine thread, inside a batch: up to ``room`` requests queued since it started, to
        join it (continuous batching). None once a control or stop job is met: it waits in
        the backlog and runs after the batch, before every request queued behind it. A control
        marked ``overlap`` runs here, between decode steps, and joins go on after it."""
        got: list[Pending] = []
        while len(got) < room and not self._joins_closed:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, _Control) and job.overlap:
                self._run_control(job)
            elif not isinstance(job, Pending):
                self._backlog.append(job)
                self._joins_closed = True
            elif job.future.set_running_or_notify_cancel():  # else its caller gave up
                got.append(job)
        self._batched += len(got)
        return got

    def _loop(self) -> None:
        backlog = self._backlog
        while True:
            job = backlog.pop(0) if backlog else self._jobs.get()
            if isinstance(job, _Stop):
                break
            if isinstance(job, _Control):
                self._run_control(job)
                continue
            batch, controls, stop = self._collect(job, backlog)
            for control in controls:
                self._run_control(control)
            # a caller that gave up (task cancelled) cancelled its future: skip it
            batch = [j for j in batch if j.future.set_running_or_notify_cancel()]
            if batch:
                self._batches += 1
                self._batched += len(batch)
                self._joins_closed = bool(backlog)  # what waits there goes first
                started = time.perf_counter()
                self._run_safely(batch)
                self._busy_s += time.perf_counter() - started
            if stop:
                break
        self._drain(backlog)

    def _collect(
        self, first: Pending, backlog: list[_Job]
    ) -> tuple[list[Pending], list[_Control], bool]:
        """Gather requests for ``batch_wait_s`` (stretched by each arrival to ``batch_gap_s``
        after it, up to ``batch_max_wait_s``); controls met on the way run first."""
        batch: list[Pending] = [first]
        controls: list[_Control] = []
        opened = time.monotonic()
        deadline = opened + max(self._wait_s, min(self._gap_s, self._max_wait_s))
        while len(batch) < self._max_batch:
            if backlog:
                job: _Job = backlog.pop(0)
            else:
                remaining = deadline - time.monotonic()
                try:
                    job = (
                        self._jobs.get(timeout=remaining)
                        if remaining > 0
                        else self._jobs.get_nowait()
                    )
                except queue.Empty:
                    break
            if isinstance(job, _Stop):
                return batch, controls, True
            if isinstance(job, _Control):
                controls.append(job)
            else:
                batch.append(job)
                if self._gap_s > 0:
                    cap = opened + self._max_wait_s
                    deadline = max(deadline, min(time.monotonic() + self._gap_s, cap))
        return batch, controls, False

    def _run_control(self, job: _Control) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(job.fn())
        except Exception as exc:  # delivered to the awaiting caller
            job.future.set_exception(exc)

    def _wake(self, waker: _Waker, fn: Callable[[], None]) -> None:
        if self._holding and threading.current_thread() is self._thread:
            waker.call(fn, defer=True)
            self._held.add(waker)
        else:
            waker.call(fn)

    def _release_wakes(self) -> None:
        """Engine thread, after a decode step: wake each waiting loop once for the answers of
        the step (subclasses call it between steps; every batch ends with it)."""
        held, self._held = self._held, set()
        for waker in held:
            waker.kick()

    def _run_safely(self, batch: list[Pending]) -> None:
        self._holding = True
        try:
            self._run_answering(batch)
        finally:
            self._holding = False
            self._release_wakes()

    def _run_answering(self, batch: list[Pending]) -> None:
        try:
            self._run_batch(batch)
            unanswered = [j for j in batch if not j.future.done()]
            if unanswered:  # a bug in the engine: fail its callers rather than leave them hanging
                raise RuntimeError(f"the engine ended a batch without answering {len(unanswered)}"
                                   f" of its {len(batch)} requests")  # fmt: skip
        except AstraflowError as exc:  # expected (no weights yet, closed): the callers see it
            log.warning("engine batch refused policy=%s size=%d: %s", self._name, len(batch), exc)
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(exc)
        except Exception as exc:  # one failed batch fails its requests, not the engine
            log.exception("engine batch failed policy=%s size=%d", self._name, len(batch))
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(exc)

    def _drain(self, backlog: list[_Job]) -> None:
        closed = ServiceUnavailableError(f"the engine of policy {self._name!r} was closed")
        while True:
            try:
                job = backlog.pop(0) if backlog else self._jobs.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, (Pending, _Control)) and not job.future.done():
                job.future.set_exception(closed)
