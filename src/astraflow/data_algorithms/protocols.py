"""The three plug-in points on the data path, as Protocols, and the views they are given.

A plug-in author imports this module and ``astraflow.records`` only, never the server. Each
plug-in is built as ``cls(config, rng)`` (``astraflow.plugins``), keeps its own state in
``state_dict()`` (the service persists it in the same transaction as the change that altered
it, so it survives a restart) and reports ``metrics()``.

    sources ──► TaskSelector.select ──lease──► node ──submit──► TrajectoryFilter.check
                     ▲                                               │ kept groups
                     └────────── TaskSelector.feedback ◄─────────────┤
                                                                     ▼
                    trainer ◄──take── BatchSampler.choose ◄── buffer[policy]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from astraflow.records import Sample

__all__ = [
    "BatchQuery",
    "BatchSampler",
    "GroupResult",
    "GroupView",
    "SourceView",
    "TaskCatalog",
    "TaskRef",
    "TaskSelector",
    "TrajectoryFilter",
]

# --------------------------------------------------------------------------- before rollout


@dataclass(frozen=True)
class SourceView:
    """One task source as a selector sees it."""

    name: str
    size: int
    """Rows in the source (row indices are ``0 .. size-1``)."""
    epochs: int | None
    """Passes over the source; None: unbounded."""
    weight: float
    """Share of tasks this source should get relative to the others."""
    eligible: bool
    """Whether tasks of this source may be offered in this call (workflow, backpressure,
    staleness admission); a selector returns refs of eligible sources only."""


@dataclass(frozen=True)
class TaskRef:
    """A selector's choice: row ``index`` of ``source``, in pass ``epoch``."""

    source: str
    index: int
    epoch: int


class TaskCatalog(Protocol):
    """What a selector may read about the task sources."""

    @property
    def sources(self) -> Mapping[str, SourceView]:
        """Every source by name, in config order."""
        ...

    def row(self, source: str, index: int) -> Mapping[str, Any]:
        """The row (task payload) at ``index``."""
        ...

    def row_id(self, source: str, index: int) -> str:
        """The stable id of the row at ``index`` (the id field, or the index)."""
        ...


@dataclass(frozen=True)
class GroupResult:
    """Feedback on one ingested group: what a prompt's rollouts scored."""

    source: str
    row_id: str
    epoch: int
    task_id: str
    policy: str
    rewards: tuple[float, ...]
    kept: bool
    """False when a trajectory filter dropped the group."""
    reason: str = ""
    """The filter's reason when dropped."""


@runtime_checkable
class TaskSelector(Protocol):
    """Decides which task is offered next, and adapts from feedback on ingested groups."""

    def select(self, catalog: TaskCatalog, n: int) -> list[TaskRef]:
        """Up to ``n`` new tasks from eligible sources (fewer when they are exhausted).

        Called once with ``n=0`` at start-up so a selector can check the catalogue and
        raise ``PluginError`` naming a problem (e.g. a missing curriculum field).
        """
        ...

    def feedback(self, result: GroupResult) -> None:
        """Learn from one ingested group (kept or dropped)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; keep it compact (a seed and positions, not permutations)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        ...

    def metrics(self) -> dict[str, float]:
        """Numbers for the report (e.g. skipped prompts)."""
        ...


# --------------------------------------------------------------------------- after rollout


@runtime_checkable
class TrajectoryFilter(Protocol):
    """Keeps or drops one group: the samples of one task for one policy."""

    def check(self, policy: str, group: Sequence[Sample]) -> str | None:
        """None to keep the group, or the reason it is dropped."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (often empty)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        ...

    def metrics(self) -> dict[str, float]:
        """Numbers for the report (e.g. groups dropped)."""
        ...


# --------------------------------------------------------------------------- at batch serving


@dataclass(frozen=True)
class GroupView:
    """A buffered (or, for replay, an already acked) group, without its samples."""

    key: int
    """The service's handle for the group; return it to choose the group."""
    policy: str
    group_id: str
    task_id: str
    source: str
    num_samples: int
    num_tokens: int
    behaviour_version: int
    """Oldest weight version that produced a trained token in the group (-1: none)."""
    staleness: int
    """Versions between ``behaviour_version`` and the requesting trainer (``Sample.staleness``)."""
    max_staleness: int
    """The policy's bound: the group is never served with ``staleness`` above it."""
    created_at: float
    reward_mean: float
    reward_std: float
    times_served: int
    """How often the group was acked before (0 for buffered groups)."""


@dataclass(frozen=True)
class BatchQuery:
    """The trainer's request, as a sampler sees it."""

    policy: str
    trainer_id: str
    trainer_version: int
    min_samples: int
    max_samples: int


@runtime_checkable
class BatchSampler(Protocol):
    """Picks which groups form a batch; the service enforces whole groups, sizes, staleness."""

    def choose(
        self, query: BatchQuery, buffered: Sequence[GroupView], replayable: Sequence[GroupView]
    ) -> list[int]:
        """Keys of the groups to serve, in order, aiming at ``query.max_samples`` samples.

        ``buffered`` are never-acked groups within the staleness bound, oldest first;
        ``replayable`` are acked groups kept for replay (empty unless the policy's
        ``retain_acked`` is set). The service takes the chosen groups in order while they fit
        ``max_samples``, and serves nothing if they total less than ``min_samples``.
        """
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        ...

    def metrics(self) -> dict[str, float]:
        """Numbers for the report (e.g. replayed groups)."""
        ...
