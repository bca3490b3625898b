"""A rollout node with the transformers engine against a real dataflow service and a real
weight server on loopback: it leases, runs ``rlvr``, pushes samples a re-computation by the
model confirms, refreshes to a newly published delta version and tags tokens with it, and
moves past an announced version its weight source does not serve."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from astraflow.raas.config import NodeConfig
from astraflow.raas.node import RolloutNode
from astraflow.records import PolicyVersion, Sample, TakeBatchRequest
from fixtures.raas import (
    PROMPTS,
    DataflowHarness,
    PolicyStore,
    dataflow_config,
    recompute_logprobs,
    write_tasks,
)


def _node_config(dataflow: str, weights: str, tmp: Path, **kw: Any) -> NodeConfig:
    values: dict[str, Any] = {
        "dataflow_url": dataflow,
        "weights": weights,
        "policies": {"policy": {}},
        "workflows": {"rlvr": {"sampling": {"max_new_tokens": 6, "temperature": 0.9}}},
        "capacity": 3,
        "node_id": "node-a",
        "pool": "test-pool",
        "work_dir": str(tmp / "node"),
        "idle_wait_s": 0.1,
    }
    values.update(kw)
    return NodeConfig.model_validate(values)


async def _take(
    client: Any, n: int, trainer_version: int = 0, timeout_s: float = 60.0
) -> list[Sample]:
    """Take batches like a trainer until ``n`` samples arrived (acking each batch)."""
    from astraflow.records import AckRequest

    samples: list[Sample] = []
    deadline = time.monotonic() + timeout_s
    while len(samples) < n and time.monotonic() < deadline:
        batch = await asyncio.to_thread(
            client.take_batch,
            TakeBatchRequest(
                policy="policy",
                trainer_version=trainer_version,
                min_samples=1,
                max_samples=64,
                timeout_s=2.0,
            ),
        )
        if batch is not None:
            samples += batch.samples
            await asyncio.to_thread(client.ack, AckRequest(batch_id=batch.batch_id))
    return samples


def _check_sample(sample: Sample, store: PolicyStore, models: dict[int, Any]) -> None:
    """Prompt masked, generated tokens trained with the logprobs their version gives."""
    tok = store.tokenizer
    mask = sample.loss_mask.astype(bool)
    assert mask.any() and not mask[0], "the prompt is never trained"
    first = int(np.argmax(mask))
    assert mask[first:].all(), "single turn: everything after the prompt is generated"
    prompt = tok.decode(sample.token_ids[:first].tolist())
    assert prompt in PROMPTS
    assert (sample.versions[~mask] == -1).all() and (sample.logprobs[~mask] == 0).all()
    versions = set(sample.versions[mask].tolist())
    assert len(versions) == 1, "one generation, one version"
    (version,) = versions
    ref = recompute_logprobs(
        models[version],
        sample.token_ids[:first].tolist(),
        sample.token_ids[first:].tolist(),
        sample.meta["temperature"],
    )
    np.testing.assert_allclose(sample.logprobs[mask], ref, atol=5e-5)
    answer = str(int(prompt[0]) + int(prompt[2]))
    text = tok.decode(sample.token_ids[first:].tolist(), skip_special_tokens=True)
    assert sample.reward == float(text == answer)
    assert sample.meta["node"] == "node-a" and sample.meta["pool"] == "test-pool"


async def test_node_leases_runs_rlvr_pushes_valid_samples_and_refreshes(
    tmp_path: Path, store: PolicyStore, weight_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="astraflow.weights.client")
    tasks = write_tasks(tmp_path / "tasks.jsonl")
    harness = DataflowHarness(dataflow_config(tmp_path / "df", tasks, epochs=None))
    node = RolloutNode(_node_config(harness.url, weight_server, tmp_path))
    client = harness.client()
    runner = asyncio.create_task(node.run())
    try:
        first = await _take(client, 8)
        assert len(first) >= 8
        # a node embedded in another program (here pytest) leaves its host's garbage
        # collector alone: only a node in a process of its own freezes its start-up heap
        assert gc.get_freeze_count() == 0
        models = {0: store.model_at(0)}
        for sample in first:
            assert set(sample.versions[sample.loss_mask == 1].tolist()) == {0}
            _check_sample(sample, store, models)
        groups: dict[str, list[Sample]] = {}
        for s in first:
            groups.setdefault(s.group_id, []).append(s)
        assert all(len(g) == 2 for g in groups.values()), "whole groups of group_size"

        # a trainer step: publish a delta version, announce it; the node must move to it
        store.publish_perturbed(1, fraction=0.2)
        ref = store.store.manifest_ref("policy", 1)
        client.announce(PolicyVersion(policy="policy", version=1, manifest=ref))
        models[1] = store.model_at(1)
        deadline = time.monotonic() + 60
        fresh: list[Sample] = []
        while not fresh and time.monotonic() < deadline:
            fresh = [
                s
                for s in await _take(client, 1, trainer_version=1, timeout_s=5)
                if set(s.versions[s.loss_mask == 1].tolist()) == {1}
            ]
        assert fresh, "no sample generated by version 1"
        for sample in fresh:
            _check_sample(sample, store, models)
        assert node.policies["policy"].version == 1
        assert node.meter.refreshes >= 1
        pulls = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pulled")]
        assert any("have=0 want=1 path=chain" in m for m in pulls), pulls  # a delta, in place

        # announced but never served (a regional relay went straight from 1 to 3): the node
        # takes the newest version served instead of asking for the missing one until the
        # next announcement
        store.publish_perturbed(3, fraction=0.2, seed=3)
        client.announce(PolicyVersion(policy="policy", version=2, manifest=ref))
        deadline = time.monotonic() + 60
        while node.policies["policy"].version != 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert node.policies["policy"].version == 3
        pulls = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pulled")]
        assert any("have=1 want=3 path=chain" in m for m in pulls), pulls
        report = client.report()
        assert report.nodes["node-a"].pool == "test-pool"
        assert report.nodes["node-a"].stats.hardware.startswith("cpu x")
        assert report.nodes["node-a"].stats.completed >= 1
    finally:
        node.request_stop()
        await asyncio.wait_for(runner, 60)
        client.close()
        harness.stop()


async def test_tasks_that_end_together_submit_at_once_in_one_request(
    tmp_path: Path, store: PolicyStore, weight_server: str
) -> None:
    """The submit window is an hour here: samples still arrive, because the node sends the
    held submissions as soon as every task it runs waits to submit (one request for them)."""
    tasks = write_tasks(tmp_path / "tasks.jsonl")
    harness = DataflowHarness(dataflow_config(tmp_path / "df", tasks, epochs=None))
    config = _node_config(harness.url, weight_server, tmp_path, capacity=4, submit_wait_s=3600)
    node = RolloutNode(config)
    client = harness.client()
    runner = asyncio.create_task(node.run())
    try:
        samples = await _take(client, 16)
        assert len(samples) >= 16
        stats = node.stats()
        done = stats.completed
        assert done >= 8
        assert stats.extra["submit_requests"] < done  # coalesced, not one request per task
    finally:
        node.request_stop()
        await asyncio.wait_for(runner, 60)
        client.close()
        harness.stop()


async def test_failing_workflow_is_reported_and_the_node_keeps_serving(
    tmp_path: Path, store: PolicyStore, weight_server: str
) -> None:
    """A task whose payload breaks the workflow is failed (re-queued, then failed for good)
    while every other task completes: a bad rollout is data, not a crash."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", PROMPTS[:4])
    with tasks.open("a") as f:
        f.write('{"id": "bad", "question": "no prompt field here"}\n')
    harness = DataflowHarness(dataflow_config(tmp_path / "df", tasks))
    node = RolloutNode(_node_config(harness.url, weight_server, tmp_path))
    client = harness.client()
    runner = asyncio.create_task(node.run())
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            report = client.report()
            if report.tasks.done + report.tasks.failed >= 5:
                break
            await asyncio.sleep(0.2)
        assert (report.tasks.done, report.tasks.failed) == (4, 1)
        assert node.meter.failed == 3  # max_attempts reports for the bad task
        assert not runner.done()
    finally:
        node.request_stop()
        await asyncio.wait_for(runner, 60)
        client.close()
        harness.stop()


