"""Measurements for the report: node, pool and trainer rates, trainer waiting, target pool size.

The JSON report (``records.DataflowReport``) and the Prometheus gauges are built from the same
snapshot: ``metrics.metrics_text`` renders a report, it measures nothing itself.

Dead-band rule on the highest trainer waiting fraction w over the window::

    w > high ───────────────► target = current + step          (rollout is the bottleneck)
    low <= w <= high ───────► target = current                  (hold)
    w < low for scale_down_after_s ─► target = current - step   (rollout has surplus)

``current`` is the number of active nodes (seen within one lease ttl): of all pools for
``report.target``, of one pool for ``report.pools[p].target_nodes`` (the same decision applied
to each pool), each clamped to [min_nodes, max_nodes].

The rule runs in the service's clock-driven sweep (:meth:`Telemetry.decide`), which stores its
``Targets``; building a report only reads them, so how often anyone reads the report changes
no decision.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from astraflow.dataflow.config import ReportConfig
from astraflow.records import (
    DataflowReport,
    NodeReport,
    NodeStats,
    PolicyReport,
    PoolReport,
    PoolTarget,
    SyncReport,
    TaskQueueReport,
    TrainerReport,
)

__all__ = ["DeadBand", "RateWindow", "Targets", "Telemetry", "WaitTracker", "build_report"]

#: Shortest span a rate is averaged over, so a node seen a moment ago gets no inflated rate.
MIN_SPAN_S = 1.0


class RateWindow:
    """Amounts over a trailing window; rate = amount in window / time covered."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, float]] = deque()
        self._sum = 0.0

    def add(self, now: float, amount: float) -> None:
        """Record ``amount`` at time ``now``."""
        self._events.append((now, amount))
        self._sum += amount
        self._prune(now)

    def _prune(self, now: float) -> None:
        while self._events and self._events[0][0] <= now - self.window_s:
            self._sum -= self._events.popleft()[1]

    def rate(self, now: float, since: float) -> float:
        """Per second, over the window (or since ``since`` when that is shorter)."""
        self._prune(now)
        span = max(MIN_SPAN_S, min(self.window_s, now - since))
        return max(0.0, self._sum) / span


class WaitTracker:
    """Time spent inside take_batch calls, as a fraction of the trailing window."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._done: deque[tuple[float, float]] = deque()
        self._open: dict[int, float] = {}
        self._next = 0

    def start(self, now: float) -> int:
        """A wait begins; returns a handle for :meth:`end`."""
        self._next += 1
        self._open[self._next] = now
        return self._next

    def end(self, handle: int, now: float) -> None:
        """The wait ``handle`` ended."""
        began = self._open.pop(handle, None)
        if began is not None:
            self._done.append((began, now))

    def add(self, began: float, ended: float) -> None:
        """A wait known only after it ended (a prefetch's, from the trainer's step end)."""
        if ended > began:
            self._done.append((began, ended))

    def fraction(self, now: float, since: float) -> float:
        """Waiting time in the window over the window's length (capped at 1)."""
        lo = max(since, now - self.window_s)
        while self._done and self._done[0][1] < lo:
            self._done.popleft()
        spans = [(max(a, lo), b) for a, b in self._done]
        spans += [(max(a, lo), now) for a in self._open.values()]
        waited = _union_length(spans)
        return min(1.0, waited / max(MIN_SPAN_S, now - lo))


def _union_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@dataclass
class _Node:
    node_id: str
    pool: str
    first_seen: float
    last_seen: float | None
    """None until the node itself calls (a book may start with an expired lease)."""
    samples: RateWindow
    tasks: RateWindow
    completed: int = 0
    failures: int = 0
    lease_expiries: int = 0
    stats: NodeStats = field(default_factory=NodeStats)
    left: bool = False
    """The node said it is stopping (released its leases): no longer counted as active."""


@dataclass
class _Trainer:
    trainer_id: str
    policy: str
    first_seen: float
    samples: RateWindow
    waits: WaitTracker
    last_seen: float = 0.0
    version: int = 0
    batches: int = 0


@dataclass(frozen=True)
class Targets:
    """One dead-band decision: for all pools together, and for each pool."""

    overall: PoolTarget
    pools: dict[str, PoolTarget]


