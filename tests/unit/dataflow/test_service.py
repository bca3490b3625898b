"""DataflowService rules without HTTP: leases, submits, batches, regulation, restart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from astraflow.dataflow.metrics import metrics_text
from astraflow.dataflow.service import DataflowService
from astraflow.errors import ConflictError, LeaseLostError, NotFoundError, ValidationError
from astraflow.records import (
    AckRequest,
    Batch,
    FailRequest,
    LeaseRef,
    LeaseRequest,
    PolicyVersion,
    ReleaseRequest,
    RenewRequest,
    SubmitRequest,
    TakeBatchRequest,
    Task,
    unpack,
)
from fixtures.dataflow import make_config, make_group


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def clock() -> Clock:
    return Clock()


_OPEN: list[DataflowService] = []


@pytest.fixture(autouse=True)
def _close_services() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def service(tmp_path: Path, clock: Clock, **overrides: Any) -> DataflowService:
    svc = DataflowService(make_config(tmp_path / "run", **overrides), clock=clock)
    _OPEN.append(svc)
    return svc


def lease(svc: DataflowService, node: str = "n1", capacity: int = 2, **kw: Any) -> list[Task]:
    req = LeaseRequest(node_id=node, capacity=capacity, workflows=["rlvr"], **kw)
    return svc.lease(req).tasks


def submit(svc: DataflowService, task: Task, node: str = "n1", **kw: Any) -> Any:
    req = SubmitRequest(
        node_id=node, task_id=task.task_id, attempt=task.attempt,
        secret=svc.queue.secret(node, task.task_id, task.attempt), samples=make_group(task, **kw),
    )  # fmt: skip
    reply = svc.submit(req)
    check_sizes(svc)
    return reply


def ref_of(svc: DataflowService, node: str, task: Task) -> LeaseRef:
    """The lease ref ``node`` holds for ``task`` (its secret computed by the service)."""
    secret = svc.queue.secret(node, task.task_id, task.attempt)
    return LeaseRef(task_id=task.task_id, attempt=task.attempt, secret=secret)


def take(svc: DataflowService, version: int = 0, **kw: Any) -> Batch | None:
    kw.setdefault("min_samples", 2)
    got = svc.take_batch(TakeBatchRequest(policy="solver", trainer_version=version, **kw))
    check_sizes(svc)
    return None if got is None else unpack(Batch, got[1])


def check_sizes(svc: DataflowService) -> None:
    """The buffers' running counts equal a recount of their groups."""
    for policy, live in svc.buffers.live.items():
        buffered = [g.num_samples for g in live.values() if g.state == "buffered"]
        served = sum(g.num_samples for g in live.values() if g.state == "served")
        assert svc.buffers.samples(policy) == (sum(buffered), len(buffered), served)


def test_round_trip_lease_submit_take_ack(tmp_path: Path, clock: Clock) -> None:
    svc = service(tmp_path, clock)
    tasks = lease(svc, capacity=2)
    assert len(tasks) == 2 and all(t.workflow == "rlvr" and t.group_size == 2 for t in tasks)
    assert tasks[0].task_id.startswith("arith/q") and tasks[0].task_id.endswith("@e0")
    assert tasks[0].meta["row_id"] == tasks[0].task_id.split("/")[1].split("@")[0]
    reply = submit(svc, tasks[0])
    assert reply.accepted and reply.kept == {"solver": 2}
    batch = take(svc)
    assert batch is not None and len(batch.samples) == 2 and batch.trainer_version == 0
    assert {s.task_id for s in batch.samples} == {tasks[0].task_id}
    assert take(svc, trainer_id="other") is None  # served, not acked: not served twice
    svc.ack(AckRequest(batch_id=batch.batch_id))
    svc.ack(AckRequest(batch_id=batch.batch_id))  # idempotent
    with pytest.raises(NotFoundError):
        svc.ack(AckRequest(batch_id="nope"))
    counts = svc.report().tasks
    assert (counts.done, counts.leased) == (1, 1)


