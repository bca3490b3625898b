"""Every shipped workload driven by the ``env`` workflow over a real transformers engine.

Two episodes per task run concurrently (one group from one seed), which is also how a cold
household cache is first loaded from two threads at once (TextWorld's loader is serialised).
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from astraflow.envs.household_worlds import generate_worlds
from astraflow.models import TokenizerSpec, build_tokenizer
from astraflow.raas.engines.base import EngineContext, build_engine
from astraflow.raas.policy import NodePolicy
from astraflow.records import Task
from astraflow.workflows.registry import WORKFLOWS
from fixtures.models import tiny_spec

ALPHABET = string.ascii_letters + string.digits + " []:,.!'()$-\n"
ENVS = {
    "textcraft": {"max_turns": 3},
    "shop": {"max_turns": 3},
    "search_agent": {"max_turns": 3},
    "nim": {"max_turns": 3},
    "household": {"max_turns": 3, "worlds": 1, "list_actions": True},
}


def _policy(tmp: Path) -> NodePolicy:
    spec = tiny_spec(max_position_embeddings=4096).model_copy(
        update={"tokenizer": TokenizerSpec(type="char", alphabet=ALPHABET)}
    )
    tok = build_tokenizer(spec)
    context = EngineContext(policy="policy", tokenizer=tok, work_dir=tmp, model=spec, seed=1)
    engine = build_engine({"type": "transformers", "device": "cpu"}, context)
    return NodePolicy("policy", tok, engine, frozen=False, from_store=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ENVS))
async def test_env_workflow_plays_the_workload(name: str, tmp_path: Path) -> None:
    env: dict[str, Any] = {"type": name, **ENVS[name]}
    if name == "household":
        generate_worlds(tmp_path / "worlds", 1)
        env["cache_dir"] = str(tmp_path / "worlds")
    workflow: Any = WORKFLOWS.build(
        {
            "type": "env",
            "env": env,
            "sampling": {"max_new_tokens": 8, "temperature": 1.0, "stop": ["\n"]},
            "observation_template": "{observation}\n> ",
            "max_context_tokens": 4096,
        },
        seed=0,
    )
    task = Task(task_id="w1", workflow="env", payload={"seed": 11}, group_size=2)
    samples = await workflow(task, {"policy": _policy(tmp_path)}, {})
    assert len(samples) == 2
    first = _policy(tmp_path).tokenizer.decode(samples[0].token_ids[:40].tolist())
    second = _policy(tmp_path).tokenizer.decode(samples[1].token_ids[:40].tolist())
    assert first == second  # one group: the same episode from the task's seed
    for sample in samples:
        assert sample.group_id == "w1"
        assert 1 <= sample.meta["turns"] <= 3
        assert isinstance(sample.meta["success"], bool)
        assert 0.0 <= sample.reward <= 1.0
        mask = sample.loss_mask.astype(bool)
        assert mask.any() and (~mask).any()
        assert np.all(sample.logprobs[~mask] == 0)
