"""Durability: ``kill -9`` of a real service process, restart from the same run directory."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from astraflow.dataflow.client import DataflowClient
from astraflow.errors import AstraflowError
from astraflow.records import (
    AckRequest,
    LeaseRequest,
    PolicyVersion,
    SubmitRequest,
    TakeBatchRequest,
    Task,
)
from fixtures.dataflow import DataflowProcess, granted, make_config, make_group, secret_of

Start = Callable[..., DataflowProcess]


def submit(c: DataflowClient, task: Task) -> bool:
    req = SubmitRequest(
        node_id="n1", task_id=task.task_id, attempt=task.attempt, samples=make_group(task),
        secret=secret_of("n1", task),
    )  # fmt: skip
    return c.submit(req).duplicate


def take(c: DataflowClient, n: int) -> str:
    batch = c.take_batch(
        TakeBatchRequest(
            policy="solver", trainer_version=1, min_samples=n, max_samples=n, timeout_s=0
        )
    )
    assert batch is not None
    return batch.batch_id


def test_state_survives_kill_9(tmp_path: Path, dataflow_process: Start) -> None:
    config = make_config(tmp_path / "df", selector="shuffled")
    proc = dataflow_process(config)
    with DataflowClient(proc.url) as c:
        tasks = granted("n1", c.lease(LeaseRequest(node_id="n1", capacity=4, workflows=["rlvr"])))
        c.announce(PolicyVersion(policy="solver", version=1, manifest="solver/v1/manifest.json"))
        submit(c, tasks[0])
        submit(c, tasks[1])
        acked = take(c, 2)
        c.ack(AckRequest(batch_id=acked))
        open_batch = take(c, 2)
        before = c.report()
    proc.kill()

    proc = dataflow_process(config)
    with DataflowClient(proc.url) as c:
        after = c.report()
        assert after.tasks == before.tasks  # 2 done, 2 still leased
        assert after.policies["solver"].acked_samples == 2
        assert after.policies["solver"].served_samples == 2
        assert c.versions()["solver"].version == 1
        assert submit(c, tasks[0])  # the acknowledged submission is remembered: duplicate
        assert not submit(c, tasks[2])  # the lease survived the crash
        c.ack(AckRequest(batch_id=open_batch))  # the open batch survived too
        rest = c.take_batch(TakeBatchRequest(policy="solver", trainer_version=1, timeout_s=0))
        assert rest is not None
        served = {s.task_id for s in rest.samples}
        assert served == {tasks[2].task_id}  # acked groups are never served again
        lease = LeaseRequest(node_id="n1", capacity=8, workflows=["rlvr"], versions={"solver": 1})
        more = c.lease(lease).tasks
        assert len(more) == 8
        assert {t.task_id for t in more}.isdisjoint(t.task_id for t in tasks)
    proc.stop()  # SIGTERM: graceful shutdown (uvicorn then re-raises the signal)
    assert "Application shutdown complete" in proc.log_path.read_text()


@pytest.mark.slow
def test_nothing_acknowledged_is_lost_when_killed_under_load(
    tmp_path: Path, dataflow_process: Start
) -> None:
    config = make_config(
        tmp_path / "df", policies={"solver": {"vocab_size": 64, "max_buffered": 10_000}}
    )
    proc = dataflow_process(config)
    accepted: list[Task] = []
    stop = threading.Event()

    def node() -> None:
        with DataflowClient(proc.url, retries=0, timeout_s=2) as c:
            while not stop.is_set():
                try:
                    reply = c.lease(LeaseRequest(node_id="n1", capacity=4, workflows=["rlvr"]))
                    for t in granted("n1", reply):
                        submit(c, t)
                        accepted.append(t)  # only after the reply: acknowledged
                except AstraflowError:
                    return  # the service died under us

    thread = threading.Thread(target=node)
    thread.start()
    time.sleep(1.0)
    proc.kill()
    stop.set()
    thread.join(10)
    assert len(accepted) >= 4
    proc = dataflow_process(config)
    with DataflowClient(proc.url) as c:
        assert all(submit(c, t) for t in accepted)  # every acknowledged submit is there
        report = c.report()
        assert report.tasks.done >= len(accepted)
        assert report.policies["solver"].buffered_samples == 2 * report.tasks.done