def test_expired_lease_requeues_with_next_attempt(tmp_path: Path, clock: Clock) -> None:
    svc = service(tmp_path, clock, lease={"ttl_s": 10.0})
    (task,) = lease(svc, capacity=1)
    clock.advance(5)
    ref = ref_of(svc, "n1", task)
    renew = svc.renew(RenewRequest(node_id="n1", leases=[ref]))
    assert renew.lost == []
    clock.advance(9)  # renewed at +5: still live at +14
    svc.sweep(force=True)
    assert svc.report().tasks.pending == 0
    clock.advance(2)
    svc.sweep(force=True)
    assert svc.report().tasks.pending == 1
    report = svc.report()
    assert report.nodes["n1"].lease_expiries == 1
    assert report.pools["default"].nodes == 0  # an expiry is not a sign of life
    assert report.target.current_nodes == 0
    lost = svc.renew(RenewRequest(node_id="n1", leases=[ref]))
    assert lost.lost == [ref]
    (again,) = lease(svc, node="n2", capacity=1)
    assert (again.task_id, again.attempt) == (task.task_id, 1)


def test_superseded_attempt_is_accepted_until_someone_completes(
    tmp_path: Path, clock: Clock
) -> None:
    svc = service(tmp_path, clock, lease={"ttl_s": 10.0})
    (task,) = lease(svc, capacity=1)
    clock.advance(11)
    (again,) = lease(svc, node="n2", capacity=1)
    assert again.attempt == 1
    with pytest.raises(NotFoundError, match="attempt 5 was never granted"):
        submit(svc, again.model_copy(update={"attempt": 5}), node="n2")
    # the slow first node finishes: nobody has completed the task, so its work counts
    assert submit(svc, task).accepted
    with pytest.raises(LeaseLostError, match="already done"):
        submit(svc, again, node="n2")
    lost = svc.renew(RenewRequest(node_id="n2", leases=[ref_of(svc, "n2", again)]))
    assert len(lost.lost) == 1


def test_duplicate_submit_is_accepted_once(tmp_path: Path, clock: Clock) -> None:
    svc = service(tmp_path, clock)
    (task,) = lease(svc, capacity=1)
    first = submit(svc, task)
    second = submit(svc, task)
    assert first.accepted and not first.duplicate
    assert not second.accepted and second.duplicate and second.kept == first.kept
    assert svc.report().policies["solver"].buffered_samples == 2


def test_submit_leased_to_another_node_is_refused(tmp_path: Path, clock: Clock) -> None:
    svc = service(tmp_path, clock)
    (task,) = lease(svc, capacity=1)
    with pytest.raises(LeaseLostError, match="leased to node 'n1'"):
        submit(svc, task, node="intruder")
    with pytest.raises(NotFoundError, match="unknown task"):
        submit(svc, task.model_copy(update={"task_id": "arith/zzz@e0"}))


def test_fail_requeues_then_fails_at_max_attempts(tmp_path: Path, clock: Clock) -> None:
    svc = service(tmp_path, clock, lease={"max_attempts": 2})
    (task,) = lease(svc, capacity=1)
    fail = FailRequest(node_id="n1", task_id=task.task_id, attempt=0, error="boom",
                       secret=ref_of(svc, "n1", task).secret)  # fmt: skip
    assert svc.fail(fail).requeued
    with pytest.raises(LeaseLostError):
        svc.fail(fail)  # that attempt is gone
    (again,) = lease(svc, capacity=1)
    assert again.attempt == 1
    reply = svc.fail(
        fail.model_copy(update={"attempt": 1, "secret": ref_of(svc, "n1", again).secret})
    )
    assert reply.failed and not reply.requeued
    assert svc.report().tasks.failed == 1
    (other,) = lease(svc, capacity=1)
    no_retry = FailRequest(node_id="n1", task_id=other.task_id, attempt=0, error="x",
                           retryable=False, secret=ref_of(svc, "n1", other).secret)  # fmt: skip
    assert svc.fail(no_retry).failed


def test_release_requeues_at_once(tmp_path: Path, clock: Clock) -> None:
    svc = service(tmp_path, clock)
    tasks = lease(svc, capacity=2)
    refs = [ref_of(svc, "n1", t) for t in tasks]
    other = ReleaseRequest(node_id="n2", leases=refs)
    assert svc.release(other).requeued == 0  # not its leases
    assert svc.release(ReleaseRequest(node_id="n1", leases=refs)).requeued == 2
    again = lease(svc, node="n2", capacity=2)
    assert {(t.task_id, t.attempt) for t in again} == {(t.task_id, 1) for t in tasks}