class DeadBand:
    """The target pool size from trainer waiting (see the module docstring)."""

    def __init__(self, config: ReportConfig) -> None:
        self.config = config
        self._below_since: float | None = None
        self._last_current = -1

    def decide(self, now: float, current: int, waiting: float | None) -> tuple[int, str]:
        """The change in nodes (+step, 0, -step) and why, for ``current`` active nodes."""
        c = self.config
        low, high = c.band
        if current != self._last_current:
            self._below_since, self._last_current = None, current
        change, reason = 0, "holding: waiting fraction inside the band"
        if waiting is None:
            self._below_since = None
            reason = "holding: no trainer activity in the window"
        elif waiting > high:
            self._below_since = None
            change, reason = c.step, f"trainers wait {waiting:.2f} > {high}: scale up"
        elif waiting < low:
            self._below_since = self._below_since if self._below_since is not None else now
            below = now - self._below_since
            if below >= c.scale_down_after_s:
                change = -c.step
                reason = f"trainers wait {waiting:.2f} < {low} for {below:.0f}s: scale down"
            else:
                reason = f"trainers wait {waiting:.2f} < {low} for {below:.0f}s: holding"
        else:
            self._below_since = None
        return change, reason

    def clamp(self, nodes: int) -> int:
        """``nodes`` within [min_nodes, max_nodes]."""
        return min(self.config.max_nodes, max(self.config.min_nodes, nodes))

    def target(self, now: float, current: int, waiting: float | None) -> PoolTarget:
        """Decide the target for ``current`` active nodes at waiting fraction ``waiting``."""
        return self.targets(now, {"": current}, waiting).overall

    def targets(self, now: float, nodes: Mapping[str, int], waiting: float | None) -> Targets:
        """Decide once for all ``nodes`` (active per pool); apply the change to each pool."""
        change, reason = self.decide(now, sum(nodes.values()), waiting)

        def target(current: int) -> PoolTarget:
            return PoolTarget(
                current_nodes=current, target_nodes=self.clamp(current + change),
                waiting_fraction=waiting, band=self.config.band, reason=reason, decided_at=now,
            )  # fmt: skip

        return Targets(target(sum(nodes.values())), {p: target(n) for p, n in nodes.items()})


