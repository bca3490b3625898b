"""A trainer's waiting, as the report counts it, when the trainer prefetches: a take for a
version not announced yet overlaps the step that makes it, so it counts only from that
version's announcement; an ordinary take counts whole."""

from __future__ import annotations

from pathlib import Path

from astraflow.dataflow.service import DataflowService
from astraflow.records import PolicyVersion
from fixtures.dataflow import make_config


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _announce(svc: DataflowService, version: int) -> None:
    svc.announce(PolicyVersion(policy="solver", version=version, manifest=f"m{version}"))


def _waited(tmp_path: Path, trainer_version: int, announce_at: float | None) -> float:
    """Waiting fraction after one 2 s take starting at t=0 (v0 announced before it)."""
    clock = Clock()
    svc = DataflowService(make_config(tmp_path, report={"window_s": 10.0}), clock=clock)
    try:
        start = clock.now
        _announce(svc, 0)
        handle = svc.wait_started("t1", "solver", trainer_version)
        if announce_at is not None:
            clock.now = start + announce_at
            _announce(svc, 1)
        clock.now = start + 2.0
        svc.wait_ended("t1", "solver", handle)
        return svc.report().trainers["t1"].waiting_fraction
    finally:
        svc.close()


def test_a_prefetch_counts_as_waiting_only_after_its_version_is_announced(
    tmp_path: Path,
) -> None:
    assert _waited(tmp_path / "plain", 0, None) == 1.0  # an ordinary take: all of it
    assert _waited(tmp_path / "early", 1, None) == 0.0  # the step outlasted the long-poll
    late = _waited(tmp_path / "late", 1, 1.5)  # the step ended 0.5 s before the batch came
    assert abs(late - 0.25) < 1e-6
