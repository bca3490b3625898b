"""Elastic pools on a live run: add and retire nodes, lose one to kill -9, lose no task."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest

from astraflow.dataflow.client import DataflowClient
from astraflow.errors import ServiceUnavailableError
from astraflow.launch.local import LocalRun
from fixtures.launch import (
    leased_tasks,
    node_processes,
    processes_mentioning,
    reduced_quickstart,
    running,
    task_states,
    wait_for,
)

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(240)
def test_pool_resize_and_node_crash_lose_no_task(tmp_path: Path) -> None:
    run_dir = tmp_path / "elastic"
    config = reduced_quickstart(
        run_dir,
        "dataflow.lease.ttl_s=3",  # a killed node's leases expire within seconds
        "eval=[]",
        "pools.0.capacity=4",
        steps=100_000,
    )
    run = LocalRun(config, tick_s=0.5)
    with running(run) as results, DataflowClient(run.plan.dataflow_url, timeout_s=10) as client:

        def version() -> int:
            try:  # the launcher may still be starting the service on a loaded machine
                latest = client.versions().get("policy")
            except ServiceUnavailableError:
                return -1
            return -1 if latest is None else latest.version

        wait_for(lambda: version() >= 5, 120, "training to start")
        (first,) = node_processes(run_dir)

        # grow the pool through the admin API (what `astraflow pool add` does)
        assert client.set_pool_size("local", delta=1).desired == 2
        wait_for(lambda: len(node_processes(run_dir)) == 2, 60, "a second node process")
        wait_for(lambda: client.report().pools["local"].nodes == 2, 60, "two nodes leasing")

        # kill -9 the newer node while it holds leases: nothing is cleaned up anywhere. It is
        # frozen first (SIGSTOP) so that the leases read are the ones it dies with: a running
        # node finishes these tiny tasks between a read and a kill
        (victim,) = set(node_processes(run_dir)) - {first}
        pid = node_processes(run_dir)[victim]
        orphaned = _freeze_holding_leases(run_dir, victim, pid)
        os.kill(pid, signal.SIGKILL)
        # the launcher replaces the lost node to keep the desired size
        wait_for(
            lambda: len(node_processes(run_dir)) == 2 and victim not in node_processes(run_dir),
            60, "a replacement node",
        )  # fmt: skip

        # retire one node (what `astraflow pool remove` does): it hands its leases back
        assert client.set_pool_size("local", delta=-1).desired == 1
        wait_for(lambda: len(node_processes(run_dir)) == 1, 60, "the pool to shrink")

        # every task the killed node held comes back and is finished by another node
        def redone() -> bool:
            states = task_states(run_dir, list(orphaned))
            return all(s == "done" and a > orphaned[t] for t, (s, a) in states.items())

        wait_for(redone, 60, f"orphaned tasks {sorted(orphaned)} to be redone")
        report = client.report()
        assert report.tasks.failed == 0
        assert report.nodes[victim].lease_expiries >= len(orphaned)
        v_before = version()
        wait_for(lambda: version() >= v_before + 5, 60, "training to go on with one node")
    assert results and results[0].reason == "stopped", results
    assert processes_mentioning(str(run_dir)) == []


def _freeze_holding_leases(run_dir: Path, node_id: str, pid: int) -> dict[str, int]:
    """SIGSTOP ``pid`` at a moment its node holds leases; return them (task id -> attempt)."""
    for _ in range(200):
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.3)  # let a request it sent before the freeze reach the service
        held = leased_tasks(run_dir, node_id)
        if held and held == leased_tasks(run_dir, node_id):
            return held
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.2)
    raise AssertionError(f"node {node_id} never held a lease while frozen")


@pytest.mark.timeout(360)
def test_autoscaler_follows_the_dead_band_target(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="astraflow.launch.pools")
    run_dir = tmp_path / "autoscale"
    # the trainer waits ~20% of the time; a band of 1-2% makes rollout look like the
    # bottleneck, so the dead-band target grows by one node per decision, up to max_nodes
    config = reduced_quickstart(
        run_dir,
        "eval=[]",
        "dataflow.report.window_s=4",
        "dataflow.report.band=[0.01, 0.02]",
        "autoscale.enabled=true",
        "autoscale.interval_s=2",
        "autoscale.scale_up_delay_s=2",
        "pools.0.min_nodes=1",
        "pools.0.max_nodes=3",
        steps=100_000,
    )
    run = LocalRun(config, tick_s=0.5)
    with running(run) as results:
        # each growth waits for the node before it to be seen (started, model loaded, leasing)
        wait_for(lambda: len(node_processes(run_dir)) == 3, 240, "the pool to grow to max_nodes")
        with DataflowClient(run.plan.dataflow_url, timeout_s=10) as client:
            assert client.pool_sizes().pools["local"].desired == 3
    assert results and results[0].reason == "stopped"
    decisions = run.pools.decisions
    assert [d.split(" (")[0] for d in decisions[:2]] == [
        "autoscale pool=local 1 -> 2 nodes",
        "autoscale pool=local 2 -> 3 nodes",
    ], decisions
    assert all("starting 0" in d for d in decisions), "never grows past a node not yet seen"
    assert all("-> 4" not in d for d in decisions), "max_nodes is a hard bound"
    logged = [r.getMessage() for r in caplog.records if r.name == "astraflow.launch.pools"]
    assert all(d in logged for d in decisions), "each decision is logged"
    assert processes_mentioning(str(run_dir)) == []