async def test_a_lost_lease_cancels_its_task_without_a_report(
    tmp_path: Path, store: PolicyStore, weight_server: str
) -> None:
    """A node stalled past its lease ttl (no heartbeat) finds the lease lost at the next
    renew: it cancels that task (no submit, no fail) and the re-queued attempt completes."""
    from fixtures.raas import SLEEPY

    tasks = write_tasks(tmp_path / "tasks.jsonl", ["1+1="], block_s=2.0, sleep0_s=30.0)
    harness = DataflowHarness(
        dataflow_config(tmp_path / "df", tasks, ttl_s=1.0, workflow=SLEEPY, group_size=1)
    )
    node = RolloutNode(_node_config(harness.url, weight_server, tmp_path, workflows={SLEEPY: {}}))
    client = harness.client()
    runner = asyncio.create_task(node.run())
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and client.report().tasks.done < 1:
            await asyncio.sleep(0.2)
        report = client.report()
        assert report.tasks.done == 1 and report.tasks.failed == 0
        assert node.meter.lost == 1 and node.meter.failed == 0 and node.meter.completed == 1
        assert report.nodes["node-a"].lease_expiries == 1
        (sample,) = await _take(client, 1)
        assert sample.meta["attempt"] == 1
    finally:
        node.request_stop()
        await asyncio.wait_for(runner, 60)
        client.close()
        harness.stop()


async def test_a_busy_node_pulls_a_version_as_it_is_announced(
    tmp_path: Path, store: PolicyStore, weight_server: str
) -> None:
    """A node whose slots are all busy hears of a new version from its version watch and
    pulls it while the task still runs: not at its next lease (none while it is full), nor
    at its next heartbeat (108 s away here)."""
    from fixtures.raas import SLEEPY

    tasks = write_tasks(tmp_path / "tasks.jsonl", ["1+1="], sleep_s=60.0)
    harness = DataflowHarness(
        dataflow_config(tmp_path / "df", tasks, ttl_s=120.0, workflow=SLEEPY, group_size=1)
    )
    config = _node_config(harness.url, weight_server, tmp_path, workflows={SLEEPY: {}},
                          capacity=1, heartbeat_fraction=0.9)  # fmt: skip
    node = RolloutNode(config)
    client = harness.client()
    runner = asyncio.create_task(node.run())
    try:
        deadline = time.monotonic() + 30
        while not node._running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert node._running, "the node leased its one task"
        store.publish_perturbed(1, fraction=0.2)
        ref = store.store.manifest_ref("policy", 1)
        client.announce(PolicyVersion(policy="policy", version=1, manifest=ref))
        deadline = time.monotonic() + 30
        while node.policies["policy"].version != 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert node.policies["policy"].version == 1
        assert node._running and client.report().tasks.done == 0  # the task still runs
    finally:
        node.request_stop()
        await asyncio.wait_for(runner, 60)
        client.close()
        harness.stop()