class Telemetry:
    """Per node, pool and trainer counters and rates (in memory: rates restart with the
    service; durable totals live in the store)."""

    def __init__(self, config: ReportConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.started = clock()
        self.nodes: dict[str, _Node] = {}
        self.trainers: dict[str, _Trainer] = {}
        self.dead_band = DeadBand(config)
        self.targets = Targets(
            PoolTarget(
                current_nodes=0, target_nodes=self.dead_band.clamp(0), band=config.band,
                reason="holding: no decision yet", decided_at=self.started,
            ),
            {},
        )  # fmt: skip
        """The latest dead-band decision (:meth:`decide`); reports only read it."""

    def book(self, node_id: str, pool: str) -> _Node:
        """The node's book, without marking it as seen (e.g. to count its expired leases)."""
        book = self.nodes.get(node_id)
        if book is None:
            now, w = self.clock(), self.config.window_s
            book = _Node(node_id, pool, now, None, RateWindow(w), RateWindow(w))
            self.nodes[node_id] = book
        return book

    def node(self, node_id: str, pool: str, stats: NodeStats | None = None) -> _Node:
        """The node's book, marked as seen now (it called the service)."""
        book = self.book(node_id, pool)
        book.pool, book.last_seen, book.left = pool, self.clock(), False
        if stats is not None:
            book.stats = stats
        return book

    def leave(self, node_id: str) -> None:
        """The node is stopping: leave the active count now, not one lease ttl later."""
        book = self.nodes.get(node_id)
        if book is not None:
            book.left = True

    def pool_of(self, node_id: str) -> str | None:
        """The pool the node last reported."""
        book = self.nodes.get(node_id)
        return None if book is None else book.pool

    def forget_idle(self, now: float, leased: Mapping[str, int]) -> None:
        """Drop nodes silent for ten report windows that hold no lease (elastic pools churn)."""
        horizon = now - 10 * self.config.window_s
        for n in [n for n in self.nodes.values() if n.node_id not in leased]:
            if (n.last_seen if n.last_seen is not None else n.first_seen) < horizon:
                del self.nodes[n.node_id]

    def completed(self, node_id: str, pool: str, samples: int) -> None:
        """A node's task was accepted with ``samples`` samples."""
        book = self.node(node_id, pool)
        now = self.clock()
        book.samples.add(now, samples)
        book.tasks.add(now, 1)
        book.completed += 1

    def node_rate(self, node_id: str) -> float | None:
        """Tasks per second the node completes (None before its first completion)."""
        book = self.nodes.get(node_id)
        if book is None or book.completed == 0:
            return None
        return book.tasks.rate(self.clock(), book.first_seen)

    def trainer(self, trainer_id: str, policy: str) -> _Trainer:
        """The trainer's book."""
        book = self.trainers.get(trainer_id)
        if book is None:
            w = self.config.window_s
            book = _Trainer(trainer_id, policy, self.clock(), RateWindow(w), WaitTracker(w))
            self.trainers[trainer_id] = book
        book.policy, book.last_seen = policy, self.clock()
        return book

    def served(self, trainer_id: str, policy: str, samples: int, version: int) -> None:
        """A batch of ``samples`` went to the trainer."""
        book = self.trainer(trainer_id, policy)
        book.samples.add(self.clock(), samples)
        book.version = version
        book.batches += 1

    def active_nodes(self, now: float, ttl_s: float) -> list[_Node]:
        """Nodes that called within ``ttl_s``."""
        return [
            n
            for n in self.nodes.values()
            if not n.left and n.last_seen is not None and now - n.last_seen <= ttl_s
        ]

    def waiting(self, now: float) -> float | None:
        """Highest waiting fraction among trainers seen within the window (None: none)."""
        recent = [
            t.waits.fraction(now, t.first_seen)
            for t in self.trainers.values()
            if now - t.last_seen <= self.config.window_s
        ]
        return max(recent) if recent else None

    def decide(self, now: float, ttl_s: float, pools: Iterable[str]) -> Targets:
        """Run the dead-band rule now and store its targets (the sweep calls this).

        ``pools``: pools to decide for even with no active node (those with a desired size).
        """
        nodes = dict.fromkeys(pools, 0)
        for n in self.active_nodes(now, ttl_s):
            nodes[n.pool] = nodes.get(n.pool, 0) + 1
        self.targets = self.dead_band.targets(now, nodes, self.waiting(now))
        return self.targets

    def node_reports(self, leased: Mapping[str, int]) -> dict[str, NodeReport]:
        """Every known node's report."""
        now = self.clock()
        return {
            n.node_id: NodeReport(
                node_id=n.node_id,
                pool=n.pool,
                samples_per_s=n.samples.rate(now, n.first_seen),
                tasks_per_s=n.tasks.rate(now, n.first_seen),
                leased=leased.get(n.node_id, 0),
                completed=n.completed,
                failures=n.failures,
                lease_expiries=n.lease_expiries,
                last_seen_s=max(0.0, now - (n.last_seen or n.first_seen)),
                stats=n.stats,
            )
            for n in self.nodes.values()
        }

    def trainer_reports(self) -> dict[str, TrainerReport]:
        """Every known trainer's report."""
        now = self.clock()
        return {
            t.trainer_id: TrainerReport(
                trainer_id=t.trainer_id,
                policy=t.policy,
                samples_per_s=t.samples.rate(now, t.first_seen),
                waiting_fraction=t.waits.fraction(now, t.first_seen),
                version=t.version,
                batches=t.batches,
            )
            for t in self.trainers.values()
        }


def _empty_pool(pool: str) -> PoolReport:
    return PoolReport(
        pool=pool, nodes=0, samples_per_s=0, tasks_per_s=0, leased=0, failures=0,
        lease_expiries=0,
    )  # fmt: skip


def build_report(
    telemetry: Telemetry,
    tasks: TaskQueueReport,
    leased: Mapping[str, int],
    policies: dict[str, PolicyReport],
    plugins: dict[str, dict[str, float]],
    ttl_s: float,
    *,
    desired: Mapping[str, int] | None = None,
    sync: SyncReport | None = None,
) -> DataflowReport:
    """Assemble the report from the service's state and the telemetry.

    ``desired``: node counts asked for per pool (pools with one appear even with no node);
    ``sync``: the round state of a sync-mode service.
    """
    now = telemetry.clock()
    nodes = telemetry.node_reports(leased)
    active = {n.node_id for n in telemetry.active_nodes(now, ttl_s)}
    desired = desired or {}
    pools: dict[str, PoolReport] = {p: _empty_pool(p) for p in sorted(desired)}
    for n in nodes.values():
        p = pools.get(n.pool) or _empty_pool(n.pool)
        pools[n.pool] = p.model_copy(
            update={
                "nodes": p.nodes + (n.node_id in active),
                "samples_per_s": p.samples_per_s + n.samples_per_s,
                "tasks_per_s": p.tasks_per_s + n.tasks_per_s,
                "leased": p.leased + n.leased,
                "failures": p.failures + n.failures,
                "lease_expiries": p.lease_expiries + n.lease_expiries,
            }
        )
    trainers = telemetry.trainer_reports()
    targets = telemetry.targets  # decided by the sweep: reading decides nothing
    for name, p in pools.items():
        decided = targets.pools.get(name)
        pools[name] = p.model_copy(
            update={
                "desired_nodes": desired.get(name),
                "target_nodes": None if decided is None else decided.target_nodes,
            }
        )
    return DataflowReport(
        time=now,
        uptime_s=max(0.0, now - telemetry.started),
        window_s=telemetry.config.window_s,
        tasks=tasks,
        pools=pools,
        nodes=nodes,
        policies=policies,
        trainers=trainers,
        target=targets.overall,
        plugins=plugins,
        pool_targets=dict(targets.pools),
        mode="async" if sync is None else "sync",
        sync=sync,
    )
