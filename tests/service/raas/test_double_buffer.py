"""Double-buffered weights: the transformers engine keeps generating with the weights it holds
while a new version is pulled, and swaps only between batches; a node refreshing eagerly under
load never mixes two versions inside one generation."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from astraflow.raas.config import NodeConfig
from astraflow.raas.engines.base import EngineContext, GenerationRequest, build_engine
from astraflow.raas.node import RolloutNode
from astraflow.records import AckRequest, PolicyVersion, Sample, TakeBatchRequest
from astraflow.weights import WeightClient
from fixtures.raas import (
    DataflowHarness,
    PolicyStore,
    dataflow_config,
    recompute_logprobs,
    write_tasks,
)


class HeldPull:
    """The real weight client, whose pulls wait at the start until the test lets them go."""

    def __init__(self, client: WeightClient) -> None:
        self.client = client
        self.entered = threading.Event()
        self.go = threading.Event()

    def load(self, policy: str, version: int) -> Any:
        return self.client.load(policy, version)

    def pull(
        self, policy: str, tensors: MutableMapping[str, Any], have: int | None, want: int | None
    ) -> Any:
        self.entered.set()
        assert self.go.wait(60)
        return self.client.pull(policy, tensors, have, want)


async def test_engine_generates_with_the_old_weights_while_the_new_ones_are_pulled(
    tmp_path: Path, store: PolicyStore
) -> None:
    client = WeightClient(store.root)
    context = EngineContext(
        policy="policy", tokenizer=store.tokenizer, work_dir=tmp_path, model=store.spec
    )
    engine = build_engine({"type": "transformers", "device": "cpu"}, context)
    source = HeldPull(client)
    source.go.set()
    request = GenerationRequest((5, 14, 6, 17), max_new_tokens=8, temperature=1.0)
    try:
        await engine.apply(source, "policy", 0)
        store.publish_perturbed(1, fraction=0.3)
        source.go.clear()
        source.entered.clear()
        refresh = asyncio.create_task(engine.apply(source, "policy", 1))
        assert await asyncio.to_thread(source.entered.wait, 30)
        during = await asyncio.wait_for(engine.generate([request] * 4), 60)  # pull is held
        assert {o.version for o in during} == {0} and engine.version == 0
        source.go.set()
        await asyncio.wait_for(refresh, 60)
        after = await engine.generate([request] * 4)
        assert {o.version for o in after} == {1}
        models = {v: store.model_at(v) for v in (0, 1)}
        for out in during + after:
            ref = recompute_logprobs(
                models[out.version], request.prompt_ids, out.token_ids.tolist(), 1.0
            )
            np.testing.assert_allclose(out.logprobs, ref, atol=2e-5)
    finally:
        source.go.set()
        await engine.close()
        client.close()


@pytest.mark.parametrize("process", [False, True], ids=["in-process", "engine-process"])
async def test_node_refreshing_under_load_never_mixes_versions_in_a_generation(
    tmp_path: Path, store: PolicyStore, weight_server: str, process: bool
) -> None:
    tasks = write_tasks(tmp_path / "tasks.jsonl")
    harness = DataflowHarness(dataflow_config(tmp_path / "df", tasks, epochs=None))
    engine = {"process": True} if process else {}  # the engine's own process pulls the deltas
    config = NodeConfig.model_validate({
        "dataflow_url": harness.url, "weights": weight_server,
        "policies": {"policy": {"engine": engine}},
        "workflows": {"rlvr": {"sampling": {"max_new_tokens": 12, "temperature": 1.0}}},
        "capacity": 4, "node_id": "node-a", "work_dir": str(tmp_path / "node"),
        "idle_wait_s": 0.1,
    })  # fmt: skip
    node = RolloutNode(config)
    client = harness.client()
    runner = asyncio.create_task(node.run())
    samples: list[Sample] = []
    try:
        for version in (1, 2, 3):  # versions published and announced while the node generates
            store.publish_perturbed(version, fraction=0.2, seed=version)
            ref = store.store.manifest_ref("policy", version)
            client.announce(PolicyVersion(policy="policy", version=version, manifest=ref))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and node.policies.get("policy") is None:
                await asyncio.sleep(0.05)
            samples += await _take(client, 6, version)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(_version(s) == 3 for s in samples):
            samples += await _take(client, 2, 3)
    finally:
        node.request_stop()
        await asyncio.wait_for(runner, 60)
        client.close()
        harness.stop()
    models = {v: store.model_at(v) for v in range(4)}
    seen = set()
    for sample in samples:
        version = _version(sample)  # every generated token made by one version
        seen.add(version)
        mask = sample.loss_mask.astype(bool)
        first = int(np.argmax(mask))
        ref = recompute_logprobs(
            models[version], sample.token_ids[:first].tolist(),
            sample.token_ids[first:].tolist(), sample.meta["temperature"],
        )  # fmt: skip
        np.testing.assert_allclose(sample.logprobs[mask], ref, atol=5e-5)
    assert 3 in seen and len(seen) >= 2, seen  # it did refresh while serving


def _version(sample: Sample) -> int:
    versions = set(sample.versions[sample.loss_mask == 1].tolist())
    assert len(versions) == 1, f"one generation mixes versions {sorted(versions)}"
    return int(versions.pop())


async def _take(client: Any, n: int, trainer_version: int) -> list[Sample]:
    samples: list[Sample] = []
    deadline = time.monotonic() + 60
    while len(samples) < n and time.monotonic() < deadline:
        batch = await asyncio.to_thread(
            client.take_batch,
            TakeBatchRequest(policy="policy", trainer_version=trainer_version, min_samples=1,
                             max_samples=64, timeout_s=2.0),
        )  # fmt: skip
        if batch is not None:
            samples += batch.samples
            await asyncio.to_thread(client.ack, AckRequest(batch_id=batch.batch_id))
    return samples
