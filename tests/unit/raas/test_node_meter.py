"""The node's throughput figures: completions inside the window count, older ones leave it."""

from __future__ import annotations

import pytest

from astraflow.raas import stats
from astraflow.raas.stats import NodeMeter


def test_the_window_keeps_its_sums_as_completions_come_and_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(stats.time, "monotonic", lambda: now[0])
    meter = NodeMeter(window_s=10.0, hardware="cpu x2")
    meter.task_done(8, 0.5)
    now[0] = 105.0
    meter.task_done(4, 1.5)
    now[0] = 110.0  # both inside the window (10 s since the start)
    first = meter.snapshot(in_flight=2, tokens_total=0)
    assert first.samples_per_s == pytest.approx(12 / 10)
    assert first.mean_task_latency_s == pytest.approx(1.0)
    assert (first.completed, first.in_flight) == (2, 2)
    now[0] = 112.0  # the first completion (t=100) left the window
    second = meter.snapshot(in_flight=0, tokens_total=0)
    assert second.samples_per_s == pytest.approx(4 / 10)
    assert second.mean_task_latency_s == pytest.approx(1.5)
    now[0] = 200.0  # all gone: nothing left to average
    third = meter.snapshot(in_flight=0, tokens_total=0)
    assert third.samples_per_s == 0.0 and third.mean_task_latency_s == 0.0
    meter.task_done(2, 0.25)  # and the sums start again from nothing
    assert meter.snapshot(in_flight=0, tokens_total=0).mean_task_latency_s == pytest.approx(0.25)
    assert meter.completed == 3
