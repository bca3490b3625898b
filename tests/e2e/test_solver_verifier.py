"""The shipped multi-policy example, shortened: two trainers, one workflow, both learn."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from astraflow.config import load_config
from astraflow.launch.config import RunConfig
from astraflow.launch.local import LocalRun
from fixtures.launch import ROOT, lines, processes_mentioning

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLE = ROOT / "examples" / "solver_verifier.yaml"


@pytest.mark.timeout(240)
def test_solver_and_verifier_both_learn(tmp_path: Path) -> None:
    run_dir = tmp_path / "sv"
    config = load_config(
        RunConfig,
        EXAMPLE,
        [f"run_dir={run_dir}", "max_time_s=80", "eval.0.every_s=3", "eval.1.every_s=3"],
    )
    result = LocalRun(config, base_dir=EXAMPLE.parent).run()

    assert result.reason == "max_time", result
    rewards = {}
    for policy in ("solver", "verifier"):
        metrics = [json.loads(x) for x in lines(run_dir / "trainers" / policy / "metrics.jsonl")]
        assert len(metrics) >= 100, f"{policy} trained only {len(metrics)} steps"
        assert {m["samples"] for m in metrics} == {128.0}, "its own batches, 16 groups each"
        first = statistics.mean(m["reward_mean"] for m in metrics[:25])
        last = statistics.mean(m["reward_mean"] for m in metrics[-25:])
        rewards[policy] = (round(first, 3), round(last, 3))
    # solver: right answers; verifier: verdicts that agree with the answer's true correctness
    assert rewards["solver"][1] > rewards["solver"][0] + 0.1, rewards
    assert rewards["verifier"][1] > rewards["verifier"][0] + 0.05, rewards
    summary = json.loads((run_dir / "summary.json").read_text())["policies"]
    solver = summary["solver"]
    assert solver["eval_accuracy"] >= solver["first_eval_accuracy"] + 0.15, summary
    assert processes_mentioning(str(run_dir)) == []
