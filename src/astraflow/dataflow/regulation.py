"""Regulation rules: staleness (admission and batch bound), backpressure, lease sizing.

    lease(node, capacity) ─► admission   latest[p] - held[p] > max_staleness  → refresh p
                          ─► budget      samples made by held[p] serve the trainer's batches
                                          next[p] .. held[p] + max_staleness: at most that
                                          many batches' worth are buffered or in flight
                                          (none left: refresh p, or wait for its next version)
                          ─► backpressure max_buffered[p] - buffered[p] - in_flight[p]
                                          (in samples; 0 room → no task needing p)
                          ─► throttle     grant = min(capacity, allowance - held),
                                          allowance = max(min_lease, ceil(rate * window_s))
                                          (capacity: how many more tasks the node can start)
    take(policy, v)       ─► bound        staleness(group, v) > max_staleness → never served

``next[p]`` is the version of the trainer's next batch not served yet (a take that got a
batch for version v: v + 1; one still waiting: v). A sample made beyond the budget would only
be dropped as stale, so it is not made: the node refreshes or waits instead (a pipelined
trainer prefetches the batch for v + 1 while it computes v, so with ``max_staleness`` 1 the
weights of version v make exactly the batch trained on v + 1).

Staleness is ``records.Sample.staleness``: trainer updates between the oldest weights that
made a trained token and the trainer's version. A group's is that of its stalest sample.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from astraflow.dataflow.config import PolicyConfig, RegulationConfig, SourceConfig
from astraflow.records import NO_VERSION, PolicyVersion, Sample

__all__ = [
    "BUDGET",
    "Held",
    "LeaseDecision",
    "LeasePlan",
    "Sources",
    "Versions",
    "admission",
    "budget_batches",
    "group_behaviour_version",
    "lease_allowance",
    "lease_grant",
    "room",
    "source_caps",
    "staleness",
    "tasks_that_fit",
]


def group_behaviour_version(samples: Sequence[Sample]) -> int:
    """Oldest behaviour version in a group (``NO_VERSION`` when no sample has one)."""
    made = [v for v in (s.behaviour_version for s in samples) if v >= 0]
    return min(made) if made else NO_VERSION


def staleness(behaviour_version: int, trainer_version: int) -> int:
    """Staleness of a group whose oldest behaviour version is given (``Sample.staleness``)."""
    return 0 if behaviour_version < 0 else max(0, trainer_version - behaviour_version)


def admission(
    policies: Iterable[str],
    held: Mapping[str, int],
    latest: Mapping[str, int],
    max_staleness: Mapping[str, int],
) -> dict[str, str]:
    """Policies the node must refresh before it gets tasks needing them, with the reason.

    A policy with no announced version admits everyone; a node that reports no version of an
    announced policy holds ``NO_VERSION``.
    """
    out: dict[str, str] = {}
    for p in policies:
        if p not in latest:
            continue
        have = held.get(p, NO_VERSION)
        lag = latest[p] - have
        if lag > max_staleness[p]:
            out[p] = (
                f"holds version {have} of {p!r}, latest is {latest[p]}: "
                f"{lag} behind > max_staleness {max_staleness[p]}"
            )
    return out


#: Reason prefix of a lease left empty because the staleness budget is spent (held open).
BUDGET = "staleness budget spent"


def budget_batches(held: int, next_version: int, max_staleness: int) -> int:
    """Trainer batches, from ``next_version`` on, that may still use samples made by ``held``."""
    return max(0, held + max_staleness - next_version + 1)


def room(max_buffered: int, buffered: int, in_flight: int) -> int:
    """Samples a policy can still take before backpressure stops new tasks."""
    return max(0, max_buffered - buffered - in_flight)


def source_caps(
    sources: Sequence[SourceConfig],
    policies: Mapping[str, PolicyConfig],
    occupied: Mapping[str, int],
    refresh: Mapping[str, str],
    unbuffered: Collection[str] = (),
    budgets: Mapping[str, int] | None = None,
) -> tuple[dict[str, int], list[str]]:
    """Tasks each source may still start, and the policies that are full.

    ``occupied`` is each policy's buffered + served + in-flight samples; a source needing a
    policy the node must refresh gets nothing. ``unbuffered`` policies (frozen, or whose
    trainer finished) keep no samples, so they never limit a source. ``budgets``: samples a
    policy may still have made for its trainer's coming batches (the staleness budget).
    """
    caps: dict[str, int] = {}
    full: list[str] = []
    budgets = budgets or {}
    for s in sources:
        if any(p in refresh for p in s.policies):
            continue
        kept = [p for p in s.policies if p not in unbuffered]
        rooms = [
            min(room(policies[p].max_buffered, occupied[p], 0), budgets.get(p, UNBOUNDED_TASKS))
            for p in kept
        ]
        full += [p for p, r in zip(kept, rooms, strict=True) if r < s.group_size]
        n = tasks_that_fit(rooms, s.group_size) if kept else UNBOUNDED_TASKS
        if n > 0:
            caps[s.name] = n
    return caps, sorted(set(full))


#: A source whose policies are all unbuffered: only the node's capacity bounds its leases.
UNBOUNDED_TASKS = 1 << 30


def tasks_that_fit(rooms: Iterable[int], group_size: int) -> int:
    """Tasks (each ``group_size`` samples per policy) that fit every policy's room."""
    return min((r // group_size for r in rooms), default=0)


Sources = Sequence[SourceConfig]
"""The task sources that run one of a node's workflows."""
Held = Mapping[str, int]
"""Weight version a node holds per policy."""
Versions = Mapping[str, PolicyVersion]
"""The latest announced version per policy."""


class LeasePlan(NamedTuple):
    """What a regulation mode allows one lease request before the throttle."""

    refresh: dict[str, str]
    """Policies the node must refresh first, with the reason."""
    caps: dict[str, int]
    """Tasks each source may start now (absent: none)."""
    full: list[str]
    """Policies whose buffer is full (backpressure)."""
    spent: list[str] = []  # noqa: RUF012  # a NamedTuple default, never mutated
    """Policies whose staleness budget is spent (the node waits for their next version)."""


def lease_allowance(rate_tasks_per_s: float | None, config: RegulationConfig) -> int | None:
    """Leases a node may hold in total: what it finishes in ``window_s`` at its measured rate.

    ``rate_tasks_per_s`` is None for a node with no measured rate yet: it may then hold
    ``initial_lease`` (None: no limit beyond the capacity it asks for).
    """
    if rate_tasks_per_s is None:
        return config.initial_lease
    return max(config.min_lease, math.ceil(rate_tasks_per_s * config.window_s))


def lease_grant(capacity: int, held: int, allowance: int | None) -> int:
    """New leases for a node asking for ``capacity`` more while holding ``held``."""
    return capacity if allowance is None else max(0, min(capacity, allowance - held))


@dataclass(frozen=True)
class LeaseDecision:
    """What the rules decided for one lease request, and why."""

    capacity: int
    workflows: Sequence[str]
    runnable: bool
    """Some source runs one of the node's workflows."""
    refresh: Mapping[str, str]
    full: Sequence[str]
    spent: Sequence[str]
    held: int
    allowance: int | None
    want: int
    """Tasks the throttle allows now (before backpressure)."""

    def reason(self, granted: int, exhausted: bool) -> str:
        """Why fewer tasks than asked were granted ("" when all were)."""
        if granted >= self.capacity:
            return ""
        if not self.runnable:
            return f"no task source runs workflows {list(self.workflows)}"
        if self.want == 0:
            return (
                f"throttled: node holds {self.held} leases, its measured rate allows "
                f"{self.allowance}"
            )
        parts = []
        if self.spent and not self.refresh:
            parts.append(f"{BUDGET} for {', '.join(self.spent)}: waiting for the next version")
        if self.refresh:
            parts.append("refresh needed: " + "; ".join(self.refresh.values()))
        if self.full:
            parts.append(f"backpressure: buffer full for {', '.join(self.full)}")
        if not parts:
            parts.append(
                "no more tasks: sources exhausted"
                if exhausted
                else "queue empty for these workflows"
            )
        return "; ".join(parts)
