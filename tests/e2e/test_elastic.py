"""Elastic pools on a live run: add and retire nodes, lose one to kill -9, lose no task."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from astraflow.dataflow.client import DataflowClient
from astraflow.launch.local import LocalRun, RunResult
from fixtures.launch import (
    leased_tasks,
    node_processes,
    processes_mentioning,
    reduced_quickstart,
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
    stop = threading.Event()
    results: list[RunResult] = []
    thread = threading.Thread(target=lambda: results.append(run.run(stop)))
    thread.start()
    client = DataflowClient(run.plan.dataflow_url, timeout_s=10)
    try:

        def version() -> int:
            latest = client.versions().get("policy")
            return -1 if latest is None else latest.version

        wait_for(lambda: version() >= 5, 120, "training to start")
        (first,) = node_processes(run_dir)

        # grow the pool through the admin API (what `astraflow pool add` does)
        assert client.set_pool_size("local", delta=1).desired == 2
        wait_for(lambda: len(node_processes(run_dir)) == 2, 60, "a second node process")
        wait_for(lambda: client.report().pools["local"].nodes == 2, 60, "two nodes leasing")

        # kill -9 the newer node while it holds leases: nothing is cleaned up anywhere
        (victim,) = set(node_processes(run_dir)) - {first}
        wait_for(lambda: bool(leased_tasks(run_dir, victim)), 30, "the node to hold leases")
        orphaned = leased_tasks(run_dir, victim)
        os.kill(node_processes(run_dir)[victim], signal.SIGKILL)
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
    finally:
        stop.set()
        thread.join(timeout=120)
        client.close()
    assert results and results[0].reason == "stopped", results
    assert processes_mentioning(str(run_dir)) == []
