"""The SIMULATED trainer step (benchmarks/simulated_trainer.py) through the ``trainer.update``
plug-in point: a real update on one group, the whole batch's calibrated time, batch-wide
stats; and the simulation's graded reward."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import torch

from astraflow.trainer.backends.local import LocalBackend
from astraflow.trainer.config import TrainerConfig
from astraflow.trainer.runtime import build_runtime
from fixtures.trainer import scripted_batches, trainer_config_dict
from simulated_engine import AnswerShare
from simulated_trainer import padded_tokens


def test_the_calibrated_step_trains_one_group_and_takes_the_batch_time(
    tmp_path: Path, tiny_tokenizer: Any
) -> None:
    update = {"type": "simulated_trainer:CalibratedUpdate", "fixed_s": 0.2,
              "padded_token_s": 1e-3, "groups": 1}  # fmt: skip
    config = TrainerConfig.model_validate(trainer_config_dict(tmp_path, update=update))
    rt = build_runtime(config, LocalBackend("cpu"))
    batch = scripted_batches(tiny_tokenizer)[0]  # groups g0 (3 samples) and g1 (4)
    before = {k: v.clone() for k, v in rt.model.state_dict().items()}
    stats = rt.step.run(batch, rt.version)
    padded = padded_tokens([s.num_tokens for s in batch], rt.update.packing.token_budget)
    assert stats["sim_padded_tokens"] == padded
    assert stats["sim_target_s"] == 0.2 + 1e-3 * padded
    assert stats["step_s"] >= stats["sim_target_s"] > stats["sim_real_s"]
    assert stats["sim_trained_samples"] == 3 and stats["trained_tokens"] > 0
    assert stats["samples"] == 7 and stats["groups"] == 2  # reported for the whole batch
    assert stats["tokens"] == sum(s.num_tokens for s in batch)
    assert any(not torch.equal(v, before[k]) for k, v in rt.model.state_dict().items())


def test_padded_tokens_cost_rows_times_longest_per_micro_batch() -> None:
    # budget 6: [5] alone, then 3 and 2 share a micro-batch of 2 rows x 3
    assert padded_tokens([5, 3, 2], 6) == 5 + 2 * 3
    assert padded_tokens([4, 4, 4], 100) == 12


def test_the_simulated_reward_is_graded() -> None:
    reward = AnswerShare(None, random.Random(0))
    scores = [asyncio.run(reward(r, {"answer": "12"})) for r in ("1x2y", "12", "zz", "")]
    assert scores == [0.5, 1.0, 0.0, 0.0]
