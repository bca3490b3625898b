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
from astraflow.records import NO_VERSION, SyncReport

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
    """The dataflow way: staleness admission and budget per node, backpressure per policy."""

    def __init__(
        self, policies: Mapping[str, PolicyConfig], queue: TaskQueue, buffers: Buffers
    ) -> None:
        self.policies, self.queue, self.buffers = policies, queue, buffers
        self.demand: dict[str, tuple[int, int]] = {}
        """Per policy: (version of the trainer's next unserved batch, its batch size)."""
        self._versions: dict[str, int] = {}

    def plan(self, sources: Sources, held: Held, latest: Versions) -> LeasePlan:
        """Admission against ``max_staleness`` and the staleness budget; backpressure
        against ``max_buffered``."""
        needed = sorted({p for s in sources for p in s.policies})
        versions = {p: v.version for p, v in latest.items()}
        limits = {p: c.max_staleness for p, c in self.policies.items()}
        refresh = regulation.admission(needed, held, versions, limits)
        # finished trainers and frozen policies: no buffer of theirs throttles
        final = {p for p, v in latest.items() if v.final} | frozen(self.policies)
        occupied = {p: 0 if p in final else self._occupied(p) for p in needed}
        budgets, spent = self._budgets(sources, held, versions, refresh, final)
        caps, full = regulation.source_caps(
            sources, self.policies, occupied, refresh, final, budgets
        )
        return LeasePlan(refresh, caps, full, spent)

    def _budgets(
        self,
        sources: Sources,
        held: Held,
        versions: Mapping[str, int],
        refresh: dict[str, str],
        final: set[str],
    ) -> tuple[dict[str, int], list[str]]:
        """Samples each policy may still have made by the node's version before they would
        arrive too stale for the trainer; a node behind the latest version whose samples
        could serve no coming batch must refresh (added to ``refresh``)."""
        budgets: dict[str, int] = {}
        spent: list[str] = []
        groups: dict[str, int] = {}
        for src in sources:
            for p in src.policies:
                groups[p] = min(groups.get(p, src.group_size), src.group_size)
        for p in sorted(groups):
            have = held.get(p, NO_VERSION)
            if p in final or p in refresh or p not in self.demand or have < 0:
                continue
            next_version, batch = self.demand[p]
            bound = self.policies[p].max_staleness
            batches = regulation.budget_batches(have, next_version, bound)
            if batches == 0 and have < versions.get(p, have):
                refresh[p] = (
                    f"samples of version {have} of {p!r} would be too stale for the trainer's "
                    f"next batch (version {next_version}, max_staleness {bound})"
                )
                continue
            budgets[p] = max(0, batches * batch - self._pending(p, next_version - bound))
            if budgets[p] < groups[p]:
                spent.append(p)
        return budgets, spent

    def _pending(self, policy: str, oldest: int) -> int:
        """Samples buffered (made by ``oldest`` or later) or in flight: not served yet."""
        fresh = sum(
            g.num_samples
            for g in self.buffers.live[policy].values()
            if g.state == "buffered" and g.behaviour_version >= oldest
        )
        return fresh + self.queue.in_flight[policy]

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
        """The sampler's batch within the staleness bound (and what the trainer needs next)."""
        taken = self.buffers.take(query, now)
        served = 1 if taken is not None else 0
        self.demand[query.policy] = (query.trainer_version + served, query.max_samples)
        return taken

    def retire(self, policy: str) -> None:
        """Nothing to do: a final version already stops buffering the policy."""

    def lease_key(self) -> Hashable:
        """What the staleness budget depends on besides the node: the trainers' demand and
        the announced versions."""
        return tuple(sorted(self.demand.items())), tuple(sorted(self._versions.items()))

    def step(self, latest: Versions, now: float) -> bool:
        """Note the announced versions (no rule runs at the end of a change)."""
        self._versions = {p: v.version for p, v in latest.items()}
        return False

    def more_to_lease(self, before: Hashable) -> bool:
        """A trainer took or announced (the budget moved on): held leases may get tasks."""
        return before != self.lease_key()

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
