"""Sync-mode round rules without HTTP: top-ups, dry sources, failures, carry-over, config."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError as PydanticError

from astraflow.dataflow.service import DataflowService
from astraflow.errors import ValidationError
from astraflow.records import (
    Batch,
    FailRequest,
    LeaseRequest,
    PolicyVersion,
    SubmitRequest,
    TakeBatchRequest,
    Task,
    unpack,
)
from fixtures.dataflow import make_config, make_group

SYNC = {"mode": "sync", "sync_round_tasks": 2}


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


_OPEN: list[DataflowService] = []


@pytest.fixture(autouse=True)
def _close_services() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def service(tmp_path: Path, clock: Clock | None = None, **overrides: Any) -> DataflowService:
    overrides.setdefault("regulation", SYNC)
    svc = DataflowService(make_config(tmp_path / "run", **overrides), clock=clock or Clock())
    _OPEN.append(svc)
    return svc


def announce(svc: DataflowService, version: int) -> None:
    svc.announce(PolicyVersion(policy="solver", version=version, manifest=f"v{version}"))


def lease(svc: DataflowService, capacity: int = 8, version: int = 0) -> list[Task]:
    req = LeaseRequest(
        node_id="n1", capacity=capacity, workflows=["rlvr"], versions={"solver": version}
    )
    return svc.lease(req).tasks


def submit(svc: DataflowService, task: Task, rewards: tuple[float, ...] = (0.0, 1.0)) -> None:
    samples = make_group(task, rewards=rewards)
    svc.submit(
        SubmitRequest(
            node_id="n1",
            task_id=task.task_id,
            attempt=task.attempt,
            samples=samples,
            secret=svc.queue.secret("n1", task.task_id, task.attempt),
        )
    )


def take(svc: DataflowService, version: int = 0, max_samples: int = 256) -> Batch | None:
    req = TakeBatchRequest(policy="solver", trainer_version=version, max_samples=max_samples)
    got = svc.take_batch(req)
    return None if got is None else unpack(Batch, got[1])


def sync_state(svc: DataflowService) -> tuple[int, str, int, int]:
    r = svc.report().sync
    assert r is not None
    return r.round, r.state, r.quota, r.tasks


def test_a_round_emptied_by_the_filters_leases_more_tasks(tmp_path: Path) -> None:
    svc = service(tmp_path, filters=["dynamic_sampling"])
    announce(svc, 0)
    first = lease(svc)
    assert len(first) == 2
    for t in first:
        submit(svc, t, rewards=(1.0, 1.0))  # zero variance: dropped by the filter
    assert sync_state(svc) == (0, "open", 4, 2)  # topped up by one more round of tasks
    assert take(svc) is None
    second = lease(svc)
    assert len(second) == 2
    submit(svc, second[0], rewards=(1.0, 1.0))
    submit(svc, second[1], rewards=(0.0, 1.0))
    batch = take(svc)
    assert batch is not None and {s.task_id for s in batch.samples} == {second[1].task_id}
    report = svc.report()
    assert report.sync is not None and report.sync.current.topups == 1
    assert report.sync.state == "complete"


def test_a_top_up_leases_only_for_the_policies_left_without_data(tmp_path: Path) -> None:
    # two policies, a source each; the filters empty the verifier's groups of the round
    base = make_config(tmp_path / "x").sources[0]
    sources = [base.model_copy(update={"name": f"src-{p}", "policies": [p]})
               for p in ("solver", "verifier")]  # fmt: skip
    policy = {"vocab_size": 64, "max_staleness": 1, "max_buffered": 256}
    svc = service(tmp_path, sources=sources, filters=["dynamic_sampling"],
                  policies={"solver": policy, "verifier": policy},
                  regulation={**SYNC, "sync_round_tasks": 4})  # fmt: skip
    for p in ("solver", "verifier"):
        svc.announce(PolicyVersion(policy=p, version=0, manifest="v0"))
    versions = {"solver": 0, "verifier": 0}

    def lease_all() -> list[Task]:
        req = LeaseRequest(node_id="n1", capacity=16, workflows=["rlvr"], versions=versions)
        return svc.lease(req).tasks

    first = lease_all()
    assert {t.source for t in first} == {"src-solver", "src-verifier"}
    for t in first:
        policy_of = "solver" if t.source == "src-solver" else "verifier"
        rewards = (0.0, 1.0) if policy_of == "solver" else (1.0, 1.0)  # verifier's: dropped
        secret = svc.queue.secret("n1", t.task_id, t.attempt)
        samples = make_group(t, rewards=rewards, policy=policy_of)
        svc.submit(SubmitRequest(node_id="n1", task_id=t.task_id, attempt=t.attempt,
                                 secret=secret, samples=samples))  # fmt: skip
    assert sync_state(svc)[1:3] == ("open", 8)  # topped up
    more = lease_all()
    assert more and {t.source for t in more} == {"src-verifier"}  # not the solver's source


def test_a_round_completes_short_when_the_sources_run_dry(tmp_path: Path) -> None:
    source = make_config(tmp_path / "x").sources[0].model_copy(update={"epochs": 1})
    svc = service(tmp_path, sources=[source], regulation={**SYNC, "sync_round_tasks": 15})
    announce(svc, 0)
    round0 = lease(svc, capacity=20)
    assert len(round0) == 15
    for t in round0:
        submit(svc, t)
    assert take(svc) is not None
    announce(svc, 1)
    round1 = lease(svc, capacity=20, version=1)
    assert len(round1) == 5  # the 20 rows are used up
    for t in round1:
        submit(svc, t)
    assert sync_state(svc) == (1, "complete", 15, 5)
    batch = take(svc, version=1)
    assert batch is not None and batch.num_groups == 5


def test_failures_stay_in_the_round_until_final(tmp_path: Path) -> None:
    svc = service(tmp_path, lease={"ttl_s": 30.0, "max_attempts": 2})
    announce(svc, 0)
    a, b = lease(svc)
    secret = svc.queue.secret("n1", a.task_id, 0)
    reply = svc.fail(FailRequest(node_id="n1", task_id=a.task_id, attempt=0, error="boom",
                                 secret=secret))  # fmt: skip
    assert reply.requeued
    (retry,) = lease(svc)
    assert (retry.task_id, retry.attempt) == (a.task_id, 1)  # re-queued inside the round
    assert lease(svc) == []
    submit(svc, b)
    assert take(svc) is None  # a is still open
    secret = svc.queue.secret("n1", a.task_id, 1)
    reply = svc.fail(FailRequest(node_id="n1", task_id=a.task_id, attempt=1, error="boom",
                                 secret=secret))  # fmt: skip
    assert reply.failed  # failed for good: counts as done for the round
    batch = take(svc)
    assert batch is not None and {s.task_id for s in batch.samples} == {b.task_id}


def test_round_batch_larger_than_max_samples_is_refused_unchanged(tmp_path: Path) -> None:
    svc = service(tmp_path)
    announce(svc, 0)
    for t in lease(svc):
        submit(svc, t)
    with pytest.raises(ValidationError, match="max_samples") as err:
        take(svc, max_samples=3)
    assert err.value.field == "max_samples"
    assert svc.report().policies["solver"].buffered_samples == 4  # nothing was served
    batch = take(svc, max_samples=4)
    assert batch is not None and len(batch.samples) == 4


def test_a_round_closed_early_carries_its_open_tasks_over(tmp_path: Path) -> None:
    svc = service(tmp_path, regulation={**SYNC, "sync_round_tasks": 3})
    announce(svc, 0)
    done, *carried = lease(svc)
    submit(svc, done)
    announce(svc, 1)  # the trainer moved on without the round's batch
    assert sync_state(svc) == (1, "open", 3, 2)
    (new,) = lease(svc, version=1)  # only one new task: the two carried ones count
    for t in [new, *carried]:
        submit(svc, t)
    batch = take(svc, version=1)
    assert batch is not None
    assert {s.task_id for s in batch.samples} == {new.task_id} | {t.task_id for t in carried}
    assert svc.report().policies["solver"].stale_dropped_samples == 2  # round 0's group
    history = svc.report().sync.history  # type: ignore[union-attr]
    assert [(h.round, h.tasks, h.data_complete_at) for h in history] == [(0, 3, None)]


def test_round_state_is_reloaded_from_the_run_directory(tmp_path: Path) -> None:
    clock = Clock()
    svc = service(tmp_path, clock)
    announce(svc, 0)
    a, b = lease(svc)
    submit(svc, a)
    clock.t += 5
    before = svc.report().sync
    svc.close()
    _OPEN.remove(svc)
    svc = service(tmp_path, clock)
    assert svc.report().sync == before
    assert lease(svc) == []
    submit(svc, b)
    assert take(svc) is not None


def test_sync_config_is_checked(tmp_path: Path) -> None:
    with pytest.raises(PydanticError, match="sync_round_tasks"):
        make_config(tmp_path / "a", regulation={"mode": "sync"})
    policies = {"solver": {"vocab_size": 64}, "judge": {"vocab_size": 64}}
    with pytest.raises(PydanticError, match="judge"):
        make_config(tmp_path / "b", policies=policies, regulation=SYNC)


def test_each_source_leases_its_share_of_a_round_whichever_node_asks_first(
    tmp_path: Path,
) -> None:
    # two policies, a source each (weights 3 : 1), rounds of 8 tasks: shares 6 and 2
    base = make_config(tmp_path / "x").sources[0]
    solver = {"name": "src-solver", "policies": ["solver"], "weight": 3.0}
    verifier = {"name": "src-verifier", "policies": ["verifier"]}
    sources = [base.model_copy(update=solver), base.model_copy(update=verifier)]
    policy = {"vocab_size": 64, "max_staleness": 1, "max_buffered": 256}
    svc = service(tmp_path, sources=sources, policies={"solver": policy, "verifier": policy},
                  regulation={**SYNC, "sync_round_tasks": 8})  # fmt: skip
    for p in ("solver", "verifier"):
        svc.announce(PolicyVersion(policy=p, version=0, manifest="v0"))

    def lease_as(node: str, versions: dict[str, int]) -> list[Task]:
        req = LeaseRequest(node_id=node, capacity=16, workflows=["rlvr"], versions=versions)
        return svc.lease(req).tasks

    # a node holding only the solver's weights asks first: it gets the solver's share only
    first = lease_as("n1", {"solver": 0})
    assert [t.source for t in first] == ["src-solver"] * 6
    assert lease_as("n1", {"solver": 0}) == []
    rest = lease_as("n2", {"solver": 0, "verifier": 0})
    assert [t.source for t in rest] == ["src-verifier"] * 2
    assert sync_state(svc) == (0, "open", 8, 8)
