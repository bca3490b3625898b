"""Prompt batches for a causal LM's ``generate`` or forward pass (imports torch)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["left_padded"]


def left_padded(prompts: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` as one left-padded batch: token ids and attention mask (on the CPU)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt) :] = 1
    return ids, mask
