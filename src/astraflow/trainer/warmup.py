"""SFT warm-up on (prompt, completion) pairs, run before version 0 is published.

Pairs become ordinary samples (prompt masked out, completion + EOS trained) and go through
the same update code as RL, so micro-batching and FSDP2 work unchanged. Prompts are encoded
without special tokens, as workflows encode text (``Trajectory.add_text``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from astraflow.config import read_jsonl
from astraflow.errors import ConfigError
from astraflow.progress import track
from astraflow.records import Sample
from astraflow.trainer.backends.base import TrainBackend
from astraflow.trainer.batching import Packing
from astraflow.trainer.config import LossConfig
from astraflow.trainer.step import PolicyUpdate

__all__ = ["WARMUP_MICRO_BATCH_TOKENS", "load_pairs", "pair_samples", "sft_warmup"]

#: Token budget of one warm-up micro-batch (warm-up pairs are short; accumulate beyond it).
WARMUP_MICRO_BATCH_TOKENS = 16384

log = logging.getLogger(__name__)


def load_pairs(path: str | Path) -> list[tuple[str, str]]:
    """Read a JSONL file of ``{"prompt": str, "completion": str}`` objects.

    Raises ``ConfigError`` naming the file and line of the first bad row.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"warmup.pairs: file not found: {p}")
    pairs = []
    for n, row in read_jsonl(p):
        if not all(isinstance(row.get(k), str) for k in ("prompt", "completion")):
            raise ConfigError(f"{p}:{n}: expected string fields 'prompt' and 'completion'")
        pairs.append((row["prompt"], row["completion"]))
    if not pairs:
        raise ConfigError(f"warmup.pairs: {p} holds no pairs")
    return pairs


def pair_samples(
    tokenizer: Any, pairs: Sequence[tuple[str, str]], *, add_eos: bool = True
) -> list[Sample]:
    """One sample per pair: prompt tokens (mask 0) then completion tokens (mask 1)."""
    out = []
    for i, (prompt, completion) in enumerate(pairs):
        head = tokenizer.encode(prompt, add_special_tokens=False)
        tail = tokenizer.encode(completion, add_special_tokens=False)
        if add_eos:
            tail = [*tail, tokenizer.eos_token_id]
        if not head or not tail:
            raise ConfigError(f"warm-up pair {i}: prompt and completion must both be non-empty")
        ids = np.asarray(head + tail, dtype=np.int32)
        mask = np.zeros(len(ids), dtype=np.uint8)
        mask[len(head) :] = 1
        out.append(
            Sample(
                policy="warmup",
                task_id=f"pair-{i}",
                group_id=f"pair-{i}",
                token_ids=ids,
                loss_mask=mask,
                logprobs=np.zeros(len(ids), dtype=np.float32),
                versions=np.where(mask == 1, 0, -1).astype(np.int32),
                reward=0.0,
            )
        )
    return out


def sft_warmup(
    model: nn.Module,
    tokenizer: Any,
    pairs: Sequence[tuple[str, str]] | Sequence[Sample],
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int = 0,
    backend: TrainBackend | None = None,
) -> list[float]:
    """Fine-tune ``model`` in place on ``pairs`` for ``steps`` AdamW steps; returns the losses.

    ``pairs`` are ``(prompt, completion)`` strings (EOS appended) or ready samples from
    :func:`pair_samples`. Batches of ``batch_size`` are drawn with replacement from
    ``random.Random(seed)`` (every rank draws the same). Without ``backend`` the model is
    trained where it is, in this process; with one, pass the model that backend wrapped.
    """
    if backend is None:
        from astraflow.trainer.backends.local import LocalBackend

        backend = LocalBackend(device=next(model.parameters()).device.type)
    samples = [p for p in pairs if isinstance(p, Sample)]
    texts = [p for p in pairs if not isinstance(p, Sample)]
    if samples and texts:
        raise ValueError("pairs must be all (prompt, completion) tuples or all samples")
    if texts:
        samples = pair_samples(tokenizer, texts, add_eos=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    packing = Packing(token_budget=WARMUP_MICRO_BATCH_TOKENS, pad_id=int(pad))
    update = PolicyUpdate(backend, model, optimizer, LossConfig(type="sft"), packing)
    rng = random.Random(seed)
    history = []
    with track("warm-up (SFT)", total=steps) as bar:
        for step in range(steps):
            stats = update.run(rng.choices(samples, k=batch_size))
            history.append(stats["loss"])
            bar.advance()
            if step % 50 == 0 or step == steps - 1:
                log.info("warmup step=%d loss=%.4f", step, stats["loss"])
    model.eval()
    return history
