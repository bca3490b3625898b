"""From a served batch to micro-batches: whole-group advantages, token-budget packing, padding.

Advantages are computed once over the whole batch, before it is cut, so a group split across
micro-batches (or ranks) still uses the statistics of the whole group. Micro-batches are
packed first-fit-decreasing by padded size (rows x longest row <= budget), padded on the right
with an attention mask, and dealt to ranks so every rank runs the same number of them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from astraflow.errors import ValidationError
from astraflow.records import Sample, groups_of
from astraflow.trainer.config import AdvantageScale
from astraflow.trainer.losses import group_advantages

__all__ = [
    "MicroBatch",
    "Packing",
    "TrainRow",
    "assign_to_ranks",
    "collate",
    "pack",
    "prepare_rows",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Packing:
    """How rows become micro-batches."""

    token_budget: int
    """Padded tokens (rows x longest row) per micro-batch."""
    pad_id: int
    """Token id used for right padding."""
    max_length: int | None = None
    """Longest row the model accepts (its positions); longer rows are rejected."""


@dataclass(frozen=True)
class TrainRow:
    """One sample, ready to train on: its arrays, its advantage and its sampling temperature."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    advantage: float
    temperature: float
    staleness: int

    @property
    def length(self) -> int:
        """Tokens in the row."""
        return int(self.token_ids.shape[0])


def _temperature(sample: Sample) -> float:
    raw = sample.meta.get("temperature", 1.0)
    if not isinstance(raw, (int, float)) or isinstance(raw, bool) or not raw > 0:
        raise ValidationError(
            f"sample of task {sample.task_id!r}: meta.temperature must be a positive number "
            f"(the temperature its logprobs were computed at), got {raw!r}",
            field="meta.temperature",
        )
    return float(raw)


def prepare_rows(
    samples: Sequence[Sample],
    *,
    trainer_version: int,
    scale: AdvantageScale = "std",
    eps: float = 1e-6,
    max_length: int | None = None,
) -> list[TrainRow]:
    """Rows with group-normalised advantages (whole groups of ``(policy, group_id)``).

    Raises ``ValidationError`` naming the sample when a row is longer than ``max_length`` or
    has a bad temperature.
    """
    index: dict[tuple[str, str], int] = {key: i for i, key in enumerate(groups_of(samples))}
    group_ids = torch.tensor([index[(s.policy, s.group_id)] for s in samples], dtype=torch.long)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    adv = group_advantages(rewards, group_ids, scale=scale, eps=eps)
    rows = []
    for s, a in zip(samples, adv.tolist(), strict=True):
        if max_length is not None and s.num_tokens > max_length:
            raise ValidationError(
                f"sample of task {s.task_id!r} has {s.num_tokens} tokens, more than the "
                f"model's {max_length} positions",
                field="token_ids",
            )
        mask = s.loss_mask.copy()
        mask[0] = 0  # the first token has no prefix to predict it from
        rows.append(
            TrainRow(
                token_ids=s.token_ids,
                loss_mask=mask,
                logprobs=s.logprobs,
                advantage=float(a),
                temperature=_temperature(s),
                staleness=s.staleness(trainer_version),
            )
        )
    return rows


def pack(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group row indices into micro-batches of at most ``token_budget`` padded tokens.

    First-fit decreasing on length; a micro-batch costs ``rows x longest``. A row longer than
    the budget gets a micro-batch of its own. Deterministic for the same lengths.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    longest: list[int] = []
    for i in order:
        n = lengths[i]
        for b, rows in enumerate(bins):
            if (len(rows) + 1) * max(longest[b], n) <= token_budget:
                rows.append(i)
                longest[b] = max(longest[b], n)
                break
        else:
            if n > token_budget:
                log.warning("row of %d tokens exceeds micro_batch_tokens=%d", n, token_budget)
            bins.append([i])
            longest.append(n)
    return bins


def assign_to_ranks(bins: list[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """This rank's micro-batches: dealt by size, padded with empty ones to an equal count.

    Every rank must run the same number of forward/backward passes (FSDP collectives), so
    ranks with fewer get empty micro-batches (no trained token).
    """
    per_rank = -(-len(bins) // world_size) if bins else 1
    mine = [bins[i] for i in range(rank, len(bins), world_size)]
    return mine + [[] for _ in range(per_rank - len(mine))]


@dataclass
class MicroBatch:
    """Right-padded tensors of a few rows."""

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    """Float ``[B, L]``: 1 on trained tokens."""
    behaviour_logprobs: Tensor
    advantages: Tensor
    """``[B]`` one per row."""
    temperature: Tensor
    """``[B]`` one per row."""

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens."""
        return int(self.attention_mask.sum())

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch on ``device``."""
        return MicroBatch(*(t.to(device, non_blocking=True) for t in self.__dict__.values()))


def collate(rows: Sequence[TrainRow], pad_id: int) -> MicroBatch:
    """Pad rows on the right into one micro-batch; an empty list gives one dummy pad row."""
    if not rows:
        return MicroBatch(
            input_ids=torch.full((1, 1), pad_id, dtype=torch.long),
            attention_mask=torch.ones(1, 1, dtype=torch.long),
            loss_mask=torch.zeros(1, 1),
            behaviour_logprobs=torch.zeros(1, 1),
            advantages=torch.zeros(1),
            temperature=torch.ones(1),
        )
    width = max(r.length for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    attn = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.float32)
    beh = np.zeros((len(rows), width), dtype=np.float32)
    for i, r in enumerate(rows):
        n = r.length
        ids[i, :n] = r.token_ids
        attn[i, :n] = 1
        mask[i, :n] = r.loss_mask
        beh[i, :n] = r.logprobs
    return MicroBatch(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attn),
        loss_mask=torch.from_numpy(mask),
        behaviour_logprobs=torch.from_numpy(beh),
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32),
        temperature=torch.tensor([r.temperature for r in rows], dtype=torch.float32),
    )
