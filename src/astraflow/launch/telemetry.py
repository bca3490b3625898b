"""Forward what the components write to the experiment trackers and the live dashboard.

    every launcher tick:
      trainers/<p>/metrics.jsonl (new lines) ──► trainer/<p>/<figure>   step = version
      eval/<p>.jsonl (new lines) ──────────────► eval/<p>/<figure>      step = version
                                   └───────────► POST /v1/admin/metrics (the dashboard's
                                                 held-out curves)
      the dataflow report (every report_every_s) ► dataflow/<figure> (``history.report_figures``)
                                                 step = its policy's version (else the newest)
    wall time: the record's ``time`` (the report's ``time``)

The launcher only reads files and the report, as the live view does; components never learn
that trackers exist. A tracker that raises is dropped with a warning and the run goes on.
"""

from __future__ import annotations

import logging
import math
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astraflow.dataflow.client import DataflowClient
from astraflow.dataflow.history import report_figures
from astraflow.errors import AstraflowError
from astraflow.launch.status import JsonlTail
from astraflow.launch.trackers import LoggingSection, Tracker, build_trackers
from astraflow.records import MAX_POINT_VALUES, NAME_PATTERN, DataflowReport, MetricPoint

if TYPE_CHECKING:
    from astraflow.launch.config import RunConfig

__all__ = ["RunFeed", "numeric_figures"]

log = logging.getLogger(__name__)

#: Record fields that are coordinates, not figures.
_COORDINATES = frozenset({"version", "time", "created_at", "policy", "step"})
_NAME = re.compile(NAME_PATTERN)
_POLICY_FIGURE = re.compile(r"^policy/([^/]+)/")

Figures = tuple[dict[str, float], int, float]
"""(figures, step, wall time)."""


def numeric_figures(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a JSONL record, coordinates left out."""
    return {
        str(k): float(v) for k, v in record.items()
        if k not in _COORDINATES and isinstance(v, (int, float)) and not isinstance(v, bool)
        and math.isfinite(v)
    }  # fmt: skip


class RunFeed:
    """Reads the run's metric files each tick and fans them out."""

    def __init__(
        self, run_dir: Path, settings: LoggingSection, policies: list[str],
        params: tuple[dict[str, Any], dict[str, Any]], client: DataflowClient | None,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.client = client
        """Where eval points go for the dashboard (None: nowhere)."""
        self.trackers: list[Tracker] = build_trackers(settings, run_dir) if settings.any else []
        self._metrics = {p: JsonlTail(run_dir / "trainers" / p / "metrics.jsonl") for p in policies}
        self._evals = {p: JsonlTail(run_dir / "eval" / f"{p}.jsonl") for p in policies}
        self._last_report = -math.inf
        self._post_failed = False
        self._each("params", *params)

    @classmethod
    def for_run(
        cls, config: RunConfig, run_dir: Path, client: DataflowClient, resuming: bool
    ) -> RunFeed:
        """The feed of a launched run: its configs are the trackers' parameters, eval points go
        to its dashboard; a resumed run forwards only what is written from now on."""
        given = config.model_dump(mode="json", exclude_unset=True)
        resolved = config.model_dump(mode="json")
        feed = cls(
            run_dir, config.logging, list(config.policies), (given, resolved),
            client if config.dataflow.dashboard.enabled else None,
        )  # fmt: skip
        if resuming:
            for tail in [*feed._metrics.values(), *feed._evals.values()]:
                tail.skip()
        return feed

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:  # the boundary of an optional tracker: the run goes on
                log.warning("tracker %s failed (%s: %s); logging to it is off for this run",
                            tracker.name, type(exc).__name__, exc)  # fmt: skip
                self.trackers.remove(tracker)

    def tick(self, report: DataflowReport | None, *, post: bool = True) -> None:
        """Forward what is new; ``post=False`` skips the dashboard (the service is gone)."""
        groups: list[Figures] = []
        points: list[MetricPoint] = []
        for policy, tail in self._metrics.items():
            for rec in tail.read():
                figures = {f"trainer/{policy}/{k}": v for k, v in numeric_figures(rec).items()}
                groups.append((figures, int(rec.get("version", 0)), _wall(rec)))
        for policy, tail in self._evals.items():
            for rec in tail.read():
                values = numeric_figures(rec)
                groups.append(
                    ({f"eval/{policy}/{k}": v for k, v in values.items()},
                     int(rec.get("version", 0)), _wall(rec))
                )  # fmt: skip
                points.append(_point(policy, rec, values))
        now = time.monotonic()
        if report is not None and now - self._last_report >= self.settings.report_every_s:
            self._last_report = now
            groups += _report_groups(report)
        for figures, step, wall in groups:
            if figures:
                self._each("log", figures, step, wall)
        if post and points and self.client is not None:
            self._post(points)

    def _post(self, points: list[MetricPoint]) -> None:
        assert self.client is not None
        try:
            self.client.post_metrics(points)
        except AstraflowError as exc:  # the dashboard misses these points; nothing else does
            if not self._post_failed:
                log.warning("could not post eval points to the dashboard: %s", exc)
            self._post_failed = True

    def close(self) -> None:
        """Forward what is left, then finish every tracker's run."""
        self.tick(None, post=False)
        self._each("close")


def _wall(rec: dict[str, Any]) -> float:
    value = rec.get("time", rec.get("created_at"))
    return float(value) if isinstance(value, (int, float)) else time.time()


def _point(policy: str, rec: dict[str, Any], values: dict[str, float]) -> MetricPoint:
    named = {k: v for k, v in values.items() if _NAME.match(k)}
    kept = dict(sorted(named.items())[:MAX_POINT_VALUES])
    created = rec.get("created_at")
    at = float(created) if isinstance(created, (int, float)) and created > 0 else _wall(rec)
    return MetricPoint(
        policy=policy, source="eval", version=max(0, int(rec.get("version", 0))), time=at,
        values=kept,
    )  # fmt: skip


def _report_groups(report: DataflowReport) -> list[Figures]:
    """The report's figures, split by the policy version that steps them."""
    versions = {
        name: p.latest_version for name, p in report.policies.items()
        if p.latest_version is not None
    }  # fmt: skip
    newest = max(versions.values(), default=0)
    by_step: dict[int, dict[str, float]] = {}
    for key, value in report_figures(report).items():
        m = _POLICY_FIGURE.match(key)
        step = versions.get(m.group(1), newest) if m else newest
        by_step.setdefault(step, {})[f"dataflow/{key}"] = value
    return [(figures, step, report.time) for step, figures in sorted(by_step.items())]
