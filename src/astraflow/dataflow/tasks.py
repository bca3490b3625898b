"""The task queue: sources → selector → leases, with at-least-once delivery.

    selector / re-queue ──► pending ──lease──► leased ──submit──► done
                               ▲                 │ expire (ttl) / release: attempt + 1
                               └─────────────────┤
                                                 │ fail: failures + 1; at max_attempts or
                                                 ▼ not retryable ──► failed

A submit is idempotent on ``(task_id, attempt)``. A submit for a superseded attempt (the lease
expired and the task was re-queued or re-leased) is still accepted while no one has completed
the task: the work is valid and the newer lease simply becomes lost. Once a task is done or
failed, every other attempt is refused with ``lease_lost``. Methods here write through the
store inside the caller's transaction; memory follows the store (reloaded after a failure).

Leases are bound to their holder: each grant comes with a lease secret, an HMAC of
``(node_id, task_id, attempt)`` under the run's lease key (stored in ``meta``, so secrets
survive a restart). Renew, submit, fail and release must present it; node ids are public
(the report lists them), secrets are not, so a node can touch only the leases it was granted.
An attempt that was never granted (beyond the latest, or the latest while it is pending) is
unknown: 404.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from astraflow.data_algorithms.protocols import TaskSelector
from astraflow.dataflow.config import LeaseConfig, SourceConfig
from astraflow.dataflow.sources import Catalog
from astraflow.dataflow.store import Store, TaskRow
from astraflow.errors import LeaseForbiddenError, LeaseLostError, NotFoundError
from astraflow.records import LeaseRef, Task

__all__ = ["OpenTask", "TaskQueue"]

log = logging.getLogger(__name__)


@dataclass
class OpenTask:
    """A pending or leased task: its durable row and the task it delivers."""

    row: TaskRow
    task: Task
    source: SourceConfig

    def delivery(self) -> Task:
        """The task as a node receives it (with the current attempt)."""
        return self.task.model_copy(update={"attempt": self.row.attempt})


class TaskQueue:
    """Pending and leased tasks in memory, mirrored by the ``tasks`` table."""

    def __init__(
        self, store: Store, catalog: Catalog, selector: TaskSelector, config: LeaseConfig
    ) -> None:
        self.store = store
        self.catalog = catalog
        self.selector = selector
        self.config = config
        self._key = bytes.fromhex(str(store.get_meta("lease_key")))
        self.load()

    # ------------------------------------------------------------------ lease secrets

    def secret(self, node_id: str, task_id: str, attempt: int) -> str:
        """The lease secret of granting ``(task_id, attempt)`` to ``node_id``."""
        msg = f"{node_id}\0{task_id}\0{attempt}".encode()
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()[:32]

    def holds(self, node_id: str, task_id: str, attempt: int, secret: str) -> bool:
        """Whether ``secret`` proves ``(task_id, attempt)`` was granted to ``node_id``."""
        return hmac.compare_digest(self.secret(node_id, task_id, attempt), secret)

    def authorize(self, node_id: str, task_id: str, attempt: int, secret: str) -> None:
        """Refuse a request on a delivery that was never granted (404), or that names a
        delivery without its secret (403); changes nothing."""
        ot = self.open.get(task_id)
        row = ot.row if ot is not None else self.store.get_task(task_id)
        if row is None:
            raise NotFoundError(f"unknown task {task_id!r}", field="task_id")
        if attempt > row.attempt or (attempt == row.attempt and row.state == "pending"):
            raise NotFoundError(
                f"task {task_id!r} attempt {attempt} was never granted (the task is at attempt "
                f"{row.attempt}, {row.state})",
                field="attempt",
            )
        if not self.holds(node_id, task_id, attempt, secret):
            raise LeaseForbiddenError(
                f"wrong lease secret for task {task_id!r} attempt {attempt} of node "
                f"{node_id!r}: only the node granted a lease may use it",
                field="secret",
            )

    def load(self) -> None:
        """Rebuild memory from the store (start-up, or after a failed transaction)."""
        self.open: dict[str, OpenTask] = {}
        self.pending: dict[str, None] = {}
        self.by_node: dict[str, set[str]] = {}
        self.in_flight: Counter[str] = Counter()
        self.drained: set[str] = set()
        counts = self.store.task_counts()
        self.done, self.failed = counts.get("done", 0), counts.get("failed", 0)
        sources = {s.name: s.config for s in map(self.catalog.source, self.catalog.sources)}
        for row in self.store.open_tasks():
            src = sources.get(row.source)
            if src is None:
                log.warning("task of a source no longer configured task=%s", row.task_id)
                continue
            ot = OpenTask(row, Task.model_validate_json(row.body), src)
            self.open[row.task_id] = ot
            if row.state == "pending":
                self.pending[row.task_id] = None
            else:
                self._hold(ot)

    # ------------------------------------------------------------------ bookkeeping

    def _hold(self, ot: OpenTask) -> None:
        assert ot.row.node_id is not None
        self.by_node.setdefault(ot.row.node_id, set()).add(ot.row.task_id)
        for p in ot.source.policies:
            self.in_flight[p] += ot.source.group_size

    def _unhold(self, ot: OpenTask) -> None:
        if ot.row.state != "leased" or ot.row.node_id is None:
            return
        self.by_node.get(ot.row.node_id, set()).discard(ot.row.task_id)
        for p in ot.source.policies:
            self.in_flight[p] -= ot.source.group_size

    def held(self, node_id: str) -> int:
        """Leases the node holds."""
        return len(self.by_node.get(node_id, ()))

    def leased_per_node(self) -> dict[str, int]:
        """Leases held per node."""
        return {n: len(t) for n, t in self.by_node.items() if t}

    def requeue(self, ot: OpenTask, now: float) -> None:
        """Put a leased task back as attempt + 1."""
        self._unhold(ot)
        r = ot.row
        r.attempt, r.state, r.node_id, r.pool, r.deadline, r.queued_at = (
            r.attempt + 1, "pending", None, None, None, now,
        )  # fmt: skip
        self.store.update_task(r)
        self.pending[r.task_id] = None

    def _close(self, ot: OpenTask, state: str, error: str | None = None) -> None:
        self._unhold(ot)
        ot.row.state, ot.row.deadline, ot.row.error = state, None, error
        self.store.update_task(ot.row)
        self.open.pop(ot.row.task_id, None)
        self.pending.pop(ot.row.task_id, None)
        if state == "done":
            self.done += 1
        else:
            self.failed += 1

    # ------------------------------------------------------------------ lease

    def lease(
        self,
        node_id: str,
        pool: str,
        want: int,
        caps: Mapping[str, int],
        now: float,
        max_new: int | None = None,
    ) -> list[Task]:
        """Up to ``want`` tasks, at most ``caps[source]`` per source: re-queued ones first,
        then at most ``max_new`` new ones from the selector (None: no such limit)."""
        caps = dict(caps)
        chosen: list[OpenTask] = []
        for task_id in list(self.pending):
            if len(chosen) >= want:
                break
            ot = self.open[task_id]
            if caps.get(ot.source.name, 0) > 0:
                caps[ot.source.name] -= 1
                chosen.append(ot)
        new = want - len(chosen)
        fresh = self._select(new if max_new is None else min(new, max_new), caps, now)
        deadline = now + self.config.ttl_s
        for ot in chosen:
            self.pending.pop(ot.row.task_id, None)
        for ot in chosen + fresh:
            ot.row.state, ot.row.node_id, ot.row.pool, ot.row.deadline = (
                "leased", node_id, pool, deadline,
            )  # fmt: skip
        for ot in chosen:
            self.store.update_task(ot.row)
        self.store.insert_tasks(ot.row for ot in fresh)
        for ot in chosen + fresh:
            self.open[ot.row.task_id] = ot
            self._hold(ot)
        return [ot.delivery() for ot in chosen + fresh]

    def _select(self, n: int, caps: dict[str, int], now: float) -> list[OpenTask]:
        out: list[OpenTask] = []
        while n > 0:
            eligible = [s for s, c in caps.items() if c > 0]
            if not eligible:
                break
            k = min(n, *(caps[s] for s in eligible))
            refs = self.selector.select(self.catalog.restrict(eligible), k)
            for ref in refs:
                if ref.source not in caps or caps[ref.source] <= 0:
                    raise NotFoundError(f"selector returned source {ref.source!r}, not eligible")
                caps[ref.source] -= 1
                task = self.catalog.task(ref)
                if task.task_id in self.open or self.store.get_task(task.task_id) is not None:
                    log.warning("selector repeated task=%s; skipped", task.task_id)
                    continue
                src = self.catalog.source(ref.source).config
                row = TaskRow(task.task_id, src.name, task.model_dump_json(), 0, 0, "pending",
                              None, None, None, now)  # fmt: skip
                out.append(OpenTask(row, task, src))
            n -= len(refs)
            if len(refs) < k:
                self.drained.update(eligible)
                break
        return out

    def exhausted(self) -> bool:
        """Every source has run dry and no task is open."""
        return not self.open and self.drained >= set(self.catalog.sources)

    # ------------------------------------------------------------------ renew / expire

    def renew(self, node_id: str, refs: Sequence[LeaseRef], now: float) -> list[LeaseRef]:
        """Extend the node's live leases; returns the refs it lost."""
        lost: list[LeaseRef] = []
        live: list[str] = []
        for ref in refs:
            ot = self.open.get(ref.task_id)
            r = ot.row if ot is not None else None
            if (
                r is None
                or r.state != "leased"
                or r.node_id != node_id
                or r.attempt != ref.attempt
                or (r.deadline or 0.0) < now
                or not self.holds(node_id, ref.task_id, ref.attempt, ref.secret)
            ):
                lost.append(ref)
            else:
                live.append(ref.task_id)
        deadline = now + self.config.ttl_s
        for task_id in live:
            self.open[task_id].row.deadline = deadline
        self.store.renew_tasks(live, deadline)
        return lost

    def expired(self, now: float) -> list[OpenTask]:
        """Leased tasks whose deadline passed."""
        return [
            ot
            for ot in self.open.values()
            if ot.row.state == "leased" and (ot.row.deadline or 0.0) < now
        ]

    # ------------------------------------------------------------------ submit / fail / release

    def accept(self, node_id: str, task_id: str, attempt: int) -> OpenTask:
        """The open task a submission completes; raises when it may not."""
        ot = self.open.get(task_id)
        if ot is None:
            row = self.store.get_task(task_id)
            if row is None:
                raise NotFoundError(f"unknown task {task_id!r}", field="task_id")
            raise LeaseLostError(
                f"task {task_id!r} is already {row.state} (attempt {row.attempt}); "
                f"attempt {attempt} is refused",
                field="attempt",
            )
        r = ot.row
        if attempt > r.attempt:
            raise NotFoundError(
                f"task {task_id!r} has no attempt {attempt} (latest is {r.attempt})",
                field="attempt",
            )
        if attempt == r.attempt and r.state == "leased" and r.node_id != node_id:
            raise LeaseLostError(
                f"task {task_id!r} attempt {attempt} is leased to node {r.node_id!r}, "
                f"not {node_id!r}",
                field="node_id",
            )
        return ot

    def complete(self, ot: OpenTask) -> None:
        """Mark the task done."""
        self._close(ot, "done")

    def current(self, node_id: str, task_id: str, attempt: int, secret: str) -> OpenTask:
        """The node's live lease ``(task_id, attempt)``; raises ``LeaseLostError`` otherwise
        (``LeaseForbiddenError``: the secret does not prove it was granted to the node)."""
        self.authorize(node_id, task_id, attempt, secret)
        ot = self.open.get(task_id)
        if ot is None or ot.row.attempt != attempt or ot.row.state != "leased":
            raise LeaseLostError(
                f"node {node_id!r} holds no lease on task {task_id!r} attempt {attempt}",
                field="attempt",
            )
        if ot.row.node_id != node_id:
            raise LeaseLostError(
                f"task {task_id!r} attempt {attempt} is leased to node {ot.row.node_id!r}",
                field="node_id",
            )
        return ot

    def fail(self, ot: OpenTask, error: str, retryable: bool, now: float) -> bool:
        """Count a failure; re-queue (True) or fail for good (False)."""
        ot.row.failures += 1
        if retryable and ot.row.failures < self.config.max_attempts:
            ot.row.error = error
            self.requeue(ot, now)
            return True
        self._close(ot, "failed", error)
        return False

    def release(self, node_id: str, refs: Iterable[LeaseRef], now: float) -> int:
        """Re-queue the node's handed-back leases; returns how many."""
        n = 0
        for ref in refs:
            ot = self.open.get(ref.task_id)
            if (
                ot is not None
                and ot.row.state == "leased"
                and ot.row.node_id == node_id
                and ot.row.attempt == ref.attempt
                and self.holds(node_id, ref.task_id, ref.attempt, ref.secret)
            ):
                self.requeue(ot, now)
                n += 1
        return n

    def requeue_node(self, node_id: str, now: float) -> int:
        """Re-queue every lease ``node_id`` holds (its process is gone); returns how many."""
        held = sorted(self.by_node.get(node_id, ()))
        for task_id in held:
            self.requeue(self.open[task_id], now)
        return len(held)

    def counts(self) -> dict[str, int]:
        """Tasks per state."""
        return {
            "pending": len(self.pending),
            "leased": len(self.open) - len(self.pending),
            "done": self.done,
            "failed": self.failed,
        }
