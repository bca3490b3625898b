"""``benchmarks/code_workflows_study.py --quick``: the test-generator arm end to end (smoke)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import code_workflows_study

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_quick_study_trains_both_policies_and_scores_held_out_programs(tmp_path: Path) -> None:
    out = tmp_path / "study"
    argv = ["--quick", "--arms", "solver_testgen", "--out", str(out), "--scratch", str(tmp_path)]
    assert code_workflows_study.main(argv) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    (run,) = data["runs"]
    assert run["arm"] == "solver_testgen" and run["reason"] == "finished"  # its 2 versions
    assert run["solver_versions"] >= 1 and run["solver_rollouts"] > 0
    assert run["eval_curve"] and run["eval_curve"][0][0] == 0  # the evaluator scored v0
    scores = run["inference"]
    k = data["args"]["k"]
    assert set(scores) == {"greedy", "sampled", f"pass@{k}", f"majority@{k}", f"tested@{k}",
                           "valid_tests"}  # fmt: skip
    assert all(0.0 <= v <= 1.0 for v in scores.values())
    # one of k samples passing is at least as likely as a given one, or as the picked one
    assert scores[f"pass@{k}"] >= max(scores["sampled"], scores[f"tested@{k}"])
    (row,) = data["table"]
    assert row["arm"] == "solver_testgen" and row["seeds"] == 1
    # both trainers made RL steps on the workflow's samples (the test writer's rewarded by
    # the sandbox: valid tests earn at least 0.5, so its rewards are the workflow's)
    trainers = tmp_path / "solver_testgen-s0" / "trainers"
    for policy in ("solver", "testgen"):
        steps = (trainers / policy / "metrics.jsonl").read_text().splitlines()
        assert steps and all(0.0 <= json.loads(s)["reward_mean"] <= 1.0 for s in steps)
    assert out.with_suffix(".png").stat().st_size > 10_000