def test_a_node_back_as_a_new_process_has_its_old_leases_requeued(
    tmp_path: Path, clock: Clock
) -> None:
    svc = service(tmp_path, clock)
    first = lease(svc, capacity=2, incarnation="a")
    first += lease(svc, capacity=1, incarnation="a")  # the same process: it keeps the first two
    assert svc.queue.held("n1") == 3
    lease(svc, node="n2", capacity=1, incarnation="x")
    svc.close()
    svc = service(tmp_path, clock)  # the service restarts too (a resumed run)
    assert svc.queue.held("n1") == 3  # reloaded: held until their deadline, or until told
    again = lease(svc, capacity=2, incarnation="b")  # n1 crashed and came back
    assert svc.queue.held("n1") == len(again) == 2  # the old 3 went back to the queue
    assert {(t.task_id, t.attempt) for t in again} < {(t.task_id, 1) for t in first}
    assert svc.queue.held("n2") == 1  # other nodes keep theirs
    again += lease(svc, capacity=1)  # naming no incarnation (an older node) changes nothing
    again += lease(svc, capacity=1, incarnation="b")
    assert svc.queue.held("n1") == 4
    # while "b" is heard from, another incarnation under its id (a node id is public: a
    # spoofer, or a twin) takes nothing away; once "b" has been quiet half a TTL, it does
    lease(svc, capacity=0, incarnation="spoof")
    ttl = svc.config.lease.ttl_s
    clock.advance(ttl / 4)
    svc.renew(RenewRequest(node_id="n1", leases=[ref_of(svc, "n1", t) for t in again]))
    clock.advance(ttl / 4)
    lease(svc, capacity=0, incarnation="spoof")
    assert svc.queue.held("n1") == 4
    clock.advance(ttl / 2)
    lease(svc, capacity=0, incarnation="c")
    assert svc.queue.held("n1") == 0


def test_epochs_and_exhaustion(tmp_path: Path, clock: Clock) -> None:
    svc = service(tmp_path, clock, policies={"solver": {"vocab_size": 64, "max_buffered": 10_000}})
    seen: list[str] = []
    while tasks := lease(svc, capacity=8):
        for t in tasks:
            submit(svc, t)
        seen += [t.task_id for t in tasks]
    assert len(seen) == len(set(seen)) == 40  # 20 rows x 2 epochs, each id once
    assert sum(s.endswith("@e1") for s in seen) == 20
    reply = svc.lease(LeaseRequest(node_id="n1", capacity=1, workflows=["rlvr"]))
    assert reply.reason == "no more tasks: sources exhausted" and reply.retry_after_s > 0
    assert svc.report().tasks.exhausted


def test_unknown_workflow_gets_no_task(tmp_path: Path, clock: Clock) -> None:
    svc = service(tmp_path, clock)
    reply = svc.lease(LeaseRequest(node_id="n1", capacity=2, workflows=["other"]))
    assert reply.tasks == [] and "no task source runs workflows" in reply.reason


def test_backpressure_shrinks_leases_to_zero_and_grows_back(tmp_path: Path, clock: Clock) -> None:
    svc = service(tmp_path, clock, policies={"solver": {"vocab_size": 64, "max_buffered": 6}})
    tasks = lease(svc, capacity=8)
    assert len(tasks) == 3  # 3 tasks x group of 2 = 6 in flight
    reply = svc.lease(LeaseRequest(node_id="n2", capacity=8, workflows=["rlvr"]))
    assert reply.tasks == [] and "backpressure" in reply.reason
    for t in tasks:
        submit(svc, t)
    assert lease(svc, node="n2") == []  # buffered now: still full
    batch = take(svc, max_samples=4)
    assert batch is not None
    assert lease(svc, node="n2") == []  # served but not acked still counts
    svc.ack(AckRequest(batch_id=batch.batch_id))
    assert len(lease(svc, node="n2", capacity=8)) == 2


