"""Per-policy buffers of sample groups, and the batches served from them.

    submit ──► buffered ──take──► served (batch open) ──ack──► acked ──► deleted, or kept for
                  ▲                       │                              replay (retain_acked)
                  └── ack deadline passes ┘
    buffered, beyond max_staleness for the requesting trainer ──► dropped (stale_dropped)
    kept for replay, beyond replay_max_staleness (default max_staleness) ──► deleted

Batches are whole groups. A served batch's samples are encoded straight from the stored
msgpack blobs, without decoding them again. An ack of a batch whose deadline passed still
retires the groups of it that were not served again, so no step trains twice on them.
"""

from __future__ import annotations

import logging
import math
import statistics
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping, Sequence

import msgpack

from astraflow.data_algorithms.protocols import BatchQuery, BatchSampler, GroupView
from astraflow.dataflow.config import PolicyConfig
from astraflow.dataflow.regulation import group_behaviour_version, staleness
from astraflow.dataflow.store import BatchRow, GroupRow, Store
from astraflow.errors import NotFoundError, PluginError, ValidationError
from astraflow.records import (
    STALENESS_BINS,
    PolicyReport,
    PolicyVersion,
    Sample,
    SubmitRequest,
)

__all__ = ["Buffers", "encode_batch", "validate_samples"]

log = logging.getLogger(__name__)


def encode_batch(row: BatchRow, blobs: Sequence[bytes], num_samples: int, ttl: float) -> bytes:
    """msgpack of ``records.Batch`` from groups' stored sample blobs (no re-encoding)."""
    p = msgpack.Packer(use_bin_type=True)
    head = [
        p.pack_map_header(5),
        p.pack("batch_id"), p.pack(row.batch_id),
        p.pack("policy"), p.pack(row.policy),
        p.pack("trainer_version"), p.pack(row.trainer_version),
        p.pack("ack_deadline_s"), p.pack(ttl),
        p.pack("samples"), p.pack_array_header(num_samples),
    ]  # fmt: skip
    return b"".join(head) + b"".join(blobs)


def validate_samples(req: SubmitRequest, policies: Mapping[str, PolicyConfig]) -> None:
    """Refuse a submission whose samples name an undeclared policy, another task, or token
    ids outside their policy's vocabulary (the records checked everything else)."""
    for i, s in enumerate(req.samples):
        cfg = policies.get(s.policy)
        if cfg is None:
            raise ValidationError(
                f"samples[{i}].policy: unknown policy {s.policy!r}; declared: "
                f"{', '.join(sorted(policies))}",
                field=f"samples.{i}.policy",
            )
        if s.task_id != req.task_id:
            raise ValidationError(
                f"samples[{i}].task_id is {s.task_id!r}, the submission is for {req.task_id!r}",
                field=f"samples.{i}.task_id",
            )
        try:
            s.check_vocab(cfg.vocab_size)
        except ValidationError as exc:
            raise ValidationError(f"samples[{i}]: {exc}", field=f"samples.{i}.token_ids") from exc


