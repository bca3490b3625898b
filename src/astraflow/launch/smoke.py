"""``astraflow run --smoke``: any run config, cut down to a few trainer steps.

For trying a recipe (or checking every shipped one in CI) without its full cost; what runs
is the same system, only shorter:

    every trained policy ── trainer.max_steps = 3, batches of at least 16 samples,
                            warm-up at most 20 steps
    every evaluation ────── held-out sets of at most 20 rows (where the generator has a size)
    the run ─────────────── ends when every trainer is done (or after 15 minutes at most)
"""

from __future__ import annotations

from typing import Any

from astraflow.launch.config import RunConfig

__all__ = ["SMOKE_STEPS", "smoke_config"]

#: Trainer steps of every trained policy in a smoke run.
SMOKE_STEPS = 3
_MIN_SAMPLES = 16
_WARMUP_STEPS = 20
_EVAL_ROWS = 20
_MAX_TIME_S = 900.0


def smoke_config(config: RunConfig) -> RunConfig:
    """``config`` shortened to :data:`SMOKE_STEPS` trainer steps per trained policy."""
    data = config.model_dump(mode="json", exclude_unset=True)  # defaults stay defaults
    for name in config.trained:
        policy = data["policies"][name]
        trainer = dict(policy.get("trainer") or {})
        trainer["max_steps"] = SMOKE_STEPS
        batch = dict(trainer.get("batch") or {})
        batch["min_samples"] = min(int(batch.get("min_samples", _MIN_SAMPLES)), _MIN_SAMPLES)
        trainer["batch"] = batch
        policy["trainer"] = trainer
        if policy.get("warmup"):
            policy["warmup"]["steps"] = min(int(policy["warmup"]["steps"]), _WARMUP_STEPS)
    for ev in data.get("eval", []):
        generator: dict[str, Any] = ev["generator"]
        _shrink(generator)
        for held in ev.get("sets", []):
            _shrink(held["generator"])
    limit = config.max_time_s
    data["max_time_s"] = _MAX_TIME_S if limit is None else min(limit, _MAX_TIME_S)
    return RunConfig.model_validate(data)


def _shrink(spec: dict[str, Any]) -> None:
    """At most ``_EVAL_ROWS`` rows from a generator spec (and from the one it wraps)."""
    if isinstance(spec.get("size"), int):
        spec["size"] = min(spec["size"], _EVAL_ROWS)
    inner = spec.get("task")
    if isinstance(inner, dict):
        _shrink(inner)
