"""A trainer that reaches its last step announces a final version; nobody waits on it after.

The failure this prevents (seen in a solver+verifier run): the solver's trainer finished, its
buffer filled to ``max_buffered`` with nobody taking, backpressure refused every task that
needs the solver, and the verifier's trainer starved a few steps short of its own end.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from astraflow.dataflow.client import DataflowClient
from astraflow.records import AckRequest, TakeBatchRequest
from fixtures.dataflow import DataflowProcess, make_sync_config
from fixtures.duel import announce, holding, lease, submit, train


def test_final_policy_no_longer_throttles_the_others(
    tmp_path: Path, dataflow_factory: Callable[..., str]
) -> None:
    # async mode, room for two tasks per policy (group size 2, max_buffered 4)
    policy = {"vocab_size": 64, "max_staleness": 4, "max_buffered": 4}
    config = make_sync_config(
        tmp_path / "df",
        policies={"solver": policy, "verifier": policy},
        regulation={"mode": "async"},
    )
    url = dataflow_factory(config)
    with DataflowClient(url) as c:
        announce(c, "solver", 0)
        announce(c, "verifier", 0)
        for t in lease(c, capacity=8, **holding(0)).tasks:
            submit(c, t)
        full = lease(c, capacity=8, **holding(0))
        assert full.tasks == [] and "solver" in full.reason  # backpressure: nobody takes
        # the verifier's trainer drains its buffer, but the solver's is still full
        req = TakeBatchRequest(
            policy="verifier", trainer_version=0, min_samples=4, max_samples=4, timeout_s=0
        )
        batch = c.take_batch(req)
        assert batch is not None
        c.ack(AckRequest(batch_id=batch.batch_id))
        assert lease(c, capacity=8, **holding(0)).tasks == []

        # the solver's trainer is done: re-announcing its version as final frees the tasks
        announce(c, "solver", 0, final=True)
        assert c.versions()["solver"].final
        granted = lease(c, capacity=8, **holding(0)).tasks
        assert granted, "tasks that need the finished solver are leased again"
        reply = submit(c, granted[0])
        assert reply.kept == {"verifier": 2}
        assert "finished" in reply.dropped["solver"]
        report = c.report()
        assert report.policies["solver"].final and not report.policies["verifier"].final
        assert report.policies["solver"].buffered_samples == 4  # unchanged: not buffered


def test_final_version_survives_restart_and_releases_sync_rounds(
    tmp_path: Path, dataflow_process: Callable[..., DataflowProcess]
) -> None:
    config = make_sync_config(tmp_path / "df", round_tasks=2)
    proc = dataflow_process(config)
    with DataflowClient(proc.url) as c:
        announce(c, "solver", 0, final=True)  # a solver that is already done
        announce(c, "verifier", 0)
        tasks = lease(c, capacity=5, **holding(0)).tasks
        assert len(tasks) == 2
        for t in tasks:
            submit(c, t)
        train(c, "verifier", 0)  # the verifier alone closes the round
        assert c.report().sync.round == 1  # type: ignore[union-attr]
    proc.kill()
    proc = dataflow_process(config)
    with DataflowClient(proc.url) as c:
        assert c.versions()["solver"].final
        assert len(lease(c, capacity=5, solver=0, verifier=1).tasks) == 2  # round 1 opened
