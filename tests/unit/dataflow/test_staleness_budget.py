"""The staleness budget at lease: samples a node's version makes can serve only the trainer's
batches up to ``max_staleness`` versions later, so no more than those batches' worth is
leased; a node whose samples could serve none refreshes, one at the latest version waits."""

from __future__ import annotations

from pathlib import Path

from astraflow.dataflow import regulation
from astraflow.dataflow.service import DataflowService
from astraflow.records import LeaseRequest, PolicyVersion, TakeBatchRequest
from fixtures.dataflow import make_config


def _lease(svc: DataflowService, held: int) -> tuple[int, str, dict[str, str]]:
    reply = svc.lease(LeaseRequest(node_id="n", capacity=64, workflows=["rlvr"],
                                   versions={"solver": held}))  # fmt: skip
    return len(reply.tasks), reply.reason, reply.refresh


def _take(svc: DataflowService, version: int, size: int) -> None:
    svc.take_batch(TakeBatchRequest(policy="solver", trainer_version=version, min_samples=size,
                                    max_samples=size, timeout_s=0))  # fmt: skip


def test_leases_stop_at_what_the_trainer_can_still_use(tmp_path: Path) -> None:
    policies = {"solver": {"vocab_size": 64, "max_staleness": 1, "max_buffered": 256}}
    svc = DataflowService(make_config(tmp_path / "run", policies=policies))
    try:
        svc.announce(PolicyVersion(policy="solver", version=0, manifest="m0"))
        _take(svc, 1, 4)  # a prefetching trainer waits for the batch trained on version 1
        # version 0's samples serve that batch only: 4 samples = 2 tasks of group size 2
        assert _lease(svc, 0)[0] == 2
        tasks, reason, refresh = _lease(svc, 0)
        assert tasks == 0 and not refresh and reason.startswith(regulation.BUDGET)
        svc.announce(PolicyVersion(policy="solver", version=1, manifest="m1"))
        _take(svc, 2, 8)  # the trainer moved on: its next batch (8 samples) trains on 2
        tasks, _, refresh = _lease(svc, 0)  # version 0 is too stale for it: refresh first
        assert tasks == 0 and "too stale" in refresh["solver"]
        # version 1 serves that batch: 8 samples, less the 4 in flight (whatever made them)
        assert _lease(svc, 1)[0] == 2
        assert _lease(svc, 1)[0] == 0
    finally:
        svc.close()


def test_without_a_trainer_only_backpressure_bounds_leases(tmp_path: Path) -> None:
    policies = {"solver": {"vocab_size": 64, "max_staleness": 1, "max_buffered": 20}}
    svc = DataflowService(make_config(tmp_path / "run", policies=policies))
    try:
        svc.announce(PolicyVersion(policy="solver", version=0, manifest="m0"))
        assert _lease(svc, 0)[0] == 10
    finally:
        svc.close()
