"""The dashboard's memory: recent report snapshots as flat figures, and posted metric points.

    sampler (every sample_s) ── report ──► report_figures() ──► FigureHistory (bounded ring)
    POST /v1/admin/metrics ── MetricPoints ─────────────────────► FigureHistory (bounded ring)
    GET /dashboard/data?after=SEQ ◄── every entry newer than SEQ, plus the latest report

Memory only (a view, not state): a restarted service starts a fresh history. Figure names are
``<kind>/<name>/<quantity>`` (``policy/solver/reward_mean``, ``pool/local/samples_per_s``,
``node/n1/refresh_s/solver``); the launcher's trackers log the same names.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from typing import Any

from astraflow.records import DataflowReport, MetricPoint

__all__ = ["FigureHistory", "report_figures"]

_POLICY_FIELDS = (
    "buffered_samples", "buffered_groups", "served_samples", "in_flight_samples", "max_buffered",
    "stale_dropped_samples", "filtered_samples", "acked_samples",
)  # fmt: skip
_POOL_FIELDS = ("nodes", "samples_per_s", "tasks_per_s", "leased", "failures", "lease_expiries")
_TRAINER_FIELDS = ("samples_per_s", "waiting_fraction", "version", "batches")
_NODE_FIELDS = ("samples_per_s", "tasks_per_s", "leased", "failures")


def report_figures(report: DataflowReport) -> dict[str, float]:
    """The report as flat, finite figures (what the dashboard plots and trackers log)."""
    out: dict[str, float] = {
        "tasks/pending": report.tasks.pending,
        "tasks/leased": report.tasks.leased,
        "tasks/done": report.tasks.done,
        "tasks/failed": report.tasks.failed,
    }
    for name, p in report.policies.items():
        key = f"policy/{name}"
        out |= {f"{key}/{f}": float(getattr(p, f)) for f in _POLICY_FIELDS}
        if p.latest_version is not None:
            out[f"{key}/version"] = p.latest_version
        if p.reward_mean is not None:
            out[f"{key}/reward_mean"] = p.reward_mean
        if sum(bins := p.served_staleness):
            out[f"{key}/staleness_mean"] = sum(i * n for i, n in enumerate(bins)) / sum(bins)
            out |= {f"{key}/served_staleness/{i}": n for i, n in enumerate(bins)}
        out |= {f"{key}/metrics/{m}": v for m, v in p.sample_metrics.items()}
    for name, pool in report.pools.items():
        out |= {f"pool/{name}/{f}": float(getattr(pool, f)) for f in _POOL_FIELDS}
        for f in ("desired_nodes", "target_nodes"):
            if (value := getattr(pool, f)) is not None:
                out[f"pool/{name}/{f}"] = value
    for name, t in report.trainers.items():
        out |= {f"trainer/{name}/{f}": float(getattr(t, f)) for f in _TRAINER_FIELDS}
    for name, node in report.nodes.items():
        out |= {f"node/{name}/{f}": float(getattr(node, f)) for f in _NODE_FIELDS}
        for k, v in node.stats.extra.items():
            if k.startswith("refresh_s."):
                out[f"node/{name}/refresh_s/{k.removeprefix('refresh_s.')}"] = v
    return {k: float(v) for k, v in out.items() if math.isfinite(v)}


class FigureHistory:
    """Two bounded rings (report snapshots, metric points) numbered by one sequence."""

    def __init__(self, capacity: int) -> None:
        self._seq = itertools.count(1)
        self.last_seq = 0
        self.snapshots: deque[tuple[int, float, dict[str, float]]] = deque(maxlen=capacity)
        self.points: deque[tuple[int, MetricPoint]] = deque(maxlen=capacity)
        self.latest: DataflowReport | None = None

    def _next(self) -> int:
        self.last_seq = next(self._seq)
        return self.last_seq

    def add_report(self, report: DataflowReport) -> None:
        """Remember a report (its figures; the whole of the latest one)."""
        self.latest = report
        self.snapshots.append((self._next(), report.time, report_figures(report)))

    def add_points(self, points: list[MetricPoint]) -> None:
        """Remember posted metric points."""
        for point in points:
            self.points.append((self._next(), point))

    def since(self, after: int) -> dict[str, Any]:
        """Everything newer than sequence number ``after``, as the dashboard reads it."""
        return {
            "seq": self.last_seq,
            "snapshots": [{"t": t, "f": f} for seq, t, f in self.snapshots if seq > after],
            "points": [p.model_dump(mode="json") for seq, p in self.points if seq > after],
            "report": None if self.latest is None else self.latest.model_dump(mode="json"),
        }
