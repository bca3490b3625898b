"""Desired rollout-pool sizes: what an admin or an autoscaler asks for; provisioners follow it.

    POST /v1/admin/pools {pool, nodes}  ──► desired[pool] = nodes
    POST /v1/admin/pools {pool, delta}  ──► desired[pool] = max(0, (desired or observed) + delta)
    GET  /v1/admin/pools                ──► per pool: desired, observed nodes, dead-band target

The service only records the number (durably, meta ``pools``); starting and retiring node
processes is the provisioner's job (``astraflow.launch``). Writes run in the caller's
transaction; memory is reloaded from the store if it fails.
"""

from __future__ import annotations

from astraflow.dataflow.store import Store
from astraflow.records import MAX_POOL_NODES, DataflowReport, PoolSize, PoolSizeRequest, PoolSizes

__all__ = ["PoolSizing"]


class PoolSizing:
    """Desired node count per pool (pools never set are absent: unknown)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        saved = store.get_meta("pools") or {}
        self.desired: dict[str, int] = {str(p): int(n) for p, n in saved.items()}

    def set(self, req: PoolSizeRequest, observed: int) -> int:
        """Apply a request; a ``delta`` starts from the desired size, or ``observed`` if unset."""
        if req.nodes is not None:
            nodes = req.nodes
        else:
            assert req.delta is not None  # the record holds exactly one of them
            nodes = self.desired.get(req.pool, observed) + req.delta
        nodes = min(MAX_POOL_NODES, max(0, nodes))
        self.desired[req.pool] = nodes
        self.store.set_meta("pools", self.desired)
        return nodes

    @staticmethod
    def sizes(report: DataflowReport) -> PoolSizes:
        """Every pool of a report (one with a desired size or a node seen) as ``PoolSize``."""
        pools = {
            name: PoolSize(
                pool=name,
                desired=p.desired_nodes,
                observed=p.nodes,
                target=p.target_nodes if p.target_nodes is not None else p.nodes,
            )
            for name, p in report.pools.items()
        }
        return PoolSizes(pools=pools)
