"""Keep each rollout pool at its desired size: the provisioner side of elasticity.

The dataflow service holds the desired node count per pool (``astraflow pool add|remove``
and its admin API change it; the autoscaler sets it from the report's dead-band target).
This manager only makes reality match it, with whatever starts and stops nodes (local
processes, Ray actors):

    desired (admin API) ──┐
    autoscaler target ────┴─► desired ──► running < desired: start · running > desired: retire
    a node that died ─────────────────► no longer running ──► replaced at the next tick
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from astraflow.dataflow.client import DataflowClient
from astraflow.errors import AstraflowError
from astraflow.launch.config import AutoscaleConfig, PoolSection
from astraflow.records import PoolSizes

__all__ = ["PoolManager"]

log = logging.getLogger(__name__)


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
        try:
            sizes = self.client.pool_sizes()
            if self.autoscale.enabled and time.monotonic() >= self._next_autoscale:
                self._next_autoscale = time.monotonic() + self.autoscale.interval_s
                sizes = self._autoscale(sizes)
        except AstraflowError as exc:  # the service is restarting: keep the pools as they are
            log.warning("pool sizes unavailable: %s", exc)
            return
        for name, pool in self.pools.items():
            entry = sizes.pools.get(name)
            desired = entry.desired if entry is not None and entry.desired is not None else 0
            self._match(pool, desired)

    def _match(self, pool: PoolSection, desired: int) -> None:
        ids = self.running[pool.name]
        while len(ids) < desired:
            node_id = self._start(pool)
            ids.append(node_id)
            log.info("pool=%s started node=%s (%d/%d)", pool.name, node_id, len(ids), desired)
        while len(ids) > desired:
            node_id = ids.pop()
            self.retiring.add(node_id)
            self._stop(node_id)
            log.info("pool=%s retiring node=%s (%d/%d)", pool.name, node_id, len(ids), desired)

    def _autoscale(self, sizes: PoolSizes) -> PoolSizes:
        """Set each pool's desired size to the dead-band target, within its min and max."""
        for name, pool in self.pools.items():
            entry = sizes.pools.get(name)
            if entry is None:
                continue
            want = max(pool.min_nodes, min(pool.max_nodes, entry.target))
            if entry.desired is not None and want != entry.desired:
                decision = (
                    f"autoscale pool={name} {entry.desired} -> {want} nodes (target {entry.target})"
                )
                log.info(decision)
                self.decisions.append(decision)
                self.client.set_pool_size(name, nodes=want)
        return self.client.pool_sizes()

    def count(self, pool: str) -> int:
        """Nodes of ``pool`` running now (retiring ones excluded)."""
        return len(self.running.get(pool, []))
