"""``SubmitCoalescer``: the submissions of tasks that finish together go in one request.

Tasks leased together generate in one engine batch, so they end within a few milliseconds of
each other; sending each its own ``/v1/submit`` costs the node's event loop and the dataflow
one HTTP exchange per task. The coalescer holds each submission for up to ``wait_s``, then
sends all that arrived meanwhile as one ``/v1/submit/many`` and hands each task its own
outcome: its reply, or the error its own submit would have raised (lease lost, rejected
samples ...). The dataflow handles every submission of the request exactly as a single one
(idempotent on ``(task_id, attempt)``), so nothing else about delivery changes.

    task A ─ submit ─┐
    task B ─ submit ─┼─ wait_s ─► submit_many([A, B, C]) ─► outcome A, B, C ─► each task
    task C ─ submit ─┘

The wait ends early once no other submission can come: when ``running`` (the node's count
of tasks still running, those waiting here included) says every one of them is waiting here,
the request goes at once instead of ``wait_s`` later (the tasks of one engine batch end
together, and their samples reach the trainer that much sooner).

A feed without ``submit_many`` (or ``wait_s`` 0) gets one ``submit`` per task, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from astraflow.errors import AstraflowError, error_from_wire
from astraflow.raas.io import TaskFeed
from astraflow.records import SubmitManyReply, SubmitManyRequest, SubmitReply, SubmitRequest

__all__ = ["SubmitCoalescer"]

#: Most submissions sent in one request (a full one is sent without waiting further).
MAX_PER_REQUEST = 64


@runtime_checkable
class ManySubmits(Protocol):
    """A feed that takes several submissions in one request."""

    async def submit_many(self, req: SubmitManyRequest) -> SubmitManyReply:
        """One outcome per submission, in order."""
        ...


class SubmitCoalescer:
    """Sends submissions that arrive within ``wait_s`` of the first as one request."""

    def __init__(
        self,
        feed: TaskFeed,
        wait_s: float,
        max_per_request: int = MAX_PER_REQUEST,
        *,
        running: Callable[[], int] | None = None,
    ) -> None:
        self._feed = feed
        self._running = running
        self._many = feed if isinstance(feed, ManySubmits) and wait_s > 0 else None
        self._wait_s = wait_s
        self._max = max_per_request
        self._pending: list[tuple[SubmitRequest, asyncio.Future[SubmitReply]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()
        self.requests = 0
        """Requests sent (one per task without coalescing)."""

    async def submit(self, req: SubmitRequest) -> SubmitReply:
        """Submit ``req``, possibly together with others; raises what its own submit would."""
        if self._many is None:
            self.requests += 1
            return await self._feed.submit(req)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[SubmitReply] = loop.create_future()
        self._pending.append((req, future))
        if len(self._pending) >= self._max:
            self._send_now()
        elif self._timer is None:
            self._timer = loop.call_later(self._wait_s, self._send_now)
        self.poke()
        return await future

    def poke(self) -> None:
        """Send what is held now if every task still running is waiting here (nothing more
        can join it); the caller tells after a task ended without submitting."""
        if self._pending and self._running is not None and len(self._pending) >= self._running():
            self._send_now()

    async def close(self) -> None:
        """Send what is pending and wait for every request in flight."""
        if self._pending:
            self._send_now()
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)

    def _send_now(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        group, self._pending = self._pending, []
        if group:
            task = asyncio.get_running_loop().create_task(self._send(group))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, group: list[tuple[SubmitRequest, asyncio.Future[SubmitReply]]]) -> None:
        self.requests += 1
        try:
            if len(group) == 1:
                replies: list[SubmitReply | AstraflowError] = [await self._feed.submit(group[0][0])]
            else:
                assert self._many is not None
                got = await self._many.submit_many(SubmitManyRequest(submits=[r for r, _ in group]))
                if len(got.outcomes) != len(group):
                    raise AstraflowError(
                        f"the dataflow answered {len(got.outcomes)} outcomes to {len(group)} "
                        "submissions"
                    )
                replies = [
                    o.reply if o.reply is not None else _error(o.error, r)
                    for o, (r, _) in zip(got.outcomes, group, strict=True)
                ]
        except Exception as exc:  # the whole request failed: every task sees it
            for _, future in group:
                if not future.done():
                    future.set_exception(exc)
            return
        for reply, (_, future) in zip(replies, group, strict=True):
            if future.done():  # its task was cancelled meanwhile (lease lost, stopping)
                continue
            if isinstance(reply, AstraflowError):
                future.set_exception(reply)
            else:
                future.set_result(reply)


def _error(body: dict[str, object] | None, req: SubmitRequest) -> AstraflowError:
    return error_from_wire(
        {"error": body},
        default_message=f"submission of task {req.task_id} attempt {req.attempt} failed",
    )
