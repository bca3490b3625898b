"""The optimizer (AdamW on fp32 master weights) and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from astraflow.trainer.config import OptimizerConfig, SchedulerConfig

__all__ = ["build_optimizer", "build_scheduler", "lr_factor"]


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (after the backend has wrapped the model).

    Parameters all on the CPU, as plain floating-point tensors, are stepped by torch's fused
    CPU kernel: one pass per tensor instead of a dozen ops each (the quickstart's 24 tensors:
    0.4 ms a step against 1.9 ms). Elsewhere torch's default (``foreach`` on GPUs) is kept.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    on_cpu = bool(params) and all(
        p.device.type == "cpu" and p.is_floating_point() and type(p) is nn.Parameter for p in params
    )
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=True if on_cpu else None,
    )


def lr_factor(step: int, config: SchedulerConfig) -> float:
    """Multiplier of the peak lr after ``step`` updates."""
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    if config.type == "constant":
        return 1.0
    span = max(1, config.total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    floor = config.min_lr_ratio
    if config.type == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: SchedulerConfig | None
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following ``config`` (constant when None); stepped once per update."""
    if config is None:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: 1.0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