def test_lease_size_follows_measured_rate(tmp_path: Path, clock: Clock) -> None:
    svc = service(
        tmp_path,
        clock,
        regulation={"window_s": 10.0, "initial_lease": 2},
        policies={"solver": {"vocab_size": 64, "max_buffered": 10_000}},
    )
    first = lease(svc, capacity=8)
    assert len(first) == 2  # no measured rate yet: initial_lease
    assert lease(svc, capacity=8) == []  # already holds its allowance
    clock.advance(10)
    for t in first:
        submit(svc, t)  # 2 tasks in 10 s: 0.2/s, i.e. 2 per 10 s window
    second = lease(svc, capacity=8)
    assert len(second) == 2
    for t in second:
        submit(svc, t)  # 4 tasks in 10 s: 4 per window
    third = lease(svc, capacity=8)
    assert len(third) == 4
    for t in third:
        submit(svc, t)  # 8 per window, but never more than the capacity asked for
    fourth = lease(svc, capacity=3)
    assert len(fourth) == 3
    for t in fourth:
        submit(svc, t)
    clock.advance(100)  # nothing finished within the report window: min_lease
    assert len(lease(svc, capacity=8)) == 1
    assert len(lease(svc, node="fresh", capacity=3)) == 2  # initial_lease for a new node


def test_admission_needs_refresh_when_node_is_too_stale(tmp_path: Path, clock: Clock) -> None:
    svc = service(tmp_path, clock)
    svc.announce(PolicyVersion(policy="solver", version=3, manifest="solver/v3/manifest.json"))
    reply = svc.lease(
        LeaseRequest(node_id="n1", capacity=2, workflows=["rlvr"], versions={"solver": 1})
    )
    assert reply.tasks == [] and "max_staleness 1" in reply.refresh["solver"]
    assert reply.versions["solver"].version == 3
    ok = svc.lease(
        LeaseRequest(node_id="n1", capacity=2, workflows=["rlvr"], versions={"solver": 2})
    )
    assert len(ok.tasks) == 2 and ok.refresh == {}
    nothing = svc.lease(LeaseRequest(node_id="n2", capacity=2, workflows=["rlvr"]))
    assert nothing.tasks == [] and "holds version -1" in nothing.refresh["solver"]


def test_staleness_bound_at_batch_time(tmp_path: Path, clock: Clock) -> None:
    svc = service(tmp_path, clock)
    old, new = lease(svc, capacity=2)
    submit(svc, old, version=0)
    submit(svc, new, version=2)
    batch = take(svc, version=2, max_samples=8)  # max_staleness 1: version-0 samples are too old
    assert batch is not None and {s.task_id for s in batch.samples} == {new.task_id}
    policy = svc.report().policies["solver"]
    assert policy.stale_dropped_samples == 2 and policy.buffered_samples == 0


def test_unacked_batch_is_served_again_and_late_ack_retires(tmp_path: Path, clock: Clock) -> None:
    svc = service(tmp_path, clock, policies={"solver": {"vocab_size": 64, "ack_timeout_s": 5}})
    a, b = lease(svc, capacity=2)
    submit(svc, a)
    first = take(svc)
    assert first is not None
    clock.advance(6)
    svc.sweep(force=True)
    again = take(svc)
    assert again is not None and again.batch_id != first.batch_id
    assert {s.task_id for s in again.samples} == {a.task_id}
    svc.ack(AckRequest(batch_id=first.batch_id))  # late ack: groups were served again, keep
    svc.ack(AckRequest(batch_id=again.batch_id))
    submit(svc, b)
    third = take(svc)
    clock.advance(6)
    svc.sweep(force=True)
    assert third is not None
    svc.ack(AckRequest(batch_id=third.batch_id))  # late ack before re-serving retires them
    check_sizes(svc)
    assert take(svc) is None
    assert svc.report().policies["solver"].acked_samples == 4


def test_announce_rules(tmp_path: Path, clock: Clock) -> None:
    svc = service(tmp_path, clock)
    v1 = PolicyVersion(policy="solver", version=1, manifest="solver/v1/manifest.json")
    assert svc.announce(v1).latest.version == 1
    assert svc.announce(v1).latest == svc.versions()["solver"]  # idempotent
    with pytest.raises(ConflictError, match="already at version 1"):
        svc.announce(v1.model_copy(update={"manifest": "other"}))
    with pytest.raises(ConflictError):
        svc.announce(v1.model_copy(update={"version": 0}))
    with pytest.raises(NotFoundError, match="unknown policy 'ghost'"):
        svc.announce(PolicyVersion(policy="ghost", version=1, manifest="m"))


