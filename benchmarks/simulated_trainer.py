"""SIMULATION ONLY: a trainer step that runs on "its own hardware". For cluster-scale
benchmarks on one machine, never for training: a run names it by path in
``trainer.update`` (``simulated_trainer:CalibratedUpdate``, with ``benchmarks/`` on the
trainer's import path); the trainer builds it around its built-in update
(src/astraflow/trainer/updates.py).

In the paper's setting every trainer has accelerators of its own; here the trainers share two
CPU cores with the dataflow service and every simulated node. This step keeps the trainer's
*time* per step as measured on the real update alone on the machine, without burning the
shared CPU for it:

    batch (all groups) ─► the real GRPO update on the first ``groups`` groups (real loss,
        backward, AdamW: the weights the trainer publishes really change)
      ─► wait until fixed_s + padded_token_s x padded tokens of the WHOLE batch have passed
      ─► stats: the real update's, with the batch-wide samples / tokens / reward and
         ``step_s`` = the whole step (recorded as compute_s)

Padded tokens are what the built-in update computes over: the batch's rows packed into
micro-batches of ``micro_batch_tokens`` (first-fit decreasing), each costing rows x longest.
``fixed_s`` and ``padded_token_s`` are a least-squares fit to real steps of the same model,
loss and batch size (``calibrate``). Taking the whole real step and sleeping the remainder
would keep the weights the same but spend the shared CPU the trainer is meant not to have;
training on one group is the honest middle: real deltas, calibrated time, CPU for the rest.
"""

from __future__ import annotations

import math
import random
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.records import Sample
from astraflow.trainer.batching import pack
from astraflow.trainer.step import PolicyUpdate

__all__ = ["CalibratedUpdate", "calibrate", "padded_tokens"]


def padded_tokens(lengths: Sequence[int], budget: int) -> int:
    """Tokens the built-in update computes over: per micro-batch, rows x longest."""
    return sum(len(b) * max(lengths[i] for i in b) for b in pack(lengths, budget))


class CalibratedUpdate:
    """SIMULATION: a real update on part of the batch, then the calibrated step time."""

    class Config(ConfigModel):
        """A step time calibrated on the real update (see the module docstring)."""

        fixed_s: float = Field(ge=0)
        """Seconds of a step besides its tokens (calibrated)."""
        padded_token_s: float = Field(ge=0)
        """Seconds per padded token of the whole batch (calibrated)."""
        groups: int = Field(default=1, ge=1)
        """Groups of each batch the real update trains on (the rest only costs time)."""

    def __init__(self, config: Config, inner: PolicyUpdate) -> None:
        self.config = config
        self.inner = inner

    def run(self, samples: Sequence[Sample], trainer_version: int = 0) -> dict[str, float]:
        """The real update on the first groups, then wait out the calibrated time."""
        start = time.perf_counter()
        keep = set(list(dict.fromkeys(s.group_id for s in samples))[: self.config.groups])
        part = [s for s in samples if s.group_id in keep]
        stats = self.inner.run(part, trainer_version)
        real_s = time.perf_counter() - start
        padded = padded_tokens([s.num_tokens for s in samples], self.inner.packing.token_budget)
        target = self.config.fixed_s + self.config.padded_token_s * padded
        time.sleep(max(0.0, target - (time.perf_counter() - start)))
        rewards = [s.reward for s in samples]
        stats |= {
            "samples": float(len(samples)),
            "groups": float(len({s.group_id for s in samples})),
            "tokens": float(sum(s.num_tokens for s in samples)),
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards),
            "sim_trained_samples": float(len(part)),
            "sim_real_s": real_s,
            "sim_target_s": target,
            "sim_padded_tokens": float(padded),
            "step_s": time.perf_counter() - start,
        }
        return stats


# --------------------------------------------------------------------------- calibration


def _batch(tok: Any, rng: random.Random, lengths: Any, batch: int, group: int) -> list[Sample]:
    """``batch`` samples shaped like the benchmark's: add1 prompts, ``group`` completions of
    drawn lengths (random tokens), graded rewards, behaviour logprobs of a uniform policy."""
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    out = []
    for g in range(batch // group):
        head = tok.encode(f"{rng.randrange(1000)}+1=", add_special_tokens=False)
        for _ in range(group):
            n = lengths.draw(rng)
            ids = np.asarray(head + [rng.choice(vocab) for _ in range(n)], dtype=np.int32)
            mask = np.zeros(len(ids), dtype=np.uint8)
            mask[len(head) :] = 1
            out.append(Sample(
                policy="cal", task_id=f"t{g}", group_id=f"g{g}", token_ids=ids, loss_mask=mask,
                logprobs=(-math.log(len(vocab)) * mask).astype(np.float32),
                versions=np.where(mask == 1, 0, -1).astype(np.int32), reward=rng.random(),
            ))  # fmt: skip
    return out


def calibrate(
    model: Mapping[str, Any],
    trainer: Mapping[str, Any],
    lengths: Sequence[Mapping[str, Any]],
    *,
    batch: int,
    group: int = 8,
    repeats: int = 2,
) -> dict[str, Any]:
    """Real steps of the built-in update (the trainer's settings, this process's threads) on
    batches of each length distribution; returns the fit ``fixed_s + padded_token_s x
    padded`` and the points (padded tokens, tokens, seconds)."""
    from astraflow.models import build_tokenizer
    from astraflow.trainer.backends.local import LocalBackend
    from astraflow.trainer.config import TrainerConfig
    from astraflow.trainer.runtime import build_runtime
    from astraflow.workflows.length_tail import LengthDistribution

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        config = TrainerConfig.model_validate({
            **trainer, "policy": "cal", "model": dict(model), "weights": f"{tmp}/store",
            "run_dir": f"{tmp}/run", "device": "cpu",
        })  # fmt: skip
        rt = build_runtime(config, LocalBackend("cpu"))
        tok = build_tokenizer(config.model)
        budget = rt.update.packing.token_budget
        batches = [_batch(tok, rng, LengthDistribution.model_validate(d), batch, group)
                   for d in lengths]  # fmt: skip
        rt.update.run(batches[0][: 4 * group])  # warm-up
        points = []
        for samples in batches:
            padded = padded_tokens([s.num_tokens for s in samples], budget)
            tokens = sum(s.num_tokens for s in samples)
            for _ in range(repeats):
                started = time.perf_counter()
                rt.update.run(samples)
                points.append((padded, tokens, time.perf_counter() - started))
    xs, ys = [p[0] for p in points], [p[2] for p in points]
    slope, intercept = statistics.linear_regression(xs, ys)
    if intercept < 0:  # no fixed part to speak of: a line through the origin
        slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
        intercept = 0.0
    return {"fixed_s": intercept, "padded_token_s": slope, "batch": batch, "points": points}
