"""The dataflow service over real HTTP on loopback: the node and trainer round trips."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from astraflow.dataflow.client import AsyncDataflowClient, DataflowClient
from astraflow.errors import LeaseForbiddenError, NotFoundError, ServiceUnavailableError
from astraflow.raas.submits import SubmitCoalescer
from astraflow.records import (
    AckRequest,
    HandBackRequest,
    LeaseRequest,
    PolicyVersion,
    RenewRequest,
    SubmitRequest,
    TakeBatchRequest,
    Task,
    WatchVersionsRequest,
)
from fixtures.dataflow import granted, make_config, make_group, ref_of, secret_of

Factory = Callable[..., str]


def lease(c: DataflowClient, node: str = "n1", capacity: int = 2, **kw: Any) -> list[Task]:
    return granted(
        node, c.lease(LeaseRequest(node_id=node, capacity=capacity, workflows=["rlvr"], **kw))
    )


def submit(c: DataflowClient, task: Task, node: str = "n1", **kw: Any) -> Any:
    samples = make_group(task, **kw)
    return c.submit(
        SubmitRequest(
            node_id=node,
            task_id=task.task_id,
            attempt=task.attempt,
            samples=samples,
            secret=secret_of(node, task),
        )
    )


def take(c: DataflowClient, version: int = 0, timeout_s: float = 0.0, **kw: Any) -> Any:
    kw.setdefault("min_samples", 2)
    req = TakeBatchRequest(policy="solver", trainer_version=version, timeout_s=timeout_s, **kw)
    return c.take_batch(req)


def test_lease_submit_take_ack_round_trip(dataflow_server: str) -> None:
    with DataflowClient(dataflow_server) as c:
        assert c.health()["status"] == "ok"
        tasks = lease(c)
        assert len(tasks) == 2
        reply = submit(c, tasks[0], rewards=(0.25, 0.75))
        assert reply.accepted and reply.kept == {"solver": 2}
        batch = take(c)
        assert batch is not None and batch.num_groups == 1
        assert [s.reward for s in batch.samples] == [0.25, 0.75]
        assert batch.samples[0].token_ids.dtype.name == "int32"
        c.ack(AckRequest(batch_id=batch.batch_id))
        assert take(c) is None  # 204: nothing left
        report = c.report()
        assert report.policies["solver"].acked_samples == 2
        assert report.trainers["trainer"].batches == 1
        assert report.nodes["n1"].completed == 1


def test_lease_expiry_requeues_over_http(tmp_path: Path, dataflow_factory: Factory) -> None:
    url = dataflow_factory(make_config(tmp_path / "df", lease={"ttl_s": 0.4}))
    with DataflowClient(url) as c:
        (task,) = lease(c, capacity=1)
        time.sleep(0.3)
        ref = ref_of("n1", task)
        assert c.renew(RenewRequest(node_id="n1", leases=[ref])).lost == []
        time.sleep(0.3)  # renewed: still live
        assert lease(c, node="n2", capacity=1)[0].task_id != task.task_id
        time.sleep(0.8)  # the node vanished: its leases expire (the sweeper runs unasked)
        assert c.report().tasks.pending >= 1
        retried = [t for t in lease(c, node="n3", capacity=4) if t.task_id == task.task_id]
        assert retried and retried[0].attempt == 1
        with pytest.raises(LeaseForbiddenError):
            submit(c, retried[0], node="n1")  # not n1's lease: n1 has no secret for it
        assert submit(c, task, node="n1").accepted  # superseded, but nobody completed it
        assert c.report().nodes["n1"].lease_expiries == 1


def test_duplicate_submit_over_http(dataflow_server: str) -> None:
    with DataflowClient(dataflow_server) as c:
        (task,) = lease(c, capacity=1)
        assert submit(c, task).accepted
        dup = submit(c, task)
        assert dup.duplicate and not dup.accepted
        assert c.report().policies["solver"].buffered_samples == 2


def test_unacked_batch_is_served_again(tmp_path: Path, dataflow_factory: Factory) -> None:
    config = make_config(
        tmp_path / "df", policies={"solver": {"vocab_size": 64, "ack_timeout_s": 0.3}}
    )
    with DataflowClient(dataflow_factory(config)) as c:
        (task,) = lease(c, capacity=1)
        submit(c, task)
        first = take(c)
        assert first is not None and first.ack_deadline_s == 0.3
        again = take(c, timeout_s=5.0)  # long-poll: woken when the batch expires
        assert again is not None and again.batch_id != first.batch_id
        assert [s.task_id for s in again.samples] == [s.task_id for s in first.samples]
        c.ack(AckRequest(batch_id=again.batch_id))
        assert take(c, timeout_s=0.5) is None  # acked: never again


def test_staleness_bound_and_admission(dataflow_server: str) -> None:
    with DataflowClient(dataflow_server) as c:
        old, new = lease(c, capacity=2)
        submit(c, old, version=0)
        submit(c, new, version=2)
        c.announce(PolicyVersion(policy="solver", version=3, manifest="solver/v3/manifest.json"))
        batch = take(c, version=3, max_samples=8)
        assert batch is not None
        assert all(s.staleness(3) <= 1 for s in batch.samples)
        assert {s.task_id for s in batch.samples} == {new.task_id}
        assert c.report().policies["solver"].stale_dropped_samples == 2
        reply = c.lease(
            LeaseRequest(node_id="n1", capacity=2, workflows=["rlvr"], versions={"solver": 1})
        )
        assert reply.tasks == [] and "refresh" in reply.reason and "solver" in reply.refresh
        assert c.versions()["solver"].version == 3


def test_backpressure_over_http(tmp_path: Path, dataflow_factory: Factory) -> None:
    config = make_config(
        tmp_path / "df", policies={"solver": {"vocab_size": 64, "max_buffered": 4}}
    )
    with DataflowClient(dataflow_factory(config)) as c:
        tasks = lease(c, capacity=8)
        assert len(tasks) == 2
        full = c.lease(LeaseRequest(node_id="n2", capacity=8, workflows=["rlvr"]))
        assert full.tasks == [] and full.reason.startswith("backpressure")
        assert full.retry_after_s > 0
        for t in tasks:
            submit(c, t)
        batch = take(c, max_samples=4)
        c.ack(AckRequest(batch_id=batch.batch_id))
        assert len(lease(c, node="n2", capacity=8)) == 2  # grows back


def test_long_poll_wakes_on_submit(dataflow_server: str) -> None:
    with DataflowClient(dataflow_server) as c:
        (task,) = lease(c, capacity=1)
        other = DataflowClient(dataflow_server)
        timer = threading.Timer(0.3, lambda: submit(other, task))
        started = time.monotonic()
        timer.start()
        batch = take(c, timeout_s=10.0)
        waited = time.monotonic() - started
        timer.join()
        other.close()
        assert batch is not None and 0.25 < waited < 5.0
        assert c.report().trainers["trainer"].waiting_fraction > 0


async def test_async_client(dataflow_server: str) -> None:
    async with AsyncDataflowClient(dataflow_server) as c:
        assert (await c.health())["status"] == "ok"
        reply = await c.lease(LeaseRequest(node_id="a1", capacity=3, workflows=["rlvr"]))
        subs = [
            c.submit(
                SubmitRequest(
                    node_id="a1",
                    task_id=t.task_id,
                    attempt=0,
                    samples=make_group(t),
                    secret=reply.secrets[t.task_id],
                )
            )
            for t in reply.tasks
        ]
        assert all(r.accepted for r in await asyncio.gather(*subs))
        batch = await c.take_batch(
            TakeBatchRequest(policy="solver", trainer_version=0, min_samples=6, max_samples=6)
        )
        assert batch is not None and batch.num_groups == 3
        await c.ack(AckRequest(batch_id=batch.batch_id))
        with pytest.raises(NotFoundError, match="unknown batch"):
            await c.ack(AckRequest(batch_id="missing"))
        assert (await c.versions()) == {}
        assert (await c.report()).policies["solver"].acked_samples == 6

        # tasks that end together submit in one /v1/submit/many; each gets its own outcome
        reply = await c.lease(LeaseRequest(node_id="a1", capacity=3, workflows=["rlvr"]))
        good, other, forged = reply.tasks

        def req(t: Task, secret: str | None = None) -> SubmitRequest:
            secret = secret or reply.secrets[t.task_id]
            return SubmitRequest(node_id="a1", task_id=t.task_id, attempt=t.attempt,
                                 samples=make_group(t), secret=secret)  # fmt: skip

        coalescer = SubmitCoalescer(c, wait_s=0.2)
        outcomes = await asyncio.gather(
            coalescer.submit(req(good)), coalescer.submit(req(other)),
            coalescer.submit(req(forged, secret="0" * 32)), return_exceptions=True,
        )  # fmt: skip
        assert coalescer.requests == 1
        assert [type(o).__name__ for o in outcomes] == ["SubmitReply", "SubmitReply",
                                                        "LeaseForbiddenError"]  # fmt: skip
        assert all(o.accepted for o in outcomes[:2])  # type: ignore[union-attr]
        again = await coalescer.submit(req(good))  # alone: a plain /v1/submit
        assert again.duplicate and coalescer.requests == 2
        assert (await c.report()).policies["solver"].buffered_samples == 4


async def test_held_submissions_go_as_soon_as_every_running_task_waits(
    dataflow_server: str,
) -> None:
    """A node's coalescer knows how many tasks still run: once all of them wait to submit,
    nothing more can join, and the request goes at once instead of after ``wait_s``."""
    async with AsyncDataflowClient(dataflow_server) as c:
        reply = await c.lease(LeaseRequest(node_id="a1", capacity=4, workflows=["rlvr"]))
        tasks = list(reply.tasks)

        def req(t: Task) -> SubmitRequest:
            secret = reply.secrets[t.task_id]
            return SubmitRequest(node_id="a1", task_id=t.task_id, attempt=t.attempt,
                                 samples=make_group(t), secret=secret)  # fmt: skip

        running = 3
        coalescer = SubmitCoalescer(c, wait_s=3600.0, running=lambda: running)
        first = [asyncio.create_task(coalescer.submit(req(t))) for t in tasks[:2]]
        for _ in range(20):  # the event loop turns over: nothing is sent while a task runs
            await asyncio.sleep(0)
        assert coalescer.requests == 0 and not any(f.done() for f in first)
        running = 2  # the third task ended without a submit (it failed): poke sends the two
        coalescer.poke()
        replies = await asyncio.wait_for(asyncio.gather(*first), 60)  # guard, not a budget
        assert coalescer.requests == 1 and all(r.accepted for r in replies)
        # all the running tasks submit together: sent with the last of them, in one request
        running = 2
        together = await asyncio.wait_for(
            asyncio.gather(*(coalescer.submit(req(t)) for t in tasks[2:])), 60
        )
        assert coalescer.requests == 2 and all(r.accepted for r in together)
        assert (await c.report()).policies["solver"].buffered_samples == 8


def test_client_gives_up_on_a_dead_service() -> None:
    c = DataflowClient("http://127.0.0.1:9", retries=1, timeout_s=0.5)
    with pytest.raises(ServiceUnavailableError, match="after 2 tries"):
        c.health()


def test_filter_plugin_through_the_server(tmp_path: Path, dataflow_factory: Factory) -> None:
    config = make_config(tmp_path / "df", filters=["dynamic_sampling"], selector="sequential")
    with DataflowClient(dataflow_factory(config)) as c:
        a, b = lease(c, capacity=2)
        assert a.task_id == "arith/q0@e0"  # sequential selector
        dropped = submit(c, a, rewards=(1.0, 1.0))
        assert dropped.accepted and dropped.kept == {}
        assert dropped.dropped["solver"].startswith("zero_variance")
        assert submit(c, b, rewards=(0.0, 1.0)).kept == {"solver": 2}
        report = c.report()
        assert report.policies["solver"].filtered_samples == 2
        assert report.policies["solver"].buffered_samples == 2
        assert report.plugins["filter.0"]["dropped"] == 1


def test_metrics_match_the_report(dataflow_server: str) -> None:
    with DataflowClient(dataflow_server) as c:
        (task,) = lease(c, capacity=1)
        submit(c, task)
        text = httpx.get(dataflow_server + "/metrics").text
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert values[("astraflow_dataflow_policy_buffered_samples", (("policy", "solver"),))] == 2
    assert values[("astraflow_dataflow_tasks", (("state", "done"),))] == 1
    assert values[("astraflow_dataflow_node_leased", (("node", "n1"),))] == 0
    assert ("astraflow_dataflow_target_nodes", ()) in values


def test_unknown_route_is_json_404(dataflow_server: str) -> None:
    r = httpx.post(dataflow_server + "/v1/nope", json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_a_trainer_that_hangs_up_mid_long_poll_is_given_no_batch(dataflow_server: str) -> None:
    # a stopping trainer abandons its long-poll: the service must not lease the next batch to it
    req = TakeBatchRequest(policy="solver", trainer_id="gone", trainer_version=0,
                           min_samples=2, timeout_s=30.0)  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):  # hangs up 0.3 s into its 30 s long-poll
        httpx.post(f"{dataflow_server}/v1/batches/take", json=req.model_dump(mode="json"),
                   timeout=httpx.Timeout(30.0, read=0.3))  # fmt: skip
    time.sleep(0.2)  # the hang-up reaches the service before the samples do
    with DataflowClient(dataflow_server) as c:
        (task,) = lease(c, capacity=1)
        submit(c, task)
        batch = take(c, timeout_s=10.0, trainer_id="next")
        assert batch is not None  # not leased to the trainer that hung up
        assert c.report().trainers["gone"].batches == 0


def test_a_stopping_trainer_hands_back_its_untrained_batches(dataflow_server: str) -> None:
    with DataflowClient(dataflow_server) as c:
        for task in lease(c, capacity=2):
            submit(c, task)
        kept = take(c, timeout_s=5.0, max_samples=2)
        given = take(c, timeout_s=5.0, max_samples=2, holding=[kept.batch_id])
        assert kept is not None and given is not None
        policy = c.report().policies["solver"]
        assert (policy.served_samples, policy.buffered_samples) == (4, 0)
        with pytest.raises(NotFoundError, match="unknown policy"):
            c.hand_back(HandBackRequest(policy="nope"))
        assert c.report().policies["solver"].served_samples == 4  # a refusal changes nothing
        reply = c.hand_back(HandBackRequest(policy="solver", holding=[kept.batch_id]))
        assert reply.batches == 1
        policy = c.report().policies["solver"]
        assert (policy.served_samples, policy.buffered_samples) == (2, 2)
        again = take(c, timeout_s=5.0, trainer_id="next", max_samples=2)
        assert again is not None  # the handed-back groups are served at once
        assert {s.group_id for s in again.samples} == {s.group_id for s in given.samples}
        c.ack(AckRequest(batch_id=kept.batch_id))  # what it held is still its own to ack


def test_a_hand_back_ends_the_trainers_waiting_take(dataflow_server: str) -> None:
    got: list[Any] = []
    with DataflowClient(dataflow_server) as c:
        waiter = threading.Thread(target=lambda: got.append(take(c, timeout_s=30.0)))
        waiter.start()
        deadline = time.monotonic() + 10
        while "trainer" not in c.report().trainers and time.monotonic() < deadline:
            time.sleep(0.02)
        c.hand_back(HandBackRequest(policy="solver"))
        waiter.join(timeout=10)  # far less than its 30 s long-poll
        assert not waiter.is_alive() and got == [None]
        for task in lease(c, capacity=1):
            submit(c, task)
        assert c.report().policies["solver"].buffered_samples == 2  # not served to the waiter


def test_a_version_watch_answers_as_a_version_is_announced(dataflow_server: str) -> None:
    def announce(c: DataflowClient, version: int) -> None:
        c.announce(PolicyVersion(policy="solver", version=version,
                                 manifest=f"solver/v{version}/manifest.json"))  # fmt: skip

    answers: list[dict[str, PolicyVersion]] = []
    with DataflowClient(dataflow_server) as c, DataflowClient(dataflow_server) as watcher:
        announce(c, 1)
        behind = c.watch_versions(WatchVersionsRequest(known={"solver": 0}, timeout_s=30.0))
        assert behind["solver"].version == 1  # a caller behind is answered at once

        def watch() -> None:
            answers.append(watcher.watch_versions(
                WatchVersionsRequest(known={"solver": 1}, timeout_s=30.0)))  # fmt: skip

        waiting = threading.Thread(target=watch)
        waiting.start()
        time.sleep(0.3)
        assert waiting.is_alive() and answers == []  # up to date: it waits
        announce(c, 2)
        waiting.join(timeout=10)  # far less than its 30 s long-poll
        assert not waiting.is_alive() and answers[0]["solver"].version == 2
        # nothing newer within the timeout: the latest versions, as GET /v1/versions
        quiet = c.watch_versions(WatchVersionsRequest(known={"solver": 2}, timeout_s=0.2))
        assert quiet == c.versions() and quiet["solver"].version == 2
        # a policy the service does not have never wakes it; no policy named: at once
        other = c.watch_versions(WatchVersionsRequest(known={"ghost": 5}, timeout_s=0.2))
        assert other["solver"].version == 2
        assert c.watch_versions(WatchVersionsRequest(timeout_s=30.0)) == quiet
