"""A held-out set of ``env`` episodes: greedy success and pass@k over k sampled episodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.config import load_config
from astraflow.evaluation.config import ScoringSettings
from astraflow.evaluation.episodes import LocalPolicy
from astraflow.evaluation.heldout import Decoding, HeldOut
from astraflow.launch.config import RunConfig
from astraflow.models import build_model, build_tokenizer
from astraflow.plugins import PluginSpec

GRIDNAV = Path(__file__).resolve().parents[3] / "examples" / "gridnav_cpu.yaml"


def test_env_set_scores_greedy_and_sampled_episodes() -> None:
    config = load_config(RunConfig, GRIDNAV)
    spec = config.policies["policy"].model
    tokenizer = build_tokenizer(spec)
    model = build_model(spec, tokenizer)  # untrained: invalid moves end episodes early
    held = HeldOut(
        "grid",
        PluginSpec.model_validate({"type": "env_episodes", "split": "eval", "size": 2}),
        config.workflows["env"],
        ScoringSettings(k=2),
        seed=0,
        decoding=Decoding(None, 8, 0.0),
    )
    figures = held.evaluate(LocalPolicy("policy", model, tokenizer, 0, seed=0), "gridnav")
    assert figures["grid/n"] == 2 and figures["grid/k"] == 2
    assert {"grid/accuracy", "grid/return", "grid/turns", "grid/avg@2"} <= figures.keys()
    assert 0 <= figures["grid/pass@1"] <= figures["grid/pass@2"] <= 1
    assert figures["grid/pass@1"] == pytest.approx(figures["grid/avg@2"])
    assert figures["grid/turns"] >= 1
