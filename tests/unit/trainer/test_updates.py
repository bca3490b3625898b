"""The ``trainer.update`` plug-in point: a plug-in wraps the built-in update; bad ones are
refused naming the problem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from astraflow.errors import PluginError
from astraflow.trainer.backends.local import LocalBackend
from astraflow.trainer.config import TrainerConfig
from astraflow.trainer.runtime import build_runtime
from astraflow.trainer.updates import check_stats
from fixtures.trainer import scripted_batches, trainer_config_dict

PLUGIN = "fixtures.trainer:FirstGroupsUpdate"


def test_the_plugin_is_the_step_and_trains_through_the_builtin_update(
    tmp_path: Path, tiny_tokenizer: Any
) -> None:
    plain = build_runtime(TrainerConfig.model_validate(trainer_config_dict(tmp_path / "a")),
                          LocalBackend("cpu"))  # fmt: skip
    assert plain.step is plain.update  # no plug-in: the built-in update is the step

    config = trainer_config_dict(tmp_path / "b", update={"type": PLUGIN, "groups": 1})
    rt = build_runtime(TrainerConfig.model_validate(config), LocalBackend("cpu"))
    assert type(rt.step).__name__ == "FirstGroupsUpdate"
    assert rt.step.inner is rt.update  # type: ignore[attr-defined]  # built around it
    batch = scripted_batches(tiny_tokenizer)[0]  # groups g0 (3 samples) and g1 (4)
    before = {k: v.clone() for k, v in rt.model.state_dict().items()}
    stats = rt.step.run(batch, rt.version)
    assert stats["wrapped_calls"] == 1 and stats["samples"] == 3 and stats["groups"] == 1
    assert check_stats(stats, "the plug-in") is stats
    changed = [k for k, v in rt.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed  # the weights the trainer publishes moved


def test_bad_update_plugins_are_refused_naming_the_problem(tmp_path: Path) -> None:
    def build(update: Any) -> None:
        config = TrainerConfig.model_validate(trainer_config_dict(tmp_path, update=update))
        build_runtime(config, LocalBackend("cpu"))

    with pytest.raises(PluginError, match="unknown key 'grups'"):
        build({"type": PLUGIN, "grups": 2})
    with pytest.raises(PluginError, match="does not implement Update"):
        build("fixtures.trainer:NotAnUpdate")
    with pytest.raises(PluginError, match="cannot import trainer update"):
        build("fixtures.no_such_module:Update")
    with pytest.raises(ValueError, match="the plug-in returned stats without tokens, loss"):
        check_stats({"step_s": 1.0, "samples": 2.0, "reward_mean": 0.0}, "the plug-in")
