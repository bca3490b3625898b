"""The launcher's feed: files and report → trackers (stepped by version) and the dashboard's
eval points; a tracker that fails is dropped with a warning and the others go on."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from astraflow.dataflow.client import DataflowClient
from astraflow.dataflow.history import report_figures
from astraflow.launch.telemetry import RunFeed
from astraflow.launch.trackers import LoggingSection
from astraflow.records import DataflowReport
from fixtures.dataflow import make_config
from fixtures.trackers import tensorboard_scalars


def _append(path: Path, *records: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def _report(version: int, refresh_s: float) -> DataflowReport:
    return DataflowReport.model_validate(
        {
            "time": 1.7e9 + version, "uptime_s": 5.0, "window_s": 60.0,
            "tasks": {"pending": 3, "leased": 2, "done": 9, "failed": 0},
            "policies": {"solver": {
                "policy": "solver", "latest_version": version, "buffered_samples": 8,
                "buffered_groups": 4, "served_samples": 16, "in_flight_samples": 2,
                "max_buffered": 64, "stale_dropped_samples": 0, "filtered_samples": 0,
                "acked_samples": 16, "reward_mean": 0.5, "served_staleness": [12, 4],
            }},
            "nodes": {"n1": {
                "node_id": "n1", "pool": "local", "samples_per_s": 3.0, "tasks_per_s": 1.0,
                "leased": 2, "completed": 9, "failures": 0, "lease_expiries": 0,
                "last_seen_s": 0.1, "stats": {"extra": {"refresh_s.solver": refresh_s}},
            }},
            "target": {"current_nodes": 1, "target_nodes": 1, "band": [0.1, 0.3],
                       "reason": "in band"},
        }
    )  # fmt: skip


def test_report_figures_flatten_the_report() -> None:
    figures = report_figures(_report(7, 0.25))
    assert figures["policy/solver/version"] == 7
    assert figures["policy/solver/reward_mean"] == 0.5
    assert figures["policy/solver/staleness_mean"] == pytest.approx(4 / 16)
    assert figures["policy/solver/served_staleness/1"] == 4
    assert figures["node/n1/refresh_s/solver"] == 0.25
    assert figures["tasks/pending"] == 3


class _Broken:
    """A tracker whose backend fails on every log (a lost connection, a full disk)."""

    name = "broken"

    def params(self, run: dict[str, Any], resolved: dict[str, Any]) -> None:
        pass

    def log(self, figures: dict[str, float], step: int, wall_time: float) -> None:
        raise OSError("disk full")

    def close(self) -> None:
        pass


def test_feed_steps_by_version_and_survives_a_failing_tracker(
    tmp_path: Path, dataflow_factory: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    url = dataflow_factory(make_config(tmp_path / "df"))
    run_dir = tmp_path / "run"
    settings = LoggingSection.model_validate({"tensorboard": True, "report_every_s": 0.001})
    with DataflowClient(url) as client:
        feed = RunFeed(run_dir, settings, ["solver"], ({"seed": 1}, {"seed": 1}), client)
        assert [t.name for t in feed.trackers] == ["tensorboard"]
        feed.trackers.append(_Broken())
        metrics = run_dir / "trainers" / "solver" / "metrics.jsonl"
        _append(metrics, *({"version": v, "time": 1.7e9 + v, "loss": v / 10} for v in (1, 2)))
        _append(run_dir / "eval" / "solver.jsonl",
                {"policy": "solver", "version": 2, "created_at": 1.7e9 + 2, "accuracy": 0.5,
                 "n": 40, "time": 1.7e9 + 3})  # fmt: skip
        with caplog.at_level(logging.WARNING):
            feed.tick(_report(2, 0.125))
            _append(metrics, {"version": 3, "time": 1.7e9 + 3, "loss": 0.3})
            feed.tick(_report(3, 0.25))
        feed.close()
    warnings = [r.getMessage() for r in caplog.records if "broken" in r.getMessage()]
    assert len(warnings) == 1 and "disk full" in warnings[0]
    scalars = tensorboard_scalars(run_dir / "tensorboard" / "run")
    loss = scalars["trainer/solver/loss"]
    assert [s for s, _, _ in loss] == [1, 2, 3]
    assert [v for _, _, v in loss] == pytest.approx([0.1, 0.2, 0.3])
    assert [w for _, w, _ in loss] == pytest.approx([1.7e9 + 1, 1.7e9 + 2, 1.7e9 + 3])
    assert [s for s, _, _ in scalars["eval/solver/accuracy"]] == [2]
    assert [s for s, _, _ in scalars["dataflow/node/n1/refresh_s/solver"]] == [2, 3]
    data = httpx.get(url + "/dashboard/data").json()
    assert [(p["version"], p["values"]) for p in data["points"]] == [
        (2, {"accuracy": 0.5, "n": 40.0})
    ]


def test_a_tracker_that_cannot_start_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    occupied = tmp_path / "not-a-dir"
    occupied.write_text("x")
    settings = LoggingSection.model_validate({"tensorboard": {"enabled": True, "dir": occupied}})
    with caplog.at_level(logging.WARNING):
        feed = RunFeed(tmp_path, settings, ["solver"], ({}, {}), None)
    assert feed.trackers == []
    assert "tracker tensorboard could not start" in caplog.text
    feed.tick(None)
    feed.close()
