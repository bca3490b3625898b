"""Reading the report changes nothing: the dead-band targets are decided by the clock-driven
sweep, so a reader polling at 100 Hz and one polling at 0.2 Hz see the same decisions."""

from __future__ import annotations

from pathlib import Path

from astraflow.dataflow.service import DataflowService
from astraflow.records import LeaseRequest, PoolTarget
from fixtures.dataflow import make_config

HZ = 100  # clock ticks per second
SWEEP_TICKS = 50  # the runtime's sweeper: every 0.5 s
DURATION_S = 60
REPORT = {
    "window_s": 5.0,
    "band": (0.1, 0.3),
    "scale_down_after_s": 12.0,
    "min_nodes": 1,
    "max_nodes": 8,
}


class TickClock:
    def __init__(self) -> None:
        self.tick = 0

    def __call__(self) -> float:
        return 1_000_000.0 + self.tick / HZ


def run(tmp_path: Path, poll_every_ticks: int) -> dict[int, tuple[PoolTarget, PoolTarget | None]]:
    """The same load for ``DURATION_S``; what a reader polling every ``poll_every_ticks`` saw.

    Three nodes of pool ``gpu`` lease every second; a trainer waits 0.9 s of every second
    until t=22 s (rollout is the bottleneck), then 0.01 s (rollout has surplus).
    Returns the overall and the ``gpu`` target at every whole 5 s, keyed by tick.
    """
    clock = TickClock()
    config = make_config(tmp_path, report=REPORT, lease={"ttl_s": 10.0})
    svc = DataflowService(config, clock=clock)
    seen: dict[int, tuple[PoolTarget, PoolTarget | None]] = {}
    handle = None
    try:
        for tick in range(DURATION_S * HZ + 1):
            clock.tick = tick
            within = tick % HZ
            if within == 0:
                for node in ("g1", "g2", "g3"):
                    svc.lease(
                        LeaseRequest(node_id=node, pool="gpu", capacity=0, workflows=["rlvr"])
                    )
            wait_ticks = 90 if tick < 22 * HZ else 1
            if within == 5:
                handle = svc.wait_started("t1", "solver")
            if within == 5 + wait_ticks and handle is not None:
                svc.wait_ended("t1", "solver", handle)
            if tick % SWEEP_TICKS == 0:
                svc.sweep()
            if tick % poll_every_ticks == 0:
                report = svc.report()
                if tick % (5 * HZ) == 0:
                    seen[tick] = (report.target, report.pool_targets.get("gpu"))
    finally:
        svc.close()
    return seen


def test_report_polling_rate_changes_no_decision(tmp_path: Path) -> None:
    fast = run(tmp_path / "fast", poll_every_ticks=1)  # 100 Hz
    slow = run(tmp_path / "slow", poll_every_ticks=5 * HZ)  # 0.2 Hz
    assert fast == slow
    targets = {tick // HZ: (overall.target_nodes, gpu and gpu.target_nodes)
               for tick, (overall, gpu) in fast.items()}  # fmt: skip
    # no trainer yet: hold at 0 active nodes, clamped to min_nodes (no node seen: no gpu target)
    assert targets[0] == (1, None)
    assert all(targets[t] == (4, 4) for t in (5, 10, 15, 20, 25))  # the trainer waits: up
    # the waiting fraction falls below the band at t=27 (the 5 s window forgets the long
    # waits): hold, then scale down 12 s later, at t=39; a reader that decided at its own
    # reads would first see "below" at t=30 and scale down only at t=42
    assert targets[30] == targets[35] == (3, 3)
    assert targets[40] == (2, 2) and "scale down" in fast[40 * HZ][0].reason
    assert fast[40 * HZ][0].decided_at == 1_000_000.0 + 40  # the sweep at t=40 decided it
