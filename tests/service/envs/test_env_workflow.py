"""The ``env`` workflow over a real transformers engine: token masks and logprobs of a
5-turn episode, group rollouts from one seed, and failing environments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from astraflow.errors import EnvError
from astraflow.raas.engines.base import EngineContext, build_engine
from astraflow.raas.policy import NodePolicy
from astraflow.records import Task
from astraflow.workflows.api import PolicyHandle
from astraflow.workflows.registry import WORKFLOWS
from fixtures.envs import COUNTDOWN
from fixtures.models import tiny_spec
from fixtures.raas import Recording, recompute_logprobs


def _policy(tmp: Path) -> Recording:
    from astraflow.models import build_tokenizer

    spec = tiny_spec(max_position_embeddings=512)
    tok = build_tokenizer(spec)
    context = EngineContext(policy="policy", tokenizer=tok, work_dir=tmp, model=spec, seed=3)
    engine = build_engine({"type": "transformers", "device": "cpu"}, context)
    policy = Recording(NodePolicy("policy", tok, engine, frozen=False, from_store=False))
    assert isinstance(policy, PolicyHandle)
    return policy


def _workflow(**env: Any) -> Any:
    return WORKFLOWS.build(
        {
            "type": "env",
            "env": {"type": COUNTDOWN, **env},
            "sampling": {"max_new_tokens": 4, "temperature": 1.0, "stop": [">"]},
            "observation_template": " {observation}",
            "system": "play:",
        },
        seed=0,
    )


def _task(group_size: int = 1, seed: int = 7) -> Task:
    return Task(task_id="t1", workflow="env", payload={"seed": seed}, group_size=group_size)


async def test_five_turn_episode_masks_and_logprobs_are_exact(tmp_path: Path) -> None:
    policy = _policy(tmp_path)
    (sample,) = await _workflow(turns=5)(_task(), {"policy": policy}, {})
    tok = policy.tokenizer
    gens = policy.generations
    assert len(gens) == 5 and sample.meta["turns"] == 5
    observations = [" play:", " c7 d5 >", " d4 >", " d3 >", " d2 >", " d1 >"]
    expect_ids: list[int] = []
    expect_mask: list[int] = []
    expect_lp: list[float] = []
    for i, gen in enumerate(gens):
        obs = tok.encode(("play: c7 d5 >" if i == 0 else observations[i + 1]),
                         add_special_tokens=False)  # fmt: skip
        assert gen.prompt_ids.tolist() == expect_ids + obs, "each turn sees the whole episode"
        expect_ids += obs + gen.token_ids.tolist()
        expect_mask += [0] * len(obs) + [1] * len(gen.token_ids)
        expect_lp += [0.0] * len(obs) + gen.logprobs.tolist()
        ref = recompute_logprobs(
            policy.inner.engine.model,  # type: ignore[attr-defined]
            gen.prompt_ids.tolist(),
            gen.token_ids.tolist(),
            1.0,
        )
        np.testing.assert_allclose(gen.logprobs, ref, atol=5e-5)
    assert sample.token_ids.tolist() == expect_ids
    assert sample.loss_mask.tolist() == expect_mask
    assert sample.logprobs.tolist() == pytest.approx(expect_lp, abs=0)
    assert (sample.versions[sample.loss_mask == 0] == -1).all()
    assert (sample.versions[sample.loss_mask == 1] == 0).all()
    actions = [g.text.removesuffix(">").strip() for g in gens]
    expected = sum(float(len(a) % 2 == 1) for a in actions)
    assert sample.reward == expected == sample.meta["return"]
    assert sample.meta["metrics"]["env/turns"] == 5.0


async def test_group_episodes_share_the_seed(tmp_path: Path) -> None:
    policy = _policy(tmp_path)
    samples = await _workflow(turns=2)(_task(group_size=3, seed=4), {"policy": policy}, {})
    assert len(samples) == 3
    first_obs = tok_first = policy.tokenizer.encode("play: c4 d2 >", add_special_tokens=False)
    for s in samples:
        assert s.token_ids[: len(tok_first)].tolist() == first_obs
        assert s.meta["seed"] == 4 and s.group_id == "t1"


@pytest.mark.parametrize(
    ("env", "problem"),
    [({"raise_at": 3}, "countdown broke at step 3"), ({"hang_at": 2, "hang_s": 5}, "longer")],
)
async def test_a_failing_env_fails_the_task(
    tmp_path: Path, env: dict[str, Any], problem: str
) -> None:
    policy = _policy(tmp_path)
    workflow = WORKFLOWS.build(
        {
            "type": "env",
            "env": {"type": COUNTDOWN, **env},
            "sampling": {"max_new_tokens": 3, "stop": [">"]},
            "env_timeout_s": 0.5,
        },
        seed=0,
    )
    with pytest.raises(EnvError, match=problem):
        await workflow(_task(group_size=2), {"policy": policy}, {})


def test_bad_env_workflow_config_is_named() -> None:
    from astraflow.errors import PluginError

    with pytest.raises(PluginError, match="unknown key 'turnz'"):
        WORKFLOWS.build({"type": "env", "env": {"type": COUNTDOWN, "turnz": 3}}, seed=0)
    with pytest.raises(PluginError, match="pattern"):
        WORKFLOWS.build({"type": "env", "env": "gridnav", "action": {"type": "regex"}}, seed=0)
