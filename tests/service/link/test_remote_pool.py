"""A remote pool behind a 300 ms WAN link never blocks the trainer: the trainer takes and acks
batches of the local pool's samples while the remote pool's leases are still in flight across
the link, and the remote samples, once they arrive, are served in a later batch. (The trainer's
waiting with and without remote pools is measured by ``benchmarks/cross_region.py``.)"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from astraflow.dataflow.client import DataflowClient
from astraflow.link import Link, LinkConfig
from astraflow.records import AckRequest, LeaseRequest, SubmitRequest, TakeBatchRequest, Task
from fixtures.dataflow import granted, make_config, make_group, secret_of


def _lease(c: DataflowClient, node: str, pool: str, capacity: int) -> list[Task]:
    request = LeaseRequest(node_id=node, pool=pool, capacity=capacity, workflows=["rlvr"])
    return granted(node, c.lease(request))


def _submit(c: DataflowClient, node: str, task: Task) -> Any:
    return c.submit(
        SubmitRequest(node_id=node, task_id=task.task_id, attempt=task.attempt,
                      samples=make_group(task), secret=secret_of(node, task))
    )  # fmt: skip


def _take(c: DataflowClient) -> Any:
    request = TakeBatchRequest(policy="solver", trainer_version=0, min_samples=2, max_samples=2,
                               timeout_s=5.0)  # fmt: skip
    return c.take_batch(request)


def test_a_remote_pool_behind_a_300ms_link_never_blocks_the_trainer(
    tmp_path: Path, dataflow_factory: Callable[..., str]
) -> None:
    url = dataflow_factory(make_config(tmp_path / "df"))
    link = Link.for_urls(LinkConfig(delay_ms=150), {"dataflow": url})
    with link, DataflowClient(url) as near, DataflowClient(link.url("dataflow")) as far:
        started = time.monotonic()
        remote = _lease(far, "far-1", "remote", 2)  # in flight across the WAN from now on
        assert len(remote) == 2 and time.monotonic() - started >= 0.3  # it did cross the link
        served = []
        for _ in range(3):
            task = _lease(near, "near-1", "local", 1)[0]
            assert _submit(near, "near-1", task).accepted
            batch = _take(near)  # served at once: nothing waits for the remote pool
            assert batch is not None
            served.append({s.task_id for s in batch.samples})
            near.ack(AckRequest(batch_id=batch.batch_id))
            assert near.report().pools["remote"].leased == 2  # still out there
        assert all(ids.isdisjoint(t.task_id for t in remote) for ids in served)
        for task in remote:  # the remote samples arrive, 300 ms each way, and are kept
            assert _submit(far, "far-1", task).accepted
        late = set()
        for _ in range(2):
            batch = _take(near)
            assert batch is not None
            late |= {s.task_id for s in batch.samples}
            near.ack(AckRequest(batch_id=batch.batch_id))
        assert late == {t.task_id for t in remote}
        assert sum(link.stats.up.values()) > 0 and link.stats.connections["dataflow"] >= 1