def test_bad_submissions_change_nothing(tmp_path: Path, clock: Clock) -> None:
    svc = service(tmp_path, clock)
    (task,) = lease(svc, capacity=1)
    bad_vocab = make_group(task, tokens=8, vocab=1000)
    bad_vocab[1] = bad_vocab[1].model_copy(update={"token_ids": bad_vocab[1].token_ids + 100})
    cases = {
        "unknown policy": make_group(task, policy="ghost"),
        "outside the vocabulary": bad_vocab,
        "submission is for": make_group("arith/other@e0"),
    }
    for message, samples in cases.items():
        req = SubmitRequest(node_id="n1", task_id=task.task_id, attempt=0, samples=samples,
                            secret=ref_of(svc, "n1", task).secret)  # fmt: skip
        with pytest.raises(ValidationError, match=message):
            svc.submit(req)
    assert svc.report().policies["solver"].buffered_samples == 0
    assert submit(svc, task).accepted  # the lease is still good


def test_restart_keeps_everything_acknowledged(tmp_path: Path, clock: Clock) -> None:
    svc = service(tmp_path, clock)
    tasks = lease(svc, capacity=4)
    submit(svc, tasks[0])
    submit(svc, tasks[1])
    batch = take(svc, max_samples=2)
    assert batch is not None
    svc.ack(AckRequest(batch_id=batch.batch_id))
    svc.announce(PolicyVersion(policy="solver", version=2, manifest="m2"))
    before = svc.report()
    svc.close()

    svc = service(tmp_path, clock)
    after = svc.report()
    assert after.tasks == before.tasks
    assert after.policies["solver"].buffered_samples == 2
    assert after.policies["solver"].acked_samples == 2
    assert svc.versions()["solver"].version == 2
    assert submit(svc, tasks[0]).duplicate
    assert submit(svc, tasks[2]).accepted  # lease survived
    rest = take(svc, version=1, max_samples=8)
    assert rest is not None
    assert batch.samples[0].task_id not in {s.task_id for s in rest.samples}
    later = lease(svc, capacity=8)
    assert not {t.task_id for t in later} & {t.task_id for t in tasks}  # selector resumed


def test_unknown_dataset_override_is_refused(tmp_path: Path, clock: Clock) -> None:
    with pytest.raises(NotFoundError, match="unknown sources"):
        DataflowService(make_config(tmp_path / "run"), datasets={"nope": []}, clock=clock)


def test_replay_serves_kept_acked_groups_within_its_ratio(tmp_path: Path, clock: Clock) -> None:
    svc = service(
        tmp_path,
        clock,
        policies={"solver": {"vocab_size": 64, "retain_acked": 2}},
        sampler={"type": "replay", "ratio": 0.5, "pick": "recent"},
    )
    tasks = lease(svc, capacity=6)
    for t in tasks[:3]:
        submit(svc, t)
    first = take(svc, max_samples=6)
    assert first is not None and len(first.samples) == 6  # no acked groups yet: all fresh
    svc.ack(AckRequest(batch_id=first.batch_id))
    assert svc.report().policies["solver"].acked_samples == 6
    submit(svc, tasks[3])
    mixed = take(svc, max_samples=8)
    assert mixed is not None and len(mixed.samples) == 4  # 2 fresh + at most as many replayed
    fresh = {tasks[3].task_id}
    replayed = {s.task_id for s in mixed.samples} - fresh
    assert len(replayed) == 1 and replayed <= {t.task_id for t in tasks[1:3]}  # kept: last 2
    svc.ack(AckRequest(batch_id=mixed.batch_id))
    assert svc.plugins["sampler"][1].metrics()["replayed_groups"] == 1
    svc.close()
    svc = service(
        tmp_path,
        clock,
        policies={"solver": {"vocab_size": 64, "retain_acked": 2}},
        sampler={"type": "replay", "ratio": 0.5},
    )
    assert len(svc.buffers.replay["solver"]) == 2  # the replay pool survives a restart


