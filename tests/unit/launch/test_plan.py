"""RunConfig → component configs: what the launcher hands each component."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from astraflow.config import load_config
from astraflow.errors import ConfigError
from astraflow.launch.config import RunConfig
from astraflow.launch.plan import make_plan, node_config
from fixtures.launch import ROOT

TINY = {
    "model_type": "qwen3",
    "config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 32,
    },
    "tokenizer": {"type": "char", "alphabet": "0123456789+=?yesno"},
}


def two_policies(run_dir: Path, **judge: Any) -> RunConfig:
    return RunConfig.model_validate(
        {
            "run_dir": str(run_dir),
            "policies": {
                "solver": {"model": TINY},
                "judge": {"model": {**TINY, "seed": 7}, "frozen": True, **judge},
            },
            "sources": [
                {
                    "name": "add1",
                    "type": "generator",
                    "generator": {"type": "add1", "size": 100},
                    "workflow": "solver_verifier",
                    "policies": ["solver", "judge"],
                }
            ],
            "workflows": {"solver_verifier": {"solver": "solver", "verifier": "judge"}},
        }
    )


def test_a_frozen_policy_is_served_from_its_model_and_never_buffered(tmp_path: Path) -> None:
    config = two_policies(tmp_path / "run")
    plan = make_plan(config, port=8123)
    assert set(plan.trainers) == {"solver"}  # nobody trains the judge
    node = node_config(plan, config.pools[0])
    judge = node.policies["judge"]
    assert judge.is_frozen and judge.model == config.policies["judge"].model  # no store wait
    assert node.policies["solver"].model is None and not node.policies["solver"].is_frozen
    assert plan.dataflow.policies["judge"].frozen
    assert not plan.dataflow.policies["solver"].frozen


def test_a_frozen_judge_on_an_openai_server_keeps_its_engine(tmp_path: Path) -> None:
    engine = {"type": "openai", "url": "http://127.0.0.1:9/v1", "model": "judge"}
    config = two_policies(tmp_path / "run", rollout={"engine": engine})
    node = node_config(make_plan(config, port=8123), config.pools[0])
    judge = node.policies["judge"]
    assert judge.engine.type == "openai" and judge.model is not None  # its tokenizer


def test_replay_is_enabled_from_the_run_config(tmp_path: Path) -> None:
    config = load_config(
        RunConfig,
        ROOT / "examples" / "quickstart.yaml",
        [
            f"run_dir={tmp_path / 'run'}",
            "policies.policy.warmup=null",
            "policies.policy.retain_acked=64",
            "dataflow.sampler={type: replay, ratio: 0.25}",
        ],
    )
    plan = make_plan(config, port=8123)
    assert plan.dataflow.policies["policy"].retain_acked == 64
    with pytest.raises(ConfigError, match="retain_acked"):
        load_config(
            RunConfig,
            ROOT / "examples" / "quickstart.yaml",
            [f"run_dir={tmp_path / 'run'}", "policies.policy.retain_acked=-1"],
        )


def test_smoke_shortens_a_run_and_keeps_the_launchers_node_grace(tmp_path: Path) -> None:
    from astraflow.launch.plan import NODE_GRACE_S, node_stop_timeout
    from astraflow.launch.smoke import SMOKE_STEPS, smoke_config

    config = load_config(
        RunConfig, ROOT / "examples" / "solver_verifier.yaml", [f"run_dir={tmp_path / 'run'}"]
    )
    smoke = smoke_config(config)
    for name in ("solver", "verifier"):
        assert smoke.policies[name].trainer.max_steps == SMOKE_STEPS
        warmup = smoke.policies[name].warmup
        assert warmup is not None and warmup.steps <= 20
    assert smoke.eval[1].generator.kwargs["task"]["size"] <= 20
    node = node_config(make_plan(smoke, port=8123), smoke.pools[0])
    assert node.grace_s == NODE_GRACE_S < node_stop_timeout(smoke)
