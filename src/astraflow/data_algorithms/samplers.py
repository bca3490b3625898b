"""Built-in batch samplers: which buffered groups form a trainer's batch.

    fifo       oldest group first
    freshest   newest weights first (highest behaviour version, then newest)
    edf        earliest deadline first: the group that would soonest exceed max_staleness
    replay     up to `ratio` of the batch from acked groups kept for replay, rest fresh
    mixing     fill the batch so task sources get samples in proportion to their weights

The service has already removed groups beyond the staleness bound and enforces whole groups
and ``min/max_samples``; a sampler only orders and picks.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, field_validator

from astraflow.config import ConfigModel
from astraflow.data_algorithms import SAMPLERS
from astraflow.data_algorithms.protocols import BatchQuery, GroupView
from astraflow.plugins import Configured

__all__ = [
    "EdfSampler",
    "FifoSampler",
    "FreshestSampler",
    "MixingSampler",
    "ReplaySampler",
    "fit",
]

Order = Literal["fifo", "freshest", "edf"]
ConfigT = TypeVar("ConfigT", bound=BaseModel)


def _fifo(groups: Sequence[GroupView]) -> list[GroupView]:
    return sorted(groups, key=lambda g: (g.created_at, g.key))


def _freshest(groups: Sequence[GroupView]) -> list[GroupView]:
    return sorted(groups, key=lambda g: (-g.behaviour_version, -g.created_at, -g.key))


def _edf(groups: Sequence[GroupView]) -> list[GroupView]:
    def deadline(g: GroupView) -> float:
        # the trainer version at which this group would exceed the staleness bound
        return math.inf if g.behaviour_version < 0 else g.behaviour_version + g.max_staleness

    return sorted(groups, key=lambda g: (deadline(g), g.created_at, g.key))


ORDERS: dict[str, Callable[[Sequence[GroupView]], list[GroupView]]] = {
    "fifo": _fifo,
    "freshest": _freshest,
    "edf": _edf,
}


def fit(groups: Sequence[GroupView], budget: int) -> list[GroupView]:
    """Groups in order while their samples fit ``budget`` (a group that does not fit is skipped)."""
    out: list[GroupView] = []
    for g in groups:
        if g.num_samples <= budget:
            out.append(g)
            budget -= g.num_samples
    return out


class _Stateless(Configured[ConfigT]):
    """Samplers whose only state is their config and counters."""

    def __init__(self, config: ConfigT, rng: random.Random | None = None) -> None:
        super().__init__(config, rng)
        self.batches = 0

    def state_dict(self) -> dict[str, Any]:
        """Counters."""
        return {"batches": self.batches}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore counters."""
        self.batches = int(state.get("batches", 0))

    def metrics(self) -> dict[str, float]:
        """Batches composed."""
        return {"batches": float(self.batches)}


class _Ordered(_Stateless[BaseModel]):
    order: Order = "fifo"

    def choose(
        self, query: BatchQuery, buffered: Sequence[GroupView], replayable: Sequence[GroupView]
    ) -> list[int]:
        """Buffered groups in this sampler's order."""
        self.batches += 1
        return [g.key for g in fit(ORDERS[self.order](buffered), query.max_samples)]


@SAMPLERS.register("fifo")
class FifoSampler(_Ordered):
    """Oldest group first."""


@SAMPLERS.register("freshest")
class FreshestSampler(_Ordered):
    """Groups made by the newest weights first."""

    order: Order = "freshest"


@SAMPLERS.register("edf")
class EdfSampler(_Ordered):
    """Earliest deadline first: groups closest to the staleness bound go first."""

    order: Order = "edf"


class ReplayConfig(ConfigModel):
    """Arguments of the ``replay`` sampler."""

    ratio: float = Field(default=0.25, ge=0.0, lt=1.0)
    """Largest share of a batch's samples taken from acked groups kept for replay."""
    order: Order = "fifo"
    """Order of fresh (never acked) groups."""
    pick: Literal["uniform", "recent"] = "uniform"
    """Which kept groups to replay: uniformly at random, or the most recently made."""