@pytest.mark.parametrize(("replay_max_staleness", "replayed"), [(None, 0), (3, 2)])
def test_replay_keeps_acked_groups_up_to_its_own_staleness_bound(
    tmp_path: Path, clock: Clock, replay_max_staleness: int | None, replayed: int
) -> None:
    # a pipelined trainer: the weights of version v make the batch trained at v + 1, so a group
    # is trained at staleness 1 and is at 2 by the next take; only a looser replay bound keeps it
    solver = {"vocab_size": 64, "max_staleness": 1, "retain_acked": 8,
              "replay_max_staleness": replay_max_staleness}  # fmt: skip
    svc = service(
        tmp_path, clock, policies={"solver": solver}, sampler={"type": "replay", "ratio": 0.5}
    )
    tasks = lease(svc, capacity=4)
    for t in tasks[:2]:
        submit(svc, t, version=0)
    first = take(svc, version=1, max_samples=4)
    assert first is not None and len(first.samples) == 4
    svc.ack(AckRequest(batch_id=first.batch_id))
    for t in tasks[2:]:
        submit(svc, t, version=1)
    mixed = take(svc, version=2, min_samples=4, max_samples=8)
    assert mixed is not None
    kept = {t.task_id for t in tasks[:2]} if replayed else set()
    assert {s.task_id for s in mixed.samples} == {t.task_id for t in tasks[2:]} | kept
    assert svc.plugins["sampler"][1].metrics()["replayed_groups"] == replayed


def test_replay_bound_below_max_staleness_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="replay_max_staleness .* below max_staleness"):
        solver = {"vocab_size": 64, "max_staleness": 2, "replay_max_staleness": 1}
        make_config(tmp_path / "run", policies={"solver": solver})


def test_mixing_and_source_weights_across_two_sources(tmp_path: Path, clock: Clock) -> None:
    cfg = make_config(tmp_path / "run").model_dump(mode="json")
    second = dict(cfg["sources"][0], name="other", weight=3.0)
    svc = DataflowService(
        make_config(
            tmp_path / "run",
            sources=[cfg["sources"][0], second],
            policies={"solver": {"vocab_size": 64, "max_buffered": 1000}},
            sampler={"type": "mixing", "weights": {"arith": 1, "other": 1}, "fill": False},
        ),
        clock=clock,
    )
    _OPEN.append(svc)
    tasks = lease(svc, capacity=16)
    sources = [t.source for t in tasks]
    assert sources.count("other") == 12 and sources.count("arith") == 4  # selector: 3 to 1
    for t in tasks:
        submit(svc, t)
    batch = take(svc, max_samples=8)
    assert batch is not None
    served = [s.task_id.split("/")[0] for s in batch.samples]
    assert served.count("arith") == served.count("other") == 4  # sampler: 1 to 1


def test_trainer_that_takes_again_frees_its_open_batch_at_once(
    tmp_path: Path, clock: Clock
) -> None:
    """A trainer crashed holding a batch (never acked) and came back with the same id: its
    batch goes back to the buffer at its next take, not after the ack timeout (600 s)."""
    svc = service(tmp_path, clock)
    tasks = lease(svc, capacity=2)
    for t in tasks:
        submit(svc, t)
    held = take(svc, trainer_id="t1", max_samples=2)
    assert held is not None
    other = take(svc, trainer_id="t2", max_samples=2)  # another trainer's batch stays its own
    assert other is not None
    assert svc.report().policies["solver"].served_samples == 4
    clock.advance(1)  # far below the ack timeout
    again = take(svc, trainer_id="t1", max_samples=4, min_samples=2)
    assert again is not None
    assert {s.task_id for s in again.samples} == {s.task_id for s in held.samples}
    pol = svc.report().policies["solver"]
    assert (pol.served_samples, pol.buffered_samples) == (4, 0)  # counted once, not twice
    svc.ack(AckRequest(batch_id=held.batch_id))  # the old batch's late ack retires nothing
    svc.ack(AckRequest(batch_id=again.batch_id))
    svc.ack(AckRequest(batch_id=other.batch_id))
    pol = svc.report().policies["solver"]
    assert (pol.acked_samples, pol.served_samples, pol.buffered_samples) == (4, 0, 0)


