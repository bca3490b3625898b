"""Regulation rules, report measurements and the dead-band target, as pure functions."""

from __future__ import annotations

import random

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from astraflow.dataflow.config import RegulationConfig, ReportConfig
from astraflow.dataflow.metrics import metrics_text
from astraflow.dataflow.regulation import (
    admission,
    group_behaviour_version,
    lease_allowance,
    lease_grant,
    room,
    staleness,
    tasks_that_fit,
)
from astraflow.dataflow.report import DeadBand, RateWindow, WaitTracker
from astraflow.records import (
    DataflowReport,
    PoolTarget,
    TaskQueueReport,
)
from fixtures.dataflow import make_sample


def test_group_staleness_is_the_stalest_samples() -> None:
    rng = random.Random(0)
    for _ in range(200):
        group = []
        for _ in range(rng.randint(1, 5)):
            s = make_sample("t", version=rng.randint(0, 9))
            if rng.random() < 0.2:  # a sample with no generated token
                s = s.model_copy(update={"versions": np.full(8, -1, dtype=np.int32)})
            group.append(s)
        v = rng.randint(0, 12)
        assert staleness(group_behaviour_version(group), v) == max(s.staleness(v) for s in group)


def test_admission() -> None:
    latest = {"solver": 5, "judge": 2}
    bound = {"solver": 1, "judge": 0, "frozen": 0}
    held = {"solver": 4, "judge": 1}
    refresh = admission(["solver", "judge", "frozen"], held, latest, bound)
    assert set(refresh) == {"judge"}  # 1 behind > 0; solver 1 behind <= 1; frozen: no version
    assert "holds version -1" in admission(["solver"], {}, latest, bound)["solver"]


def test_room_and_lease_sizes() -> None:
    assert room(10, 4, 3) == 3 and room(10, 8, 5) == 0
    assert tasks_that_fit([7, 12], 2) == 3 and tasks_that_fit([1], 2) == 0
    cfg = RegulationConfig(window_s=10, min_lease=1)
    assert lease_allowance(None, cfg) is None
    assert lease_allowance(None, cfg.model_copy(update={"initial_lease": 3})) == 3
    assert lease_allowance(0.0, cfg) == 1
    assert lease_allowance(0.25, cfg) == 3
    assert lease_grant(4, 10, None) == 4  # no measurement: whatever it asks for
    assert lease_grant(4, 1, 3) == 2 and lease_grant(4, 5, 3) == 0


def test_rate_window() -> None:
    w = RateWindow(10.0)
    for t in range(20):
        w.add(100.0 + t, 2.0)
    assert w.rate(119.0, since=100.0) == 2.0 * 10 / 10  # only the last 10 s count
    fresh = RateWindow(60.0)
    fresh.add(0.0, 5.0)
    assert fresh.rate(0.1, since=0.0) == 5.0  # never averaged over less than 1 s


def test_wait_tracker_fraction() -> None:
    w = WaitTracker(10.0)
    h = w.start(0.0)
    w.end(h, 2.0)
    h1, h2 = w.start(4.0), w.start(5.0)  # overlapping waits count once
    w.end(h1, 6.0)
    w.end(h2, 7.0)
    assert w.fraction(10.0, since=0.0) == 0.5
    open_ = w.start(18.0)
    assert abs(w.fraction(20.0, since=0.0) - 0.2) < 1e-9  # an open wait counts up to now
    w.end(open_, 20.0)


def test_dead_band() -> None:
    band = DeadBand(ReportConfig(band=(0.1, 0.3), scale_down_after_s=60, min_nodes=1, max_nodes=5))
    assert band.target(0, 3, 0.5).target_nodes == 4  # trainer waits: scale up
    assert band.target(1, 5, 0.9).target_nodes == 5  # capped at max_nodes
    assert band.target(2, 3, 0.2).target_nodes == 3  # inside the band: hold
    assert band.target(3, 3, 0.05).target_nodes == 3  # below, not yet for long
    held = band.target(40, 3, 0.02)
    assert held.target_nodes == 3 and "holding" in held.reason
    down = band.target(63, 3, 0.02)
    assert down.target_nodes == 2 and "scale down" in down.reason
    assert band.target(64, 2, 0.02).target_nodes == 2  # pool changed: a new window starts
    assert band.target(65, 2, None).target_nodes == 2


def test_metrics_render_the_report() -> None:
    report = DataflowReport(
        time=1.0,
        uptime_s=1.0,
        window_s=60,
        tasks=TaskQueueReport(pending=1, leased=2, done=3, failed=0),
        target=PoolTarget(current_nodes=2, target_nodes=3, band=(0.1, 0.3), reason="up"),
        plugins={"selector": {"issued": 6.0}},
    )
    families = {f.name: f for f in text_string_to_metric_families(metrics_text(report).decode())}
    assert families["astraflow_dataflow_target_nodes"].samples[0].value == 3
    done = [s for s in families["astraflow_dataflow_tasks"].samples if s.labels["state"] == "done"]
    assert done[0].value == 3
    plugin = families["astraflow_dataflow_plugin_metric"].samples[0]
    assert plugin.labels == {"plugin": "selector", "name": "issued"} and plugin.value == 6
