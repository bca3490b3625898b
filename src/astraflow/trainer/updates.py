"""The ``update`` plug-in point: what one trainer step does with the batch it took.

By default a step is the built-in update (trainer/step.py: loss, backward, optimizer step).
``trainer.update`` names a class (``package.module:Class``) that takes its place. It is built
as ``cls(config, inner)``, where ``config`` is its own validated ``Config`` and ``inner`` is
this trainer's built-in update, so the plug-in wraps it: it may run it on part of the batch,
more than once, time or profile it, or add work before or after. Everything else stays the
trainer's: taking the batch, publishing the weights the step left, announcing, acking and
checkpointing (a plug-in changes the weights only through ``inner`` or the model it holds).

    take batch ─► update.run(samples, version) ─► stats ─► publish ─► announce ─► ack

``run`` returns the step's figures; the trainer reads ``step_s`` (seconds of the step,
recorded as ``compute_s``), ``samples``, ``tokens``, ``loss`` and ``reward_mean`` (the built-in
update's keys), and writes every key to the metrics. No torch here: configs import this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from astraflow.plugins import PluginOf, Registry
from astraflow.records import Sample

__all__ = ["REQUIRED_STATS", "UPDATES", "UPDATE_SPEC", "Update", "check_stats"]

#: The keys of a step's stats the trainer reads.
REQUIRED_STATS = ("step_s", "samples", "tokens", "loss", "reward_mean")


@runtime_checkable
class Update(Protocol):
    """One optimizer update per call, on the whole batch (all ranks call together)."""

    def run(self, samples: Sequence[Sample], trainer_version: int = 0) -> dict[str, float]:
        """Train on ``samples``; returns the step's figures (at least ``REQUIRED_STATS``)."""
        ...


#: Update plug-ins: none built in (the default is the built-in update itself); give a path.
UPDATES: Registry[Update] = Registry("trainer update", Update)
#: Field metadata of ``trainer.update`` (config checks resolve it without building it).
UPDATE_SPEC = PluginOf("astraflow.trainer.updates:UPDATES")


def check_stats(stats: dict[str, float], what: str) -> dict[str, float]:
    """``stats`` if it has every key the trainer reads, else a ValueError naming the missing."""
    missing = [k for k in REQUIRED_STATS if k not in stats]
    if missing:
        raise ValueError(f"{what} returned stats without {', '.join(missing)}")
    return stats