def test_frozen_policy_samples_are_dropped_and_never_throttle(tmp_path: Path, clock: Clock) -> None:
    cfg = make_config(tmp_path / "run").model_dump(mode="json")
    source = dict(cfg["sources"][0], policies=["solver", "judge"], epochs=None)
    svc = service(
        tmp_path,
        clock,
        sources=[source],
        policies={
            "solver": {"vocab_size": 64, "max_buffered": 256},
            "judge": {"vocab_size": 64, "max_buffered": 2, "frozen": True},
        },
    )
    for _ in range(3):  # judge samples well past its max_buffered: leasing goes on
        tasks = lease(svc, capacity=4)
        assert len(tasks) == 4
        for t in tasks:
            samples = make_group(t) + make_group(t, policy="judge", group_id=f"{t.task_id}:j")
            secret = svc.queue.secret("n1", t.task_id, t.attempt)
            reply = svc.submit(
                SubmitRequest(node_id="n1", task_id=t.task_id, attempt=t.attempt, secret=secret,
                              samples=samples)
            )  # fmt: skip
            assert reply.kept == {"solver": 2}
            assert "frozen" in reply.dropped["judge"]
    report = svc.report().policies
    assert report["judge"].buffered_samples == 0
    assert report["solver"].buffered_samples == 24
    nothing = TakeBatchRequest(policy="judge", trainer_version=0, min_samples=1)
    assert svc.take_batch(nothing) is None


def test_report_carries_recent_reward_and_served_staleness(tmp_path: Path, clock: Clock) -> None:
    svc = service(tmp_path, clock)
    before = svc.report().policies["solver"]
    assert before.reward_mean is None and before.served_staleness == []
    old, new = lease(svc, capacity=2)
    submit(svc, old, rewards=(0.0, 1.0), version=0)
    submit(svc, new, rewards=(1.0, 1.0), version=1)
    assert svc.report().policies["solver"].reward_mean == pytest.approx(0.75)
    batch = take(svc, version=1, min_samples=4, max_samples=4)
    assert batch is not None and len(batch.samples) == 4
    # trainer at version 1: the version-0 group is 1 behind, the version-1 group is fresh
    assert svc.report().policies["solver"].served_staleness == [2, 2]
    gauges = metrics_text(svc.report()).decode()  # the Prometheus gauges from the same snapshot
    assert 'astraflow_dataflow_policy_reward_mean{policy="solver"} 0.75' in gauges
    assert 'by_staleness{policy="solver",staleness="1"} 2.0' in gauges


def test_submit_many_commits_once_and_a_failing_submission_takes_back_only_its_part(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Submissions sent together are stored in one transaction (one commit, not one each);
    one that fails inside its change (here the buffer refuses its group) gets its error in
    its outcome, its part is taken back (its task still leased, nothing of it buffered or
    recorded as done), and the ones before and after it are kept, also after a restart."""
    from astraflow.dataflow.buffers import Buffers
    from astraflow.records import SubmitManyRequest

    svc = service(tmp_path, clock)
    tasks = lease(svc, capacity=3)
    reqs = [
        SubmitRequest(node_id="n1", task_id=t.task_id, attempt=t.attempt,
                      secret=ref_of(svc, "n1", t).secret, samples=make_group(t))
        for t in tasks
    ]  # fmt: skip
    doomed = tasks[1].task_id
    add = Buffers.add

    def refusing(self: Buffers, policy: str, group: list[Any], *args: Any) -> Any:
        if group[0].task_id == doomed:
            raise ConflictError("the buffer refuses this group (test)")
        return add(self, policy, group, *args)

    monkeypatch.setattr(Buffers, "add", refusing)
    statements: list[str] = []
    svc.store._db.set_trace_callback(statements.append)
    reply = svc.submit_many(SubmitManyRequest(submits=reqs))
    svc.store._db.set_trace_callback(None)
    assert [o.error is None for o in reply.outcomes] == [True, False, True]
    assert reply.outcomes[1].error is not None and "refuses" in str(reply.outcomes[1].error)
    assert [s for s in statements if s in ("BEGIN IMMEDIATE", "COMMIT")] == [
        "BEGIN IMMEDIATE",
        "COMMIT",
    ]
    check_sizes(svc)
    counts = svc.report().tasks
    assert (counts.done, counts.leased) == (2, 1)
    assert svc.report().policies["solver"].buffered_samples == 4
    monkeypatch.undo()
    svc.close()
    svc = service(tmp_path, clock)  # what was committed, and nothing of the failed one
    assert svc.report().tasks.done == 2
    assert svc.submit(reqs[1]).accepted and svc.submit(reqs[0]).duplicate
    assert svc.report().policies["solver"].buffered_samples == 6
