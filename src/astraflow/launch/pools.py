"""Keep each rollout pool at its desired size: the provisioner side of elasticity.

The dataflow service holds the desired node count per pool (``astraflow pool add|remove``
and its admin API change it; the autoscaler sets it from the report's dead-band target).
This manager only makes reality match it, with whatever starts and stops nodes (local
processes, Ray actors):

    desired (admin API) ──┐
    autoscaler decision ──┴─► desired ──► running < desired: start · running > desired: retire
    a node that died ─────────────────► no longer running ──► replaced at the next tick

The autoscaler takes only the *direction* of the report's dead-band rule (target − observed:
grow, hold, shrink) and applies it to the desired size, which counts nodes still starting.
It grows only when every started node has been seen and ``scale_up_delay_s`` has passed since
the pool's last resize; it shrinks only after ``scale_down_delay_s``, and only when some node
is at least that old (the one retired; a young node is never retired by the autoscaler).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from astraflow.dataflow.client import DataflowClient
from astraflow.errors import AstraflowError
from astraflow.launch.config import AutoscaleConfig, PoolSection
from astraflow.records import PoolSize, PoolSizes

__all__ = ["PoolManager", "PoolState", "autoscale_decision"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolState:
    """What the launcher knows of one pool when the autoscaler decides."""

    size: PoolSize
    """Desired, observed and dead-band target, from the dataflow service."""
    running: int
    """Nodes this launcher runs for the pool (started, maybe not yet seen)."""
    oldest_age_s: float | None
    """Age of the pool's oldest running node (None: none)."""
    since_resize_s: float
    """Seconds since the pool's desired size last changed here."""


def autoscale_decision(
    pool: PoolSection, state: PoolState, config: AutoscaleConfig
) -> tuple[int, str] | None:
    """The pool's new desired size and why, or None to keep it."""
    size = state.size
    desired = size.desired if size.desired is not None else state.running
    change = size.target - size.observed  # the dead-band direction: +step, 0 or -step
    starting = max(0, state.running - size.observed)
    want = max(pool.min_nodes, min(pool.max_nodes, desired + change))
    if want > desired:
        if starting:
            return None  # a started node is not seen yet: its effect is still unknown
        if state.since_resize_s < config.scale_up_delay_s:
            return None
    elif want < desired:
        if state.since_resize_s < config.scale_down_delay_s:
            return None
        if state.oldest_age_s is None or state.oldest_age_s < config.scale_down_delay_s:
            return None  # every node is younger than the scale-down delay
    if want == desired:
        return None
    return want, (
        f"autoscale pool={pool.name} {desired} -> {want} nodes "
        f"(observed {size.observed}, starting {starting}, dead-band target {size.target})"
    )


class PoolManager:
    """Matches running nodes per pool to the desired sizes the dataflow service holds."""

    def __init__(
        self,
        client: DataflowClient,
        pools: Sequence[PoolSection],
        start: Callable[[PoolSection], str],
        stop: Callable[[str], None],
        alive: Callable[[str], bool],
        autoscale: AutoscaleConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.pools = {p.name: p for p in pools}
        self._start = start
        self._stop = stop
        self._alive = alive
        self.autoscale = autoscale or AutoscaleConfig()
        self.running: dict[str, list[str]] = {name: [] for name in self.pools}
        self.retiring: set[str] = set()
        self.closing = False
        self._next_autoscale = 0.0
        self._clock = clock
        self._started_at: dict[str, float] = {}
        self._resized_at: dict[str, float] = dict.fromkeys(self.pools, clock())
        self._desired: dict[str, int | None] = dict.fromkeys(self.pools)
        self.decisions: list[str] = []

    def start(self) -> None:
        """Record each pool's configured size as desired (unless already set), then match."""
        sizes = self.client.pool_sizes()
        for name, pool in self.pools.items():
            current = sizes.pools.get(name)
            if current is None or current.desired is None:
                self.client.set_pool_size(name, nodes=pool.nodes)
        self.tick()

    def tick(self) -> None:
        """Prune dead nodes, apply the autoscaler, start or retire nodes to match."""
        if self.closing:
            return
        for name, ids in self.running.items():
            self.running[name] = [n for n in ids if self._alive(n) and n not in self.retiring]
        self.retiring = {n for n in self.retiring if self._alive(n)}
        live = {n for ids in self.running.values() for n in ids}
        self._started_at = {n: t for n, t in self._started_at.items() if n in live}
        try:
            sizes = self.client.pool_sizes()
            if self.autoscale.enabled and self._clock() >= self._next_autoscale:
                self._next_autoscale = self._clock() + self.autoscale.interval_s
                sizes = self._autoscale(sizes)
        except AstraflowError as exc:  # the service is restarting: keep the pools as they are
            log.warning("pool sizes unavailable: %s", exc)
            return
        for name, pool in self.pools.items():
            entry = sizes.pools.get(name)
            desired = entry.desired if entry is not None and entry.desired is not None else 0
            if desired != self._desired[name]:  # resized (here, by an admin, or at start)
                self._desired[name], self._resized_at[name] = desired, self._clock()
            self._match(pool, desired)

    def _match(self, pool: PoolSection, desired: int) -> None:
        ids = self.running[pool.name]
        while len(ids) < desired:
            node_id = self._start(pool)
            ids.append(node_id)
            self._started_at[node_id] = self._clock()
            log.info("pool=%s started node=%s (%d/%d)", pool.name, node_id, len(ids), desired)
        while len(ids) > desired:
            node_id = self._to_retire(ids)
            ids.remove(node_id)
            self.retiring.add(node_id)
            self._stop(node_id)
            log.info("pool=%s retiring node=%s (%d/%d)", pool.name, node_id, len(ids), desired)

    def _to_retire(self, ids: list[str]) -> str:
        """The newest node old enough to retire, else the newest (an admin's explicit shrink)."""
        now, delay = self._clock(), self.autoscale.scale_down_delay_s
        old = [n for n in ids if now - self._started_at.get(n, now) >= delay]
        return old[-1] if old else ids[-1]

    def _autoscale(self, sizes: PoolSizes) -> PoolSizes:
        """Move each pool's desired size the way the dead-band rule points, within bounds."""
        now = self._clock()
        for name, pool in self.pools.items():
            entry = sizes.pools.get(name)
            if entry is None or entry.desired is None:
                continue
            ages = [now - self._started_at.get(n, now) for n in self.running[name]]
            state = PoolState(entry, len(self.running[name]), max(ages, default=None),
                              now - self._resized_at[name])  # fmt: skip
            decision = autoscale_decision(pool, state, self.autoscale)
            if decision is None:
                continue
            want, why = decision
            log.info(why)
            self.decisions.append(why)
            self._resized_at[name] = now
            self.client.set_pool_size(name, nodes=want)
        return self.client.pool_sizes()

    def count(self, pool: str) -> int:
        """Nodes of ``pool`` running now (retiring ones excluded)."""
        return len(self.running.get(pool, []))
