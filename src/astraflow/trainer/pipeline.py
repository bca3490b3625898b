"""Rank 0's two background hands: a one-batch prefetch and a one-in-flight publisher.

    main:      take(v) ─► step ─────────────► publish(v+1) ─► take(v+1) ─► step ...
    prefetch:        └─ take for v+1 (holding what is un-acked) ─┘
    publisher:                                └─ write ─► announce ─► ack(batch v) ─┘

``Prefetcher`` long-polls the next batch on its own thread while the current step computes;
at most one take is in flight, and it names every batch the trainer still holds (the one it
trains, those whose ack is in flight) so the dataflow keeps them open. A stop abandons a take
still in flight instead of waiting out its long-poll (its thread is a daemon, so the process
exits without it): a batch that take may still be given stays open at the dataflow until this
trainer takes again without naming it (after a restart) or its ack deadline, then is served
again, so nothing is lost. ``Publisher`` runs
write → announce → ack of one version on its own thread; the next version waits for it to
finish (at most one publish in flight), and a failure there stops the trainer with a
``PublishError`` naming the version, so a version is never silently lost. A batch is acked
only after the version holding its update is written and announced; a crash before that
leaves it open and the dataflow serves it again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from astraflow.errors import AstraflowError
from astraflow.records import Batch

__all__ = ["Prefetcher", "PublishError", "PublishTimes", "Publisher"]

#: How often a wait for the take in flight checks for a stop request (seconds).
_STOP_CHECK_S = 0.05


class PublishError(AstraflowError, RuntimeError):
    """A background publish, announce or ack failed: the trainer stops (versions are never
    skipped silently)."""

    code = "publish"


@dataclass(frozen=True)
class PublishTimes:
    """Seconds one version spent in the background: writing, announcing, acking."""

    version: int
    write_s: float
    announce_s: float
    ack_s: float


class Prefetcher:
    """At most one take in flight on a background thread; tracks the batches not yet acked."""

    def __init__(self) -> None:
        self._future: Future[Batch | None] | None = None
        self._lock = threading.Lock()
        self._unacked: list[str] = []
        self.abandoned = False
        """A stop left a take waiting: whatever it brings must be handed back."""

    @property
    def in_flight(self) -> bool:
        """A take was started and its result not collected yet."""
        return self._future is not None

    def holding(self) -> list[str]:
        """Batches taken and not acked yet (the dataflow must keep them open)."""
        with self._lock:
            return list(self._unacked)

    def taken(self, batch_id: str) -> None:
        """Record a batch the trainer now holds."""
        with self._lock:
            self._unacked.append(batch_id)

    def acked(self, batch_id: str) -> None:
        """Record that ``batch_id`` was acked (or never needs to be)."""
        with self._lock:
            if batch_id in self._unacked:
                self._unacked.remove(batch_id)

    def start(self, take: Callable[[], Batch | None]) -> None:
        """Start ``take`` in the background (one at a time), on a daemon thread: a take that
        is abandoned at a stop never holds up the exit of the process."""
        if self._future is not None:
            raise RuntimeError("a prefetch is already in flight")
        future: Future[Batch | None] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(take())
            except BaseException as exc:  # handed to whoever collects the result
                future.set_exception(exc)

        threading.Thread(target=run, name="prefetch", daemon=True).start()
        self._future = future

    def result(self, stop: threading.Event | None = None) -> Batch | None:
        """Wait for the take in flight; its batch (None: none came); raises what it raised.

        Once ``stop`` is set, a take still waiting is abandoned and this returns None at once
        (a batch it already brought is returned: a stop still trains it).
        """
        future, self._future = self._future, None
        if future is None:
            return None
        while stop is not None and not future.done():
            if stop.is_set():
                self.abandoned = True
                return None
            wait([future], timeout=_STOP_CHECK_S)
        return future.result()

    def close(self) -> None:
        """Forget a take still in flight (its daemon thread ends with its long-poll)."""
        self._future = None


class Publisher:
    """write → announce → ack of one version at a time, on a background thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="publish")
        self._job: Future[PublishTimes] | None = None
        self._version = -1

    def wait(self) -> PublishTimes | None:
        """Wait for the version in flight; its times (None: nothing was in flight).

        Raises:
            PublishError: it failed (the trainer must stop).
        """
        job, self._job = self._job, None
        if job is None:
            return None
        try:
            return job.result()
        except Exception as exc:
            raise PublishError(
                f"publishing version {self._version} failed in the background: {exc!r}; "
                "the trainer stops (its batch was not acked and will be served again)"
            ) from exc

    def failed(self) -> bool:
        """The version in flight already failed (checked without waiting)."""
        job = self._job
        return job is not None and job.done() and job.exception() is not None

    def submit(
        self,
        version: int,
        written: Future[Any] | None,
        announce: Callable[[], None],
        ack: Callable[[], None],
    ) -> None:
        """Finish ``version`` in the background: wait for ``written``, announce, ack."""
        if self._job is not None:
            raise RuntimeError("the previous version is still being published: wait() first")
        self._version = version
        self._job = self._pool.submit(_finish, version, written, announce, ack)

    def close(self) -> None:
        """Stop the thread after the version in flight."""
        self._pool.shutdown(wait=True)


def _finish(
    version: int, written: Future[Any] | None, announce: Callable[[], None], ack: Callable[[], None]
) -> PublishTimes:
    start = time.perf_counter()
    if written is not None:
        written.result()
    wrote = time.perf_counter()
    announce()
    announced = time.perf_counter()
    ack()
    return PublishTimes(version, wrote - start, announced - wrote, time.perf_counter() - announced)
