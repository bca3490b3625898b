"""The CPU agent recipe (``examples/gridnav_cpu.yaml``), reduced, end to end: a tiny model
warmed up on a noisy scripted expert, then GRPO on whole ``gridnav`` episodes through every
component; episode figures reach the metrics file, the evaluator plays held-out episodes and
the run writes its success plot. (It checks the mechanics, not a learning margin: 40 steps
are too few for a stable one on a shared 2-core machine.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from astraflow.config import load_config
from astraflow.launch.config import RunConfig
from astraflow.launch.local import LocalRun
from fixtures.launch import ROOT, lines, processes_mentioning

pytestmark = pytest.mark.e2e

RECIPE = ROOT / "examples" / "gridnav_cpu.yaml"
STEPS = 40


@pytest.mark.timeout(600)
def test_reduced_gridnav_recipe_trains_on_whole_episodes(tmp_path: Path) -> None:
    run_dir = tmp_path / "gridnav"
    config = load_config(
        RunConfig,
        RECIPE,
        [
            f"run_dir={run_dir}",
            f"policies.policy.trainer.max_steps={STEPS}",
            "policies.policy.warmup.steps=60",
            "policies.policy.warmup.generator.size=500",
            "eval.0.generator.size=50",
            "eval.0.every_s=5",
            "max_time_s=480",
        ],
    )
    result = LocalRun(config).run()
    assert result.reason == "finished", result
    metrics = [json.loads(x) for x in lines(run_dir / "trainers/policy/metrics.jsonl")]
    assert [int(m["version"]) for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:  # episode figures of every batch reach the metrics file
        assert 0.0 <= m["env/success"] <= 1.0 and m["env/turns"] >= 1.0
        assert m["env/turns"] <= 18 and m["env/invalid_actions"] >= 0.0
    evals = [json.loads(x) for x in lines(run_dir / "eval/policy.jsonl")]
    assert evals and evals[-1]["version"] == STEPS, "the final version is evaluated on stop"
    assert all(e["n"] == 50 and e["turns"] >= 1.0 for e in evals)
    for png in ("success.png", "reward.png"):
        assert (run_dir / png).stat().st_size > 10_000
    assert processes_mentioning(str(run_dir)) == []
