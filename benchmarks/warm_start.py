"""One SFT warm-up shared by every arm of a study's seed.

A recipe's ``warmup`` section runs in the trainer process before version 0 is published. A
study whose arms share a policy's recipe runs that warm-up once per seed instead, with the
trainer's own code, and starts every arm from the saved model folder: the arms then differ
only in what they are meant to compare, and no run spends its time warming up again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def sft_init(spec: Any, warmup: Any, seed: int, out: Path) -> Path:
    """``warmup`` (a policy's warm-up section) applied to a fresh model of ``spec`` (its
    model section) with ``seed``, saved with its tokenizer as a model folder at ``out``."""
    import torch

    from astraflow.models import build_model, build_tokenizer
    from astraflow.trainer.warmup import pair_samples, sft_warmup
    from astraflow.workflows.tasks import GENERATORS

    assert warmup is not None and warmup.generator is not None, "the recipe has no warm-up"
    torch.set_num_threads(1)  # as the run's trainer (threads.trainer: 1)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(spec)
    model = build_model(spec, tokenizer).float()
    rows = GENERATORS.build(warmup.generator).rows()
    pairs = [(r["prompt"], r["completion"]) for r in rows]
    samples = pair_samples(tokenizer, pairs, add_eos=warmup.add_eos)
    sft_warmup(model, tokenizer, samples, steps=warmup.steps, lr=warmup.lr,
               batch_size=warmup.batch_size, seed=seed)  # fmt: skip
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
