"""Synchronous ("trainer-centred") regulation: lock-step rounds of ``sync_round_tasks`` tasks.

    round r ── every policy announced >= r ──► open: lease up to ``quota`` tasks, each source
       ▲                                        its share by weight; only nodes
       │                                        holding version r of what a task needs get it;
       │                                        expired / failed / handed-back leases are
       │                                        re-queued inside the round
       │                                          │ every round task submitted or failed for
       │   a policy has no group after the        │ good (or the task sources ran dry)
       │   filters: quota += sync_round_tasks ◄───┤
       │                                          ▼
       │                                      complete: a trainer of p at version r takes all
       │                                        round-r groups of p as one batch
       └── closed ◄── every policy announced >= r+1 ┘ (tasks still open carry over to r+1)

A source's share of a round is fixed (``sync_round_tasks`` apportioned by source weight, a
top-up's tasks among the sources of the policies it is for), so the round holds the same
tasks per policy whichever nodes ask first: a node that holds the new version of one policy
only can take that policy's share, not the other's (two trainers announce at different times).

Durable: meta ``sync`` holds round, quota, top-up shares and timings; table ``round_tasks``
which task belongs to which round. :meth:`SyncRounds.step` runs at the end of every change of
the service, inside its transaction, so the round state always matches the tasks and versions
it was derived from.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from astraflow.data_algorithms.protocols import BatchQuery
from astraflow.dataflow.buffers import Buffers
from astraflow.dataflow.config import SourceConfig
from astraflow.dataflow.regulation import Held, LeasePlan, Sources, Versions, admission
from astraflow.dataflow.store import BatchRow, GroupRow, Store
from astraflow.dataflow.tasks import TaskQueue
from astraflow.errors import ValidationError
from astraflow.records import NO_VERSION, RoundTiming, SyncReport

__all__ = ["BLOCKED", "HISTORY", "SyncRounds"]

log = logging.getLogger(__name__)

#: Closed rounds whose timings are kept (older ones only count in the totals).
HISTORY = 100
#: Every lease reason that :meth:`SyncRounds.blocked` gives starts with this.
BLOCKED = "sync round "


def _versions(latest: Versions) -> dict[str, int]:
    return {p: v.version for p, v in latest.items()}


class SyncRounds:
    """The current round of a sync-mode service, over its task queue and buffers.

    The sync ``modes.Regulator``: it replaces backpressure, admission and take.
    """

    def __init__(
        self,
        store: Store,
        queue: TaskQueue,
        buffers: Buffers,
        round_tasks: int,
        policies: Sequence[str],
        latest: Versions,
    ) -> None:
        self.store, self.queue, self.buffers = store, queue, buffers
        self.round_tasks = round_tasks
        self.policies = sorted(policies)
        saved: dict[str, Any] | None = store.get_meta("sync")
        self._saved = json.dumps(saved, sort_keys=True)
        if saved is None:  # a new run (or one that ran async so far): start at its versions
            saved = {"round": max(0, self._lowest(_versions(latest))), "quota": round_tasks}
        self.round: int = saved["round"]
        self.quota: int = saved["quota"]
        self.topups: int = saved.get("topups", 0)
        self.opened_at: float | None = saved.get("opened_at")
        self.data_complete_at: float | None = saved.get("data_complete_at")
        self.history = [RoundTiming.model_validate(h) for h in saved.get("history", [])]
        self.closed_rounds: int = saved.get("closed_rounds", 0)
        self.rollout_s: float = saved.get("rollout_s", 0.0)
        self.train_s: float = saved.get("train_s", 0.0)
        self.extra: Counter[str] = Counter(saved.get("extra", {}))
        """Tasks top-ups of the current round added to each source's share."""
        self.tasks: set[str] = set()
        self.by_source: Counter[str] = Counter()
        """Tasks of the current round per source."""
        self.leased(store.round_tasks(self.round))

    def retire(self, policy: str) -> None:
        """Stop waiting for ``policy``: its trainer announced its final version."""
        if policy in self.policies and len(self.policies) > 1:
            self.policies.remove(policy)

    def _lowest(self, latest: Mapping[str, int]) -> int:
        return min((latest.get(p, NO_VERSION) for p in self.policies), default=NO_VERSION)

    def _state(self) -> dict[str, Any]:
        return {
            "round": self.round, "quota": self.quota, "topups": self.topups,
            "opened_at": self.opened_at, "data_complete_at": self.data_complete_at,
            "history": [h.model_dump() for h in self.history],
            "closed_rounds": self.closed_rounds, "rollout_s": self.rollout_s,
            "train_s": self.train_s, "extra": dict(self.extra),
        }  # fmt: skip

    # ------------------------------------------------------------------ transitions

    def step(self, latest: Versions, now: float) -> bool:
        """Apply the round rules after a change; True when the round's data just became complete.

        Runs inside the caller's transaction (it writes the round state when it changed).
        """
        low = self._lowest(_versions(latest))
        if low > self.round:
            self._close(low, now)
        if self.opened_at is None and low >= self.round:
            self.opened_at = now
            log.info("sync round open round=%d quota=%d", self.round, self.quota)
        stray = [t for t in self.queue.open if t not in self.tasks]
        if stray:  # every open task belongs to the current round
            self.leased(stray)
        completed = self._check_complete(now)
        state = json.dumps(self._state(), sort_keys=True)
        if state != self._saved:
            self.store.set_meta("sync", self._state())
            self._saved = state
        return completed

    def leased(self, task_ids: Iterable[str]) -> None:
        """Make tasks members of the current round."""
        new = [t for t in task_ids if t not in self.tasks]
        self.tasks.update(new)
        self.by_source.update(self._source(t) for t in new)
        self.store.set_round(new, self.round)

    def _source(self, task_id: str) -> str:
        ot = self.queue.open.get(task_id)
        if ot is not None:
            return ot.source.name
        row = self.store.get_task(task_id)
        return row.source if row is not None else ""

    def share(self, source: str) -> int:
        """Tasks ``source`` may have in the current round: its weight's part of
        ``sync_round_tasks`` (largest remainders) plus what top-ups gave it."""
        return _apportion(self.round_tasks, self._weights()).get(source, 0) + self.extra[source]

    def _weights(self, policies: Iterable[str] | None = None) -> dict[str, float]:
        """Source weights, only of the sources feeding ``policies`` when given."""
        views = self.queue.catalog.sources.values()
        wanted = None if policies is None else set(policies)
        return {v.name: v.weight for v in views
                if wanted is None or wanted & self._policies_of(v.name)}  # fmt: skip

    def _policies_of(self, source: str) -> set[str]:
        return set(self.queue.catalog.source(source).config.policies)

    def _open_tasks(self) -> int:
        return sum(1 for t in self.tasks if t in self.queue.open)

    def _close(self, new_round: int, now: float) -> None:
        timing = self.timing(closed_at=now)
        self.history = [*self.history, timing][-HISTORY:]
        self.closed_rounds += 1
        if self.opened_at is not None and self.data_complete_at is not None:
            self.rollout_s += self.data_complete_at - self.opened_at
            self.train_s += now - self.data_complete_at
        carried = [t for t in self.tasks if t in self.queue.open]
        log.info("sync round closed round=%d tasks=%d topups=%d carried_over=%d",
                 self.round, len(self.tasks), self.topups, len(carried))  # fmt: skip
        self.round, self.quota, self.topups = new_round, self.round_tasks, 0
        self.opened_at = self.data_complete_at = None
        self.tasks, self.by_source, self.extra = set(), Counter(), Counter()
        self.leased(carried)

    def _check_complete(self, now: float) -> bool:
        if self.opened_at is None or self.data_complete_at is not None:
            return False
        if self._open_tasks():
            return False
        drained = self.queue.drained >= set(self.queue.catalog.sources)
        if len(self.tasks) < self.quota and not drained:
            return False
        lacking = [p for p in self.policies if not self.groups(p)]
        if lacking and not drained:
            self.quota += self.round_tasks
            self.topups += 1
            self.extra.update(_apportion(self.round_tasks, self._weights(lacking)))
            log.warning("sync round has no data for some policies after the trajectory filters; "
                        "leasing more tasks round=%d policies=%s quota=%d", self.round,
                        ",".join(lacking), self.quota)  # fmt: skip
            return False
        if lacking:
            log.error("sync round has no data for some policies and the task sources are "
                      "exhausted: their trainers get no batch round=%d policies=%s",
                      self.round, ",".join(lacking))  # fmt: skip
        self.data_complete_at = now
        log.info("sync round data complete round=%d tasks=%d", self.round, len(self.tasks))
        return True

    # ------------------------------------------------------------------ lease side

    def plan(self, sources: Sources, held: Held, latest: Versions) -> LeasePlan:
        """Admission with staleness 0 against the round's version; the round bounds buffers."""
        required = {p: min(v.version, self.round) for p, v in latest.items()}
        needed = sorted({p for s in sources for p in s.policies})
        refresh = admission(needed, held, required, dict.fromkeys(required, 0))
        return LeasePlan(refresh, self._caps(sources, refresh), [])

    def _caps(self, sources: Sequence[SourceConfig], refresh: Mapping[str, str]) -> dict[str, int]:
        if self.opened_at is None or self.data_complete_at is not None:
            return {}
        if self.max_new() == 0 and not self.queue.pending:
            return {}
        if self.topups:  # a top-up is for the policies the filters left without data: only
            # their sources lease more, or the others' round batch outgrows its trainer's batch
            lacking = {p for p in self.policies if not self.groups(p)}
            if lacking:
                sources = [s for s in sources if lacking.intersection(s.policies)]
        # re-queued round tasks (already counted in by_source) go again on top of new ones
        requeued = Counter(self.queue.open[t].source.name for t in self.queue.pending)
        return {
            s.name: max(0, self.share(s.name) - self.by_source[s.name]) + requeued[s.name]
            for s in sources
            if not any(p in refresh for p in s.policies)
        }

    def lease_key(self) -> Hashable:
        """What decides whether a lease may get a task: see :meth:`more_to_lease`."""
        return self._key()

    def more_to_lease(self, before: Hashable) -> bool:
        """Whether a lease the round left empty at ``before`` may now get a task."""
        now = self._key()
        assert isinstance(before, tuple)  # what lease_key returned
        return now[:4] != before[:4] or now[4] > before[4]

    def _key(self) -> tuple[int, bool, bool, int, int]:
        opened, complete = self.opened_at is not None, self.data_complete_at is not None
        return self.round, opened, complete, self.quota, len(self.queue.pending)

    def max_new(self) -> int:
        """New tasks the round may still lease."""
        return max(0, self.quota - len(self.tasks))

    def blocked(self, latest: Versions) -> str | None:
        """Why the round leases nothing now (None: it may lease)."""
        r, versions = self.round, _versions(latest)
        if self.opened_at is None:
            behind = [p for p in self.policies if versions.get(p, NO_VERSION) < r]
            return (
                f"{BLOCKED}{r}: waiting for trainers to announce version {r} ({', '.join(behind)})"
            )
        if self.data_complete_at is not None:
            behind = [p for p in self.policies if versions.get(p, NO_VERSION) <= r]
            return (
                f"{BLOCKED}{r}: waiting for trainers (the round's data is complete; "
                f"{', '.join(behind)} to announce version {r + 1})"
            )
        if self.max_new() == 0 and not self.queue.pending:
            return (
                f"{BLOCKED}{r}: waiting for trainers (all {len(self.tasks)} round tasks "
                f"leased, {self._open_tasks()} still running)"
            )
        return None

    # ------------------------------------------------------------------ trainer side

    def groups(self, policy: str) -> list[GroupRow]:
        """Buffered and served groups of the current round for ``policy``, oldest first."""
        live = self.buffers.live[policy].values()
        return sorted((g for g in live if g.task_id in self.tasks), key=lambda g: g.gid)

    def take(self, q: BatchQuery, now: float) -> tuple[BatchRow, bytes, int] | None:
        """The round batch of ``q.policy`` (all its buffered round groups), or None.

        Served only to a trainer at version ``round`` once the round's data is complete,
        whatever ``min_samples``; buffered groups of earlier rounds are dropped as stale.
        """
        live = self.buffers.live[q.policy].values()
        old = [g for g in live if g.state == "buffered" and g.task_id not in self.tasks]
        mine: list[GroupRow] = []
        if q.trainer_version == self.round and self.data_complete_at is not None:
            mine = [g for g in self.groups(q.policy) if g.state == "buffered"]
        total = sum(g.num_samples for g in mine)
        if total > q.max_samples:
            raise ValidationError(
                f"sync round {self.round} holds {total} samples of policy {q.policy!r}, more "
                f"than max_samples={q.max_samples}: the round is served as one batch; raise "
                f"the trainer's max_samples or lower regulation.sync_round_tasks",
                field="max_samples",
            )
        if old:
            n = self.buffers.drop(q.policy, old)
            log.info("groups of earlier sync rounds dropped policy=%s groups=%d samples=%d",
                     q.policy, len(old), n)  # fmt: skip
        if not mine:
            return None
        log.info("sync round batch served round=%d policy=%s groups=%d samples=%d",
                 self.round, q.policy, len(mine), total)  # fmt: skip
        return self.buffers.serve(q, mine, [], now)

    # ------------------------------------------------------------------ report

    def timing(self, closed_at: float | None = None) -> RoundTiming:
        """The current round's timings."""
        return RoundTiming(
            round=self.round, tasks=len(self.tasks), topups=self.topups,
            opened_at=self.opened_at, data_complete_at=self.data_complete_at,
            closed_at=closed_at,
        )  # fmt: skip

    def report(self, latest: Versions) -> SyncReport:
        """The round state for the report."""
        r, versions = self.round, _versions(latest)
        if self.opened_at is None:
            state, behind = "waiting", [p for p in self.policies if versions.get(p, -1) < r]
        elif self.data_complete_at is not None:
            state, behind = "complete", [p for p in self.policies if versions.get(p, -1) <= r]
        else:
            state, behind = "open", []
        return SyncReport(
            round=r, state=state, quota=self.quota, tasks=len(self.tasks),
            open_tasks=self._open_tasks(), waiting_for=behind, current=self.timing(),
            history=list(self.history), closed_rounds=self.closed_rounds,
            rollout_s=self.rollout_s, train_s=self.train_s,
        )  # fmt: skip


def _apportion(total: int, weights: Mapping[str, float]) -> dict[str, int]:
    """``total`` split by ``weights`` into whole numbers summing to ``total`` (largest
    remainders; ties by name)."""
    mass = sum(weights.values())
    if mass <= 0:
        return {}
    exact = {k: total * w / mass for k, w in weights.items()}
    out = {k: int(v) for k, v in exact.items()}
    rest = total - sum(out.values())
    for k in sorted(exact, key=lambda k: (out[k] - exact[k], k))[:rest]:
        out[k] += 1
    return out