@SAMPLERS.register("replay")
class ReplaySampler(_Stateless[ReplayConfig]):
    """Reuse acked groups (kept with the policy's ``retain_acked``) for part of each batch."""

    Config = ReplayConfig

    def __init__(self, config: ReplayConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        self.rng = rng
        self.replayed_groups = 0
        self.fresh_groups = 0

    def choose(
        self, query: BatchQuery, buffered: Sequence[GroupView], replayable: Sequence[GroupView]
    ) -> list[int]:
        """Fresh groups first, then replayed ones, never more than ``ratio`` of the samples.

        A choice short of ``min_samples`` serves nothing (the service asks again as groups
        arrive): it returns no keys and is not counted, so the counters are what was served.
        """
        ratio = self.config.ratio
        if self.config.pick == "recent":
            pool = sorted(replayable, key=lambda g: (-g.created_at, -g.key))
        else:
            pool = list(replayable)
            self.rng.shuffle(pool)
        # room kept for replay; with nothing to replay, fresh groups fill the batch
        reserve = min(math.floor(ratio * query.max_samples), sum(g.num_samples for g in pool))
        fresh = fit(ORDERS[self.config.order](buffered), query.max_samples - reserve)
        n_fresh = sum(g.num_samples for g in fresh)
        budget = min(query.max_samples - n_fresh, math.floor(n_fresh * ratio / (1 - ratio)))
        replay = fit(pool, budget)
        if n_fresh + sum(g.num_samples for g in replay) < query.min_samples:
            return []
        self.batches += 1
        self.fresh_groups += len(fresh)
        self.replayed_groups += len(replay)
        return [g.key for g in fresh] + [g.key for g in replay]

    def state_dict(self) -> dict[str, Any]:
        """Counters."""
        return {
            **super().state_dict(),
            "replayed": self.replayed_groups,
            "fresh": self.fresh_groups,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore counters."""
        super().load_state_dict(state)
        self.replayed_groups = int(state.get("replayed", 0))
        self.fresh_groups = int(state.get("fresh", 0))

    def metrics(self) -> dict[str, float]:
        """Fresh and replayed groups served."""
        return {
            **super().metrics(),
            "replayed_groups": float(self.replayed_groups),
            "fresh_groups": float(self.fresh_groups),
        }


class MixingConfig(ConfigModel):
    """Arguments of the ``mixing`` sampler."""

    weights: dict[str, float]
    """Share of each batch's samples per task source (relative weights, by source name)."""
    fill: bool = True
    """Fill what the sources' shares leave of the batch from any source, oldest first (else
    each source gets at most its share, and a batch may miss ``min_samples``)."""

    @field_validator("weights")
    @classmethod
    def _check_weights(cls, v: dict[str, float]) -> dict[str, float]:
        if not v or any(w < 0 for w in v.values()) or not any(w > 0 for w in v.values()):
            raise ValueError("needs at least one source with a positive weight, none negative")
        return v


@SAMPLERS.register("mixing")
class MixingSampler(_Stateless[MixingConfig]):
    """Compose batches whose samples come from task sources in proportion to weights."""

    Config = MixingConfig

    def __init__(self, config: MixingConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        self.served: Counter[str] = Counter()

    def choose(
        self, query: BatchQuery, buffered: Sequence[GroupView], replayable: Sequence[GroupView]
    ) -> list[int]:
        """Oldest first within a source; the source furthest below its share goes next."""
        self.batches += 1
        weights = self.config.weights
        total_weight = sum(weights.values())
        quota = {s: w / total_weight * query.max_samples for s, w in weights.items()}
        queues: dict[str, deque[GroupView]] = {}
        for g in _fifo(buffered):
            if weights.get(g.source, 0.0) > 0:
                queues.setdefault(g.source, deque()).append(g)
        budget = query.max_samples
        taken: Counter[str] = Counter()
        chosen: list[GroupView] = []
        while True:
            open_ = [
                s
                for s, q in queues.items()
                if q and q[0].num_samples <= budget and taken[s] < quota[s]
            ]
            if not open_:
                break
            src = min(open_, key=lambda s: (taken[s] / weights[s], -weights[s]))
            g = queues[src].popleft()
            chosen.append(g)
            taken[src] += g.num_samples
            budget -= g.num_samples
        if self.config.fill:
            keys = {g.key for g in chosen}
            chosen += fit([g for g in _fifo(buffered) if g.key not in keys], budget)
        for g in chosen:
            self.served[g.source] += g.num_samples
        return [g.key for g in chosen]

    def state_dict(self) -> dict[str, Any]:
        """Batches composed and samples served per source."""
        return {**super().state_dict(), "served": dict(self.served)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore counters."""
        super().load_state_dict(state)
        self.served = Counter({k: int(v) for k, v in state.get("served", {}).items()})

    def metrics(self) -> dict[str, float]:
        """Batches composed and samples served per source."""
        return {**super().metrics(), **{f"served_{k}": float(v) for k, v in self.served.items()}}
