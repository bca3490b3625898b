"""What the maintainer sees happen to the pools: a bounded log of sizing decisions.

The dataflow service keeps only its latest dead-band decision (``report.pool_targets``); a
maintainer wants the recent history too. The MCP server builds it as a client would: each
time it reads the report (a tool call, a resource read, or its background poll) it records a
pool whose desired, observed or target node count changed since the previous read, with the
dead-band rule's reason, and every resize made through its own ``set_pool_size`` tool.

    report read ──► (desired, observed, target) per pool changed? ──► entry "report"
    set_pool_size tool ───────────────────────────────────────────► entry "mcp"
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from astraflow.records import DataflowReport, PoolSize

__all__ = ["Decision", "DecisionLog"]

#: Entries kept (oldest dropped first).
MAX_DECISIONS = 500


class Decision(BaseModel):
    """One change of a pool's sizing, as the maintainer saw it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    time: float
    """Unix time the change was seen (report entries: the report's time)."""
    source: Literal["report", "mcp"]
    """report: seen in the dataflow's report; mcp: a resize made through this server's tool."""
    pool: str
    """Pool label."""
    desired: int | None = None
    """Desired node count after the change (None: never set)."""
    observed: int = Field(ge=0)
    """Nodes seen within one lease ttl."""
    target: int | None = None
    """The dead-band target for the pool (None: no decision yet)."""
    waiting_fraction: float | None = None
    """Highest trainer waiting fraction in the report window (None: no trainer activity)."""
    reason: str
    """The dead-band rule's reason (report entries) or the caller's reason (mcp entries)."""


class DecisionLog:
    """Thread-safe bounded log; the background poller and the tools both write to it."""

    def __init__(self, maxlen: int = MAX_DECISIONS) -> None:
        self._entries: deque[Decision] = deque(maxlen=maxlen)
        self._last: dict[str, tuple[int | None, int, int | None]] = {}
        self._lock = threading.Lock()

    def observe(self, report: DataflowReport) -> None:
        """Record each pool whose (desired, observed, target) changed since the last report."""
        with self._lock:
            for name, pool in sorted(report.pools.items()):
                target = report.pool_targets.get(name)
                key = (pool.desired_nodes, pool.nodes, pool.target_nodes)
                if self._last.get(name) == key:
                    continue
                self._last[name] = key
                self._entries.append(
                    Decision(
                        time=report.time, source="report", pool=name, desired=pool.desired_nodes,
                        observed=pool.nodes, target=pool.target_nodes,
                        waiting_fraction=None if target is None else target.waiting_fraction,
                        reason=report.target.reason if target is None else target.reason,
                    )
                )  # fmt: skip

    def resized(self, size: PoolSize, reason: str) -> None:
        """Record a resize made through the ``set_pool_size`` tool."""
        entry = Decision(
            time=time.time(), source="mcp", pool=size.pool, desired=size.desired,
            observed=size.observed, target=size.target, reason=reason or "set_pool_size",
        )  # fmt: skip
        with self._lock:
            self._entries.append(entry)

    def recent(self, limit: int, pool: str | None = None) -> list[dict[str, Any]]:
        """The latest ``limit`` entries (oldest first), of one pool or all."""
        with self._lock:
            entries = [e for e in self._entries if pool is None or e.pool == pool]
        return [e.model_dump(mode="json") for e in entries[-limit:]] if limit > 0 else []
