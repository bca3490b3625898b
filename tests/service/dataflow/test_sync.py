"""Sync ("trainer-centred") regulation over real HTTP: lock-step rounds of two policies."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from astraflow.dataflow.client import DataflowClient
from astraflow.records import (
    Batch,
    LeaseReply,
)
from fixtures.dataflow import DataflowProcess, make_sync_config
from fixtures.duel import POLICIES, announce, holding, lease, submit, take, train


def test_two_policies_step_in_lock_step(
    tmp_path: Path, dataflow_factory: Callable[..., str]
) -> None:
    url = dataflow_factory(make_sync_config(tmp_path / "df", round_tasks=3))
    with DataflowClient(url) as c:
        reply = lease(c)
        assert reply.tasks == [] and "sync round 0: waiting for trainers" in reply.reason
        announce(c, "solver", 0)
        reply = lease(c, **holding(0))
        assert reply.tasks == [] and "verifier" in reply.reason  # round 0 needs both
        announce(c, "verifier", 0)

        stale = lease(c, solver=0)  # holds no verifier weights: staleness-0 admission
        assert stale.tasks == [] and set(stale.refresh) == {"verifier"}
        round0 = lease(c, capacity=5, **holding(0)).tasks
        assert len(round0) == 3  # exactly one round, however much capacity is offered
        more = lease(c, node="n2", capacity=5, **holding(0))
        assert more.tasks == [] and "sync round 0: waiting for trainers" in more.reason
        report = c.report()
        assert report.mode == "sync" and report.sync is not None
        assert (report.sync.round, report.sync.state, report.sync.tasks) == (0, "open", 3)

        for t in round0[:2]:
            assert submit(c, t).kept == {"solver": 2, "verifier": 2}
        assert take(c, "solver", 0) is None  # the round's data is not complete yet
        submit(c, round0[2])
        assert c.report().sync.state == "complete"  # type: ignore[union-attr]
        ids = {t.task_id for t in round0}
        assert train(c, "solver", 0) == ids  # the whole round, as one batch (6 samples)
        assert take(c, "solver", 1) is None  # round 1 is not open: verifier is at version 0
        assert lease(c, **holding(1)).tasks == []  # nor can round-1 data be produced
        assert train(c, "verifier", 0) == ids

        report = c.report()
        assert report.sync is not None and report.sync.round == 1
        (closed,) = report.sync.history
        assert closed.round == 0 and closed.tasks == 3
        assert closed.opened_at and closed.data_complete_at and closed.closed_at
        assert closed.opened_at <= closed.data_complete_at <= closed.closed_at
        assert lease(c, **holding(0)).refresh.keys() == set(POLICIES)  # push weights to all
        round1 = lease(c, capacity=5, **holding(1)).tasks
        assert len(round1) == 3 and ids.isdisjoint(t.task_id for t in round1)

        # a trainer long-polling at version 1 wakes as soon as the round's data is complete
        got: list[Batch | None] = []
        poll = threading.Thread(target=lambda: got.append(take(c, "solver", 1, timeout_s=10)))
        poll.start()
        for t in round1:
            submit(c, t, version=1)
        poll.join(10)
        assert got and got[0] is not None and len(got[0].samples) == 6


def test_expired_lease_is_requeued_inside_the_round(
    tmp_path: Path, dataflow_factory: Callable[..., str]
) -> None:
    config = make_sync_config(tmp_path / "df", round_tasks=2, lease={"ttl_s": 0.4})
    url = dataflow_factory(config)
    with DataflowClient(url) as c:
        for p in POLICIES:
            announce(c, p, 0)
        first = lease(c, node="n1", **holding(0)).tasks
        assert len(first) == 2
        time.sleep(1.0)  # n1 vanished: its leases expire and go back to the round
        report = c.report()
        assert report.tasks.pending == 2 and report.sync is not None
        assert (report.sync.tasks, report.sync.open_tasks) == (2, 2)
        again = lease(c, node="n2", **holding(0)).tasks
        assert sorted((t.task_id, t.attempt) for t in again) == sorted(
            (t.task_id, 1) for t in first
        )  # the same tasks, next attempt; no new task beyond the round
        assert lease(c, node="n3", **holding(0)).tasks == []
        for t in again:
            submit(c, t, node="n2")
        batch = take(c, "solver", 0)
        assert batch is not None and batch.num_groups == 2


def test_restart_mid_round_after_kill_9(
    tmp_path: Path, dataflow_process: Callable[..., DataflowProcess]
) -> None:
    config = make_sync_config(tmp_path / "df", round_tasks=3)
    proc = dataflow_process(config)
    with DataflowClient(proc.url) as c:
        for p in POLICIES:
            announce(c, p, 0)
        for t in lease(c, **holding(0)).tasks:
            submit(c, t)
        for p in POLICIES:
            train(c, p, 0)
        round1 = lease(c, **holding(1)).tasks
        assert len(round1) == 3
        submit(c, round1[0], version=1)
    proc.kill()

    proc = dataflow_process(config)
    with DataflowClient(proc.url) as c:
        report = c.report()
        assert report.sync is not None
        assert (report.sync.round, report.sync.state) == (1, "open")
        assert (report.sync.tasks, report.sync.open_tasks) == (3, 2)
        assert [h.round for h in report.sync.history] == [0]
        blocked = lease(c, node="n2", **holding(1))  # the round's quota survived
        assert blocked.tasks == [] and "sync round 1: waiting for trainers" in blocked.reason
        assert take(c, "solver", 1) is None
        for t in round1[1:]:  # the leases survived too
            assert submit(c, t, version=1).accepted
        for p in POLICIES:
            assert train(c, p, 1) == {t.task_id for t in round1}
        assert c.report().sync.round == 2  # type: ignore[union-attr]


def test_a_lease_the_round_leaves_empty_is_held_until_the_round_changes(
    tmp_path: Path, dataflow_factory: Callable[..., str]
) -> None:
    regulation = {"mode": "sync", "sync_round_tasks": 2, "sync_lease_hold_s": 5.0}
    config = make_sync_config(tmp_path / "df", regulation=regulation, lease={"ttl_s": 0.5})
    url = dataflow_factory(config)
    replies: list[LeaseReply] = []

    def held_lease(node: str) -> threading.Thread:
        def run() -> None:
            with DataflowClient(url) as c:
                replies.append(lease(c, node=node, **holding(0)))

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    with DataflowClient(url) as c:
        announce(c, "solver", 0)
        waiting = held_lease("n1")  # round 0 is not open yet: held, not answered empty
        time.sleep(0.3)
        assert not replies
        announce(c, "verifier", 0)  # the round opens: the held lease gets its tasks
        waiting.join(10)
        (first,) = replies
        assert len(first.tasks) == 2
        # all round tasks are out: n2 is held until n1's leases expire and are re-queued
        held_lease("n2").join(10)
        second = replies[1]
        assert sorted((t.task_id, t.attempt) for t in second.tasks) == sorted(
            (t.task_id, 1) for t in first.tasks
        )
