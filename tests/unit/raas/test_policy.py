"""NodePolicy: the PolicyHandle workflows call, over a real engine and a real weight store."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from astraflow.errors import ValidationError
from astraflow.raas.engines.base import EngineContext, build_engine
from astraflow.raas.policy import NodePolicy
from astraflow.weights import WeightClient
from astraflow.workflows.api import PolicyHandle, SamplingParams
from fixtures.raas import PolicyStore, recompute_logprobs


class RecordingSource:
    """A real WeightClient that records which of its paths the node used."""

    def __init__(self, client: WeightClient) -> None:
        self.client = client
        self.calls: list[tuple[str, Any, int | None]] = []

    def load(self, policy: str, version: int | None = None) -> Any:
        self.calls.append(("load", None, version))
        return self.client.load(policy, version)

    def pull(self, policy: str, tensors: Any, have: int | None, want: int | None = None) -> Any:
        stats = self.client.pull(policy, tensors, have, want)
        self.calls.append(("pull", have, want))
        return stats


def _policy(store: PolicyStore, tmp: Path, *, own_model: bool) -> NodePolicy:
    context = EngineContext(
        policy="policy",
        tokenizer=store.tokenizer,
        work_dir=tmp,
        model=store.spec if own_model else None,
        assets_dir=None if own_model else _assets(store, tmp),
    )
    engine = build_engine({"type": "transformers", "device": "cpu"}, context)
    return NodePolicy("policy", store.tokenizer, engine, frozen=False, from_store=False)


def _assets(store: PolicyStore, tmp: Path) -> Path:
    with WeightClient(store.root) as client:
        return client.fetch_assets("policy", tmp / "assets")


async def test_generate_accepts_text_messages_and_ids(
    tmp_path: Path, policy_store: PolicyStore
) -> None:
    policy = _policy(policy_store, tmp_path, own_model=True)
    assert isinstance(policy, PolicyHandle)
    tok = policy_store.tokenizer
    sampling = SamplingParams(max_new_tokens=5, temperature=0.8, seed=5)
    try:
        by_text = await policy.generate("1+2=", sampling, n=3)
        by_chat = await policy.generate([{"role": "user", "content": "1+2="}], sampling, n=3)
        by_ids = await policy.generate(tok.encode("1+2="), sampling, n=3)
        for gens in (by_text, by_chat, by_ids):
            assert [g.prompt_ids.tolist() for g in gens] == [tok.encode("1+2=")] * 3
            assert [g.token_ids.tolist() for g in gens] == [g.token_ids.tolist() for g in by_text]
        assert len({tuple(g.token_ids.tolist()) for g in by_text}) > 1, "seeds 5, 6, 7 differ"
        gen = by_text[0]
        assert (gen.policy, gen.version, gen.temperature) == ("policy", 0, 0.8)
        assert gen.text == tok.decode(gen.token_ids.tolist(), skip_special_tokens=True)
        ref = recompute_logprobs(
            policy.engine.model,
            gen.prompt_ids.tolist(),  # type: ignore[attr-defined]
            gen.token_ids.tolist(),
            0.8,
        )
        np.testing.assert_allclose(gen.logprobs, ref, atol=2e-5)
        assert policy.generated_tokens == sum(
            len(g.token_ids) for g in (*by_text, *by_chat, *by_ids)
        )
        for bad in ("", [], [{"no": "role"}, 3], [1.5, "x"]):
            with pytest.raises(ValidationError):
                await policy.generate(bad)  # type: ignore[arg-type]
        with pytest.raises(ValidationError, match="n must be"):
            await policy.generate("1", n=0)
    finally:
        await policy.close()


async def test_generate_waits_for_the_first_weights(
    tmp_path: Path, policy_store: PolicyStore
) -> None:
    policy = _policy(policy_store, tmp_path, own_model=False)
    try:
        assert policy.version == -1
        pending = asyncio.create_task(policy.generate("1+1=", SamplingParams(max_new_tokens=3)))
        await asyncio.sleep(0.2)
        assert not pending.done()
        with WeightClient(policy_store.root) as client:
            await policy.load(client, 0)
        (gen,) = await asyncio.wait_for(pending, 10)
        assert gen.version == 0 and policy.from_store
    finally:
        await policy.close()


async def test_refresh_loads_in_full_once_then_applies_deltas(
    tmp_path: Path, policy_store: PolicyStore
) -> None:
    """A policy started from its own model holds no store version: the first refresh is a
    full load; later ones are delta pulls from the version held."""
    policy = _policy(policy_store, tmp_path, own_model=True)
    source = RecordingSource(WeightClient(policy_store.root))
    try:
        policy_store.publish_perturbed(1)
        assert await policy.refresh(source, 1)
        policy_store.publish_perturbed(2, seed=2)
        policy_store.publish_perturbed(3, seed=3)
        assert await policy.refresh(source, 3)
        assert not await policy.refresh(source, 3), "already there"
        assert source.calls == [("load", None, 1), ("pull", 1, 3)]
        (gen,) = await policy.generate("2+1=", SamplingParams(max_new_tokens=6))
        assert gen.version == 3
        ref = recompute_logprobs(
            policy_store.model_at(3), gen.prompt_ids.tolist(), gen.token_ids.tolist(), 1.0
        )
        np.testing.assert_allclose(gen.logprobs, ref, atol=2e-5)
        frozen = NodePolicy(
            "f", policy_store.tokenizer, policy.engine, frozen=True, from_store=False
        )
        assert not await frozen.refresh(source, 3)
    finally:
        await policy.close()
        source.client.close()
