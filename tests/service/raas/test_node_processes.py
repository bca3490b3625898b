"""Rollout nodes as real processes (``astraflow raas serve``) and real signals.

SIGTERM: the node stops leasing, gives running tasks a grace period, hands the rest back
(re-queued at once, long before their leases would expire) and exits 0. SIGKILL: nothing
is cleaned up, yet no task is lost: the leases expire and another node finishes them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from astraflow.records import (
    AckRequest,
    LeaseRequest,
    PolicyVersion,
    Sample,
    TakeBatchRequest,
)
from fixtures.raas import (
    SLEEPY,
    DataflowHarness,
    PolicyStore,
    dataflow_config,
    node_command,
    write_tasks,
)

pytestmark = pytest.mark.e2e

TESTS = Path(__file__).resolve().parents[2]


def _start_node(
    tmp: Path, name: str, dataflow: str, weights: str, **kw: Any
) -> subprocess.Popen[bytes]:
    config = {
        "dataflow_url": dataflow,
        "weights": weights,
        "node_id": name,
        "policies": {"policy": {"engine": {"type": "transformers", "device": "cpu"}}},
        "workflows": {SLEEPY: {"sampling": {"max_new_tokens": 4}}},
        "work_dir": str(tmp / name),
        "idle_wait_s": 0.2,
        **kw,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    pythonpath = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    with (tmp / f"{name}.log").open("wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            node_command("--config", str(path)), env=env, stdout=log, stderr=subprocess.STDOUT
        )


def _wait(what: str, check: Callable[[], bool], timeout_s: float, procs: list[Any]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        for p in procs:
            assert p.poll() is None, f"node exited early with {p.returncode}"
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _stop(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


@contextlib.contextmanager
def _node_holding_three_tasks(
    tmp: Path, name: str, weight_server: str, *, sleep_s: float, grace_s: float
) -> Iterator[tuple[Any, subprocess.Popen[bytes]]]:
    """A node process (``grace_s``) holding the leases of three tasks that sleep ``sleep_s``
    (lease ttl ``sleep_s``); the dataflow client and the node; everything stopped after."""
    tasks = write_tasks(tmp / "tasks.jsonl", ["1+1=", "2+2=", "1+2="], sleep_s=sleep_s)
    harness = DataflowHarness(
        dataflow_config(tmp / "df", tasks, ttl_s=sleep_s, workflow=SLEEPY, group_size=1)
    )
    client = harness.client()
    node = _start_node(tmp, name, harness.url, weight_server, capacity=4, grace_s=grace_s)
    try:
        _wait(
            "the node to hold all three tasks",
            lambda: getattr(client.report().nodes.get(name), "leased", 0) == 3,
            90,
            [node],
        )
        yield client, node
    finally:
        _stop(node)
        client.close()
        harness.stop()


def test_sigterm_hands_leases_back_and_exits_zero(
    tmp_path: Path, store: PolicyStore, weight_server: str
) -> None:
    with _node_holding_three_tasks(
        tmp_path, "node-t", weight_server, sleep_s=60.0, grace_s=1.0
    ) as (client, node):
        sent = time.monotonic()
        node.send_signal(signal.SIGTERM)
        assert node.wait(30) == 0
        assert time.monotonic() - sent < 20, "grace period 1 s: it must not wait for the tasks"
        assert client.pool_sizes().pools["default"].observed == 0, "it left when it released"
        reply = client.lease(LeaseRequest(node_id="other", capacity=8, workflows=[SLEEPY]))
        assert len({t.task_id for t in reply.tasks}) == 3
        assert all(t.attempt == 1 for t in reply.tasks), "handed back, not expired (ttl 60 s)"
        log = (tmp_path / "node-t.log").read_text()
        assert "released leases=3" in log
        # once ready, its start-up objects were moved out of the garbage collector's way
        assert "heap frozen component=node" in log


def test_once_every_trainer_is_final_sigterm_skips_the_grace_period(
    tmp_path: Path, store: PolicyStore, weight_server: str
) -> None:
    # the end of a run: the trainer announced its final version, so whatever the node's tasks
    # still make would be dropped. A stop hands them back at once instead of waiting out a
    # grace period of 120 s (with tasks that sleep 300 s)
    log = tmp_path / "node-f.log"
    with _node_holding_three_tasks(
        tmp_path, "node-f", weight_server, sleep_s=300.0, grace_s=120.0
    ) as (client, node):
        store.publish_perturbed(1, fraction=0.2)
        ref = store.store.manifest_ref("policy", 1)
        client.announce(PolicyVersion(policy="policy", version=1, manifest=ref, final=True))
        _wait("the node to refresh to the final version", lambda: "to=1" in log.read_text(),
              60, [node])  # fmt: skip
        node.send_signal(signal.SIGTERM)
        assert node.wait(60) == 0, "it waited for its tasks although the trainer is done"
        text = log.read_text()
        assert "handed back now (the trainers of policy have finished)" in text
        assert "released leases=3 requeued=3" in text
        reply = client.lease(LeaseRequest(node_id="other", capacity=8, workflows=[SLEEPY]))
        assert len({t.task_id for t in reply.tasks}) == 3, "nothing is lost: all re-queued"


def test_kill_9_loses_no_task(tmp_path: Path, store: PolicyStore, weight_server: str) -> None:
    prompts = ["0+0=", "0+1=", "1+0=", "1+1=", "2+0=", "0+2="]
    tasks = write_tasks(tmp_path / "tasks.jsonl", prompts, sleep_s=2.0)
    harness = DataflowHarness(
        dataflow_config(tmp_path / "df", tasks, ttl_s=3.0, workflow=SLEEPY, group_size=1)
    )
    client = harness.client()
    victim = _start_node(tmp_path, "node-victim", harness.url, weight_server, capacity=3)
    survivor: subprocess.Popen[bytes] | None = None
    try:
        _wait(
            "the victim to hold leases",
            lambda: getattr(client.report().nodes.get("node-victim"), "leased", 0) >= 1,
            90,
            [victim],
        )
        survivor = _start_node(tmp_path, "node-survivor", harness.url, weight_server, capacity=3)
        time.sleep(0.5)
        held = client.report().nodes["node-victim"].leased
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        _wait(
            "every task to be done",
            lambda: client.report().tasks.done == len(prompts),
            120,
            [survivor],
        )
        report = client.report()
        assert report.tasks.failed == 0
        assert report.nodes["node-victim"].lease_expiries == held >= 1
        samples: list[Sample] = []
        while len(samples) < len(prompts):
            batch = client.take_batch(
                TakeBatchRequest(policy="policy", trainer_version=0, max_samples=64, timeout_s=5)
            )
            assert batch is not None
            samples += batch.samples
            client.ack(AckRequest(batch_id=batch.batch_id))
        assert len({s.task_id for s in samples}) == len(prompts) == len(samples)
        retried = [s for s in samples if s.meta["attempt"] >= 1]
        assert len(retried) >= 1 and all(s.meta["node"] == "node-survivor" for s in retried)
    finally:
        _stop(victim, *([survivor] if survivor else []))
        client.close()
        harness.stop()