#: Ingested samples whose ``meta['metrics']`` the report averages, per policy.
SAMPLE_METRICS_WINDOW = 256
#: Figures kept per sample and the longest figure name: a node's meta cannot grow the report.
SAMPLE_METRICS_MAX_NAMES = 32
SAMPLE_METRICS_MAX_NAME_CHARS = 64


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population std of finite floats, without overflow near the float limit.

    Floats, not ``statistics.pstdev``'s exact fractions (~1 ms a submit on the writer thread,
    the service's throughput bound); scaled by the largest magnitude so that any finite
    rewards a node may send give finite figures.
    """
    scale = max(abs(v) for v in values) or 1.0
    scaled = [v / scale for v in values]
    mean = statistics.fmean(scaled)
    std = math.sqrt(statistics.fmean((v - mean) ** 2 for v in scaled))
    return mean * scale, std * scale


class Buffers:
    """Groups per policy in memory, mirrored by the ``groups``, ``blobs`` and ``batches``."""

    def __init__(
        self, store: Store, policies: Mapping[str, PolicyConfig], sampler: BatchSampler
    ) -> None:
        self.store = store
        self.policies = policies
        self.sampler = sampler
        self.recent: dict[str, deque[dict[str, float]]] = {
            p: deque(maxlen=SAMPLE_METRICS_WINDOW) for p in policies
        }
        self.rewards: dict[str, deque[float]] = {
            p: deque(maxlen=SAMPLE_METRICS_WINDOW) for p in policies
        }
        self.served_staleness: dict[str, list[int]] = {p: [] for p in policies}
        """Samples served per staleness since start (memory only: a report figure)."""
        self.load()

    def load(self) -> None:
        """Rebuild memory from the store (start-up, or after a failed transaction)."""
        self.live: dict[str, dict[int, GroupRow]] = {p: {} for p in self.policies}
        self._sizes: dict[str, Counter[str]] = {p: Counter() for p in self.policies}
        self.replay: dict[str, OrderedDict[int, GroupRow]] = {
            p: OrderedDict() for p in self.policies
        }
        for g in self.store.live_groups():
            if g.policy not in self.policies:
                log.warning("group of a policy no longer configured policy=%s", g.policy)
            elif g.state == "acked":
                self.replay[g.policy][g.gid] = g
            else:
                self.live[g.policy][g.gid] = g
                self._enter(g)
        self.batches = {b.batch_id: b for b in self.store.open_batches()}
        counters = self.store.get_meta("counters") or {}
        self.counters: dict[str, Counter[str]] = {
            k: Counter(counters.get(k, {})) for k in ("stale_dropped", "filtered", "acked")
        }

    def count(self, counter: str, policy: str, n: int) -> None:
        """Add to a per-policy counter (persisted with the current transaction)."""
        self.counters[counter][policy] += n
        self.store.set_meta("counters", {k: dict(v) for k, v in self.counters.items()})

    def _enter(self, g: GroupRow, sign: int = 1) -> None:
        sizes = self._sizes[g.policy]
        if g.state == "buffered":
            sizes["buffered"] += sign * g.num_samples
            sizes["groups"] += sign
        else:
            sizes["served"] += sign * g.num_samples

    def _set_state(self, g: GroupRow, state: str) -> None:
        self._enter(g, -1)
        g.state = state
        self._enter(g)

    def samples(self, policy: str) -> tuple[int, int, int]:
        """(buffered samples, buffered groups, served samples) of ``policy``, kept as counts."""
        sizes = self._sizes[policy]
        return sizes["buffered"], sizes["groups"], sizes["served"]

    def report(self, policy: str, latest: PolicyVersion | None, in_flight: int) -> PolicyReport:
        """The policy's part of the report."""
        buffered, groups, served = self.samples(policy)
        rewards = list(self.rewards.get(policy, ()))
        return PolicyReport(
            policy=policy,
            latest_version=None if latest is None else latest.version,
            buffered_samples=buffered,
            buffered_groups=groups,
            served_samples=served,
            in_flight_samples=max(0, in_flight),
            max_buffered=self.policies[policy].max_buffered,
            stale_dropped_samples=self.counters["stale_dropped"][policy],
            filtered_samples=self.counters["filtered"][policy],
            acked_samples=self.counters["acked"][policy],
            sample_metrics=self._metric_means(policy),
            reward_mean=_mean_std(rewards)[0] if rewards else None,
            served_staleness=list(self.served_staleness[policy]),
        )

    def _metric_means(self, policy: str) -> dict[str, float]:
        values: dict[str, list[float]] = {}
        for figures in self.recent.get(policy, ()):
            for name, value in figures.items():
                values.setdefault(name, []).append(value)
        # sum of v/n, not fmean: finite inputs near the float limit must not overflow the report
        means = {name: sum(x / len(v) for x in v) for name, v in sorted(values.items())}
        return {name: m for name, m in means.items() if math.isfinite(m)}

    def _remember(self, policy: str, samples: Sequence[Sample]) -> None:
        """Keep the numeric ``meta['metrics']`` of ingested samples (memory only: a report)."""
        self.rewards.setdefault(policy, deque(maxlen=SAMPLE_METRICS_WINDOW)).extend(
            s.reward for s in samples
        )
        window = self.recent.setdefault(policy, deque(maxlen=SAMPLE_METRICS_WINDOW))
        for s in samples:
            figures = s.meta.get("metrics")
            if isinstance(figures, dict):
                kept = {
                    str(k): float(v) for k, v in figures.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                    and len(str(k)) <= SAMPLE_METRICS_MAX_NAME_CHARS
                }  # fmt: skip
                window.append(dict(sorted(kept.items())[:SAMPLE_METRICS_MAX_NAMES]))

    # ------------------------------------------------------------------ ingest

    def add(self, policy: str, samples: Sequence[Sample], source: str, now: float) -> GroupRow:
        """Buffer one group."""
        self._remember(policy, samples)
        mean, std = _mean_std([s.reward for s in samples])
        row = GroupRow(
            gid=0,
            policy=policy,
            group_id=samples[0].group_id,
            task_id=samples[0].task_id,
            source=source,
            num_samples=len(samples),
            num_tokens=sum(s.num_tokens for s in samples),
            behaviour_version=group_behaviour_version(samples),
            reward_mean=mean,
            reward_std=std,
            created_at=now,
            state="buffered",
            batch_id=None,
            times_served=0,
        )
        packer = msgpack.Packer(use_bin_type=True, autoreset=False)
        for s in samples:  # one buffer for the group, handed to SQLite without a copy
            packer.pack(s.model_dump(mode="python"))
        row.gid = self.store.insert_group(row, packer.getbuffer())
        self.live[policy][row.gid] = row
        self._enter(row)
        return row

    # ------------------------------------------------------------------ take

    def _drop_stale(self, policy: str, version: int) -> None:
        bound = self.policies[policy].max_staleness
        stale = [
            g
            for g in self.live[policy].values()
            if g.state == "buffered" and staleness(g.behaviour_version, version) > bound
        ]
        replay_bound = self.policies[policy].replay_bound
        old = [
            g
            for g in self.replay[policy].values()
            if staleness(g.behaviour_version, version) > replay_bound
        ]
        if old:
            self.store.delete_groups([g.gid for g in old])
        for g in old:
            del self.replay[policy][g.gid]
        if stale:
            n = self.drop(policy, stale)
            log.info("stale groups dropped policy=%s groups=%d samples=%d trainer_version=%d",
                     policy, len(stale), n, version)  # fmt: skip

    def drop(self, policy: str, groups: Sequence[GroupRow]) -> int:
        """Delete buffered groups for good, counted as stale-dropped; returns their samples."""
        self.store.delete_groups([g.gid for g in groups])
        for g in groups:
            del self.live[policy][g.gid]
            self._enter(g, -1)
        n = sum(g.num_samples for g in groups)
        self.count("stale_dropped", policy, n)
        return n

    def _view(self, g: GroupRow, version: int) -> GroupView:
        return GroupView(
            key=g.gid,
            policy=g.policy,
            group_id=g.group_id,
            task_id=g.task_id,
            source=g.source,
            num_samples=g.num_samples,
            num_tokens=g.num_tokens,
            behaviour_version=g.behaviour_version,
            staleness=staleness(g.behaviour_version, version),
            max_staleness=self.policies[g.policy].max_staleness,
            created_at=g.created_at,
            reward_mean=g.reward_mean,
            reward_std=g.reward_std,
            times_served=g.times_served,
        )

    def take(self, q: BatchQuery, now: float) -> tuple[BatchRow, bytes, int] | None:
        """Compose and record a batch, or None when fewer than ``min_samples`` qualify."""
        self._drop_stale(q.policy, q.trainer_version)
        fresh = [g for g in self.live[q.policy].values() if g.state == "buffered"]
        replay = list(self.replay[q.policy].values())
        if sum(g.num_samples for g in fresh) + sum(g.num_samples for g in replay) < q.min_samples:
            return None
        keys = self.sampler.choose(
            q, [self._view(g, q.trainer_version) for g in fresh],
            [self._view(g, q.trainer_version) for g in replay],
        )  # fmt: skip
        chosen_fresh, chosen_replay, total = self._fit(q, keys)
        if total < q.min_samples:
            return None
        return self.serve(q, chosen_fresh, chosen_replay, now)

    def serve(
        self, q: BatchQuery, fresh: Sequence[GroupRow], replay: Sequence[GroupRow], now: float
    ) -> tuple[BatchRow, bytes, int]:
        """Record a batch of these buffered (and replayed acked) groups; returns it encoded."""
        chosen_fresh, chosen_replay = list(fresh), list(replay)
        total = sum(g.num_samples for g in chosen_fresh + chosen_replay)
        cfg = self.policies[q.policy]
        row = BatchRow(
            batch_id=uuid.uuid4().hex,
            policy=q.policy,
            trainer_id=q.trainer_id,
            trainer_version=q.trainer_version,
            fresh=[g.gid for g in chosen_fresh],
            replay=[g.gid for g in chosen_replay],
            deadline=now + cfg.ack_timeout_s,
            state="open",
            created_at=now,
        )
        self.store.set_groups(row.fresh, "served", row.batch_id)
        self.store.insert_batch(row)
        for g in chosen_fresh:
            self._set_state(g, "served")
            g.batch_id = row.batch_id
        self._count_staleness(q, chosen_fresh + chosen_replay)
        self.batches[row.batch_id] = row
        blobs = self.store.read_blobs(row.fresh + row.replay)
        data = encode_batch(
            row, [blobs[g] for g in row.fresh + row.replay], total, cfg.ack_timeout_s
        )
        return row, data, total

    def _count_staleness(self, q: BatchQuery, groups: Sequence[GroupRow]) -> None:
        bins = self.served_staleness.setdefault(q.policy, [])
        for g in groups:
            k = min(max(0, staleness(g.behaviour_version, q.trainer_version)), STALENESS_BINS - 1)
            bins.extend([0] * (k + 1 - len(bins)))
            bins[k] += g.num_samples

    def _fit(
        self, q: BatchQuery, keys: Sequence[int]
    ) -> tuple[list[GroupRow], list[GroupRow], int]:
        live, replay = self.live[q.policy], self.replay[q.policy]
        chosen_fresh: list[GroupRow] = []
        chosen_replay: list[GroupRow] = []
        seen: set[int] = set()
        total = 0
        for k in keys:
            g = live.get(k) or replay.get(k)
            if g is None or (g.state != "buffered" and g.state != "acked"):
                raise PluginError(f"batch sampler chose group {k}, which is not on offer")
            if k in seen or total + g.num_samples > q.max_samples:
                continue
            seen.add(k)
            total += g.num_samples
            (chosen_replay if g.state == "acked" else chosen_fresh).append(g)
        return chosen_fresh, chosen_replay, total

    # ------------------------------------------------------------------ ack / expire

    def find(self, batch_id: str) -> BatchRow:
        """A batch in any state; ``NotFoundError`` for an unknown id."""
        b = self.batches.get(batch_id) or self.store.get_batch(batch_id)
        if b is None:
            raise NotFoundError(f"unknown batch {batch_id!r}", field="batch_id")
        return b

    def ack(self, b: BatchRow, now: float) -> None:
        """Retire a batch's groups for good; idempotent."""
        batch_id = b.batch_id
        if self.batches.pop(batch_id, None) is None and b.state == "acked":
            return
        live = self.live[b.policy]
        mine = [g for g in b.fresh if g in live and live[g].batch_id == batch_id]
        if b.state == "expired":  # only those not served again since
            mine = [g for g in mine if live[g].state == "buffered"]
        self.store.set_groups(mine, "acked", batch_id, acked_at=now)
        replayed = [g for g in b.replay if g in self.replay[b.policy]]
        self.store.count_served(mine + replayed)
        self.store.set_batch_state(batch_id, "acked")
        for gid in replayed:
            self.replay[b.policy][gid].times_served += 1
        acked = 0
        for gid in mine:
            g = live.pop(gid)
            self._enter(g, -1)
            g.state, g.times_served = "acked", g.times_served + 1
            acked += g.num_samples
            self.replay[b.policy][gid] = g
        self.count("acked", b.policy, acked)
        self._evict(b.policy)

    def _evict(self, policy: str) -> None:
        keep = self.policies[policy].retain_acked
        pool = self.replay[policy]
        old = [pool.popitem(last=False)[0] for _ in range(max(0, len(pool) - keep))]
        if old:
            self.store.delete_groups(old)

    def _rebuffer(self, b: BatchRow, why: str) -> None:
        """Close an open batch as expired and return its groups to the buffer."""
        live = self.live[b.policy]
        back = [g for g in b.fresh if g in live and live[g].batch_id == b.batch_id]
        self.store.set_groups(back, "buffered", b.batch_id)
        self.store.set_batch_state(b.batch_id, "expired")
        for gid in back:
            self._set_state(live[gid], "buffered")
        del self.batches[b.batch_id]
        log.info("batch %s, groups re-buffered batch=%s policy=%s trainer=%s groups=%d",
                 why, b.batch_id, b.policy, b.trainer_id, len(back))  # fmt: skip

    def expire(self, now: float) -> set[str]:
        """Return the groups of batches past their ack deadline to the buffer."""
        policies: set[str] = set()
        for b in [b for b in self.batches.values() if b.deadline < now]:
            self._rebuffer(b, "expired")
            policies.add(b.policy)
        return policies

    def give_back(self, batch_id: str) -> bool:
        """A batch its trainer never received (it hung up as the batch was taken) goes back
        to the buffer now; False when it is no longer open (acked, expired, released)."""
        b = self.batches.get(batch_id)
        if b is None:
            return False
        self._rebuffer(b, "given back (its trainer hung up)")
        return True

    def release(self, policy: str, trainer_id: str, holding: Sequence[str] = ()) -> int:
        """The trainer takes again: it no longer holds its open batches of ``policy`` but
        those in ``holding`` (it restarted, or lost a reply), so they go back to the buffer
        now, not at their ack deadline; returns how many. A trainer holds the batch it trains,
        at most one prefetched and those whose ack is in flight; it names them."""
        keep = set(holding)
        mine = [b for b in self.batches.values()
                if b.policy == policy and b.trainer_id == trainer_id
                and b.batch_id not in keep]  # fmt: skip
        for b in mine:
            self._rebuffer(b, "released (its trainer takes again)")
        return len(mine)
