"""The trainer: consume batches of one policy, publish weight versions.

It meets the rest of the system only through the dataflow client (take, ack, announce) and
the weight store (publish). ``TrainerConfig`` imports without torch; ``Trainer``,
``sft_warmup`` and ``load_pairs`` are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from astraflow.trainer.config import TrainerConfig

if TYPE_CHECKING:
    from astraflow.trainer.loop import Trainer
    from astraflow.trainer.warmup import load_pairs, sft_warmup

__all__ = ["Trainer", "TrainerConfig", "load_pairs", "sft_warmup"]

_LAZY = {
    "Trainer": "astraflow.trainer.loop",
    "sft_warmup": "astraflow.trainer.warmup",
    "load_pairs": "astraflow.trainer.warmup",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'astraflow.trainer' has no attribute {name!r}")
