"""The two regulation modes behind one interface: the service calls a ``Regulator``, never a mode.

    lease ──► plan (refresh, caps, full) ──► queue.lease(max_new) ──► leased(ids)
          └─► blocked: why the mode leases nothing now (sync: the round's state)
    take  ──► take: async: staleness bound and sampler; sync: the round's batch
    every change ──► step (inside the transaction): sync: open / complete / close rounds
    announce final ──► retire

``AsyncRegulator``: staleness admission and backpressure (``regulation.py``);
``SyncRounds`` (``rounds.py``): lock-step rounds, which replace backpressure, admission and take.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Protocol

from astraflow.data_algorithms.protocols import BatchQuery
from astraflow.dataflow import regulation
from astraflow.dataflow.buffers import Buffers
from astraflow.dataflow.config import DataflowConfig, PolicyConfig
from astraflow.dataflow.regulation import Held, LeasePlan, Sources, Versions
from astraflow.dataflow.rounds import SyncRounds
from astraflow.dataflow.store import BatchRow, Store
from astraflow.dataflow.tasks import TaskQueue
from astraflow.records import SyncReport

__all__ = ["AsyncRegulator", "Regulator", "frozen", "make_regulator"]


def frozen(policies: Mapping[str, PolicyConfig]) -> set[str]:
    """Policies that are served but never trained: never buffered, never waited for."""
    return {p for p, c in policies.items() if c.frozen}


class Regulator(Protocol):
    """What a regulation mode decides for the service (``latest``: announced versions)."""

    def plan(self, sources: Sources, held: Held, latest: Versions) -> LeasePlan:
        """Policies a node holding ``held`` must refresh, and the tasks each source may start."""
        ...

    def max_new(self) -> int | None:
        """New (never leased) tasks that may be leased now (None: no limit)."""
        ...

    def leased(self, task_ids: Iterable[str]) -> None:
        """These tasks were just leased (inside the change)."""
        ...

    def blocked(self, latest: Versions) -> str | None:
        """Why the mode leases nothing now (None: it may lease)."""
        ...

    def take(self, query: BatchQuery, now: float) -> tuple[BatchRow, bytes, int] | None:
        """A batch for the trainer, or None (inside the change)."""
        ...

    def retire(self, policy: str) -> None:
        """The trainer of ``policy`` announced its final version."""
        ...

    def lease_key(self) -> Hashable:
        """State before a change, for :meth:`more_to_lease` after it."""
        ...

    def step(self, latest: Versions, now: float) -> bool:
        """Apply the mode's rules at the end of a change; True when batches became servable."""
        ...

    def more_to_lease(self, before: Hashable) -> bool:
        """Whether a lease left empty at ``before`` may now get a task (wakes held leases)."""
        ...

    def report(self, latest: Versions) -> SyncReport | None:
        """The mode's state for the report (None: nothing beyond the buffers)."""
        ...


class AsyncRegulator:
    """The dataflow way: staleness admission per node, backpressure per policy."""

    def __init__(
        self, policies: Mapping[str, PolicyConfig], queue: TaskQueue, buffers: Buffers
    ) -> None:
        self.policies, self.queue, self.buffers = policies, queue, buffers

    def plan(self, sources: Sources, held: Held, latest: Versions) -> LeasePlan:
        """Admission against ``max_staleness``; backpressure against ``max_buffered``."""
        needed = sorted({p for s in sources for p in s.policies})
        versions = {p: v.version for p, v in latest.items()}
        limits = {p: c.max_staleness for p, c in self.policies.items()}
        refresh = regulation.admission(needed, held, versions, limits)
        # finished trainers and frozen policies: no buffer of theirs throttles
        final = {p for p, v in latest.items() if v.final} | frozen(self.policies)
        occupied = {p: 0 if p in final else self._occupied(p) for p in needed}
        caps, full = regulation.source_caps(sources, self.policies, occupied, refresh, final)
        return LeasePlan(refresh, caps, full)

    def _occupied(self, policy: str) -> int:
        buffered, _, served = self.buffers.samples(policy)
        return buffered + served + self.queue.in_flight[policy]

    def max_new(self) -> int | None:
        """No limit: backpressure bounds what is leased."""
        return None

    def leased(self, task_ids: Iterable[str]) -> None:
        """Nothing to record."""

    def blocked(self, latest: Versions) -> str | None:
        """Never blocked as a whole (the lease reason names refreshes and full buffers)."""
        return None

    def take(self, query: BatchQuery, now: float) -> tuple[BatchRow, bytes, int] | None:
        """The sampler's batch within the staleness bound."""
        return self.buffers.take(query, now)

    def retire(self, policy: str) -> None:
        """Nothing to do: a final version already stops buffering the policy."""

    def lease_key(self) -> Hashable:
        """No state decides whether a lease may get a task later."""
        return None

    def step(self, latest: Versions, now: float) -> bool:
        """No rule runs at the end of a change."""
        return False

    def more_to_lease(self, before: Hashable) -> bool:
        """Leases are never held open in async mode."""
        return False

    def report(self, latest: Versions) -> SyncReport | None:
        """Nothing beyond the buffers."""
        return None


def make_regulator(
    config: DataflowConfig,
    store: Store,
    queue: TaskQueue,
    buffers: Buffers,
    latest: Versions,
) -> Regulator:
    """The regulator of ``config.regulation.mode`` (sync: resumes the stored round)."""
    reg = config.regulation
    if reg.mode == "async":
        return AsyncRegulator(config.policies, queue, buffers)
    assert reg.sync_round_tasks is not None  # the config requires it in sync mode
    done = {p for p, v in latest.items() if v.final} | frozen(config.policies)
    active = [p for p in config.policies if p not in done]
    return SyncRounds(store, queue, buffers, reg.sync_round_tasks, active, latest)
