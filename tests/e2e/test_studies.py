"""The studies' ``--quick`` smoke runs end to end: ``benchmarks/data_algorithms_study.py``
(one GRESO + replay run) and ``benchmarks/multi_policy_study.py`` (one solver+verifier run and
its verifier-filtered voting)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import data_algorithms_study
import multi_policy_study

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_data_study_reads_rollouts_and_each_plug_in_from_the_report(tmp_path: Path) -> None:
    out = tmp_path / "study"
    argv = ["--quick", "--out", str(out), "--scratch", str(tmp_path / "runs")]
    assert data_algorithms_study.main(argv) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    (run,) = data["runs"]
    assert run["arm"] == "greso_replay" and run["reason"] == "finished"
    steps = data["steps"]
    assert run["curve"][0]["version"] == 0 and run["curve"][-1]["version"] == steps
    rollouts = [p["rollouts"] for p in run["curve"]]
    # from the dataflow report (tasks done x group size when each version was published)
    assert rollouts == sorted(rollouts) and rollouts[0] == 0 < rollouts[-1] <= run["rollouts_total"]
    assert rollouts[-1] >= (steps - 1) * 64  # every batch trained before the last was generated
    selector, sampler = run["plugins"]["selector"], run["plugins"]["sampler"]
    assert selector["offered"] > 0 and "skipped" in selector
    # the sampler counts batches it served, once each: the fresh groups it counted are exactly
    # the samples the dataflow saw acked, and it replayed kept groups beside them
    assert sampler["batches"] == steps
    assert sampler["fresh_groups"] * 8 == run["policy"]["acked_samples"]
    assert sampler["replayed_groups"] > 0
    (row,) = data["table"]
    assert "prompts skipped" in row["effect"] and "groups replayed" in row["effect"]
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_multi_policy_study_scores_greedy_majority_and_verified_votes(tmp_path: Path) -> None:
    out = tmp_path / "study"
    argv = ["--quick", "--out", str(out), "--scratch", str(tmp_path / "runs")]
    assert multi_policy_study.main(argv) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    (run,) = data["runs"]
    assert run["arm"] == "solver_verifier" and run["reason"] == "finished"
    assert run["solver_versions"] == data["args"]["steps"]
    assert run["solver_rollouts"] >= data["args"]["steps"] * 64
    scores = run["inference"]
    assert set(scores) == {"greedy", "majority@4", "verified@4", "judged_yes"}
    n = data["args"]["n"]
    for key in ("greedy", "majority@4", "verified@4"):
        assert scores[key] * n == pytest.approx(round(scores[key] * n))  # share of n prompts
    assert 0 <= scores["judged_yes"] <= 1
    if scores["judged_yes"] in (0.0, 1.0):  # kept all or none: the vote is plain majority
        assert scores["verified@4"] == scores["majority@4"]
    assert out.with_suffix(".png").stat().st_size > 10_000
