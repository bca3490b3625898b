"""Leases are bound to their holder: another node with the same node token (and the holder's
public node id) cannot fail, release, renew or submit them; a never-granted attempt is 404."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from astraflow.dataflow.client import DataflowClient
from astraflow.errors import LeaseForbiddenError, NotFoundError
from astraflow.records import (
    FailRequest,
    LeaseRef,
    LeaseRequest,
    ReleaseRequest,
    RenewRequest,
    SubmitRequest,
    Task,
)
from fixtures.dataflow import NO_SECRET, make_config, make_group, state_snapshot

TOKEN = "node-token"
HEADERS = {"authorization": f"Bearer {TOKEN}"}


class Nodes:
    """Node A holds a lease; node B shares the node token and knows A's id (the report)."""

    def __init__(self, url: str, db: Path) -> None:
        self.url, self.db = url, db
        self.client = DataflowClient(url, token=TOKEN, retries=0)
        reply = self.client.lease(LeaseRequest(node_id="a", capacity=1, workflows=["rlvr"]))
        (self.task,) = reply.tasks
        self.secret = reply.secrets[self.task.task_id]
        other = self.client.lease(LeaseRequest(node_id="b", capacity=1, workflows=["rlvr"]))
        (self.b_task,) = other.tasks
        self.b_secret = other.secrets[self.b_task.task_id]  # a real secret, for another task

    def snapshot(self) -> dict[str, Any]:
        return state_snapshot(self.db, self.url, HEADERS)

    def submit(self, task: Task, node: str, secret: str) -> Any:
        return self.client.submit(SubmitRequest(
            node_id=node, task_id=task.task_id, attempt=task.attempt, secret=secret,
            samples=make_group(task),
        ))  # fmt: skip


@pytest.fixture
def nodes(tmp_path: Path, dataflow_factory: Callable[..., str]) -> Iterator[Nodes]:
    config = make_config(tmp_path / "df", auth={"node": TOKEN})
    env = Nodes(dataflow_factory(config), config.db_path)
    yield env
    env.client.close()


def forged_secrets(n: Nodes) -> list[tuple[str, str]]:
    """(node id, secret) pairs node B can try on A's lease."""
    return [("a", NO_SECRET), ("a", n.b_secret), ("b", n.b_secret), ("b", NO_SECRET)]


def test_another_node_cannot_fail_release_renew_or_submit_a_lease(nodes: Nodes) -> None:
    n, task = nodes, nodes.task
    before = n.snapshot()
    for node, secret in forged_secrets(n):
        fail = FailRequest(node_id=node, task_id=task.task_id, attempt=0, secret=secret,
                           error="sabotage", retryable=False)  # fmt: skip
        with pytest.raises(LeaseForbiddenError):
            n.client.fail(fail)
        ref = LeaseRef(task_id=task.task_id, attempt=0, secret=secret)
        assert n.client.release(ReleaseRequest(node_id=node, leases=[ref])).requeued == 0
        assert n.client.renew(RenewRequest(node_id=node, leases=[ref])).lost == [ref]
        with pytest.raises(LeaseForbiddenError):
            n.submit(task, node, secret)
        assert n.snapshot() == before, (node, secret)
    # the holder's lease is intact: it renews, then submits and completes the task
    ref = LeaseRef(task_id=task.task_id, attempt=0, secret=n.secret)
    assert n.client.renew(RenewRequest(node_id="a", leases=[ref])).lost == []
    assert n.submit(task, "a", n.secret).accepted
    assert n.client.report().tasks.done == 1


def test_forged_fail_is_refused_over_raw_http(nodes: Nodes) -> None:
    """The probe's attack: a fail naming the holder's node id, without its secret."""
    body = {"node_id": "a", "task_id": nodes.task.task_id, "attempt": 0, "error": "x",
            "retryable": False, "secret": NO_SECRET}  # fmt: skip
    before = nodes.snapshot()
    r = httpx.post(nodes.url + "/v1/fail", headers=HEADERS, content=json.dumps(body))
    assert r.status_code == 403 and r.json()["error"]["code"] == "lease_forbidden"
    missing = {k: v for k, v in body.items() if k != "secret"}
    r = httpx.post(nodes.url + "/v1/fail", headers=HEADERS, content=json.dumps(missing))
    assert r.status_code == 400 and "secret" in r.json()["error"]["message"]
    assert nodes.snapshot() == before


def test_submit_for_a_never_granted_attempt_is_404(nodes: Nodes) -> None:
    n, task = nodes, nodes.task
    ref = LeaseRef(task_id=task.task_id, attempt=0, secret=n.secret)
    assert n.client.release(ReleaseRequest(node_id="a", leases=[ref])).requeued == 1
    before = n.snapshot()  # the task is pending as attempt 1: nobody was granted it
    nxt = task.model_copy(update={"attempt": 1})
    for node, secret in [("a", n.secret), ("b", n.b_secret), ("a", NO_SECRET)]:
        with pytest.raises(NotFoundError, match="attempt 1 was never granted"):
            n.submit(nxt, node, secret)
    with pytest.raises(NotFoundError, match="attempt 7 was never granted"):
        n.submit(task.model_copy(update={"attempt": 7}), "a", n.secret)
    assert n.snapshot() == before
    # once granted, attempt 1 is its holder's to submit
    reply = n.client.lease(LeaseRequest(node_id="b", capacity=4, workflows=["rlvr"]))
    granted = {t.task_id: t for t in reply.tasks}
    assert granted[task.task_id].attempt == 1
    assert n.submit(nxt, "b", reply.secrets[task.task_id]).accepted
