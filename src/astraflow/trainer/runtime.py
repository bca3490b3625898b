"""A trainer's in-memory state, built fresh or resumed: model, optimizer, version, RNG.

    fresh:   build model ─► backend.wrap ─► SFT warm-up (if configured) ─► AdamW + schedule
    resume:  build model ─► backend.wrap ─► AdamW + schedule ─► load newest checkpoint
    then:    the built-in update ─► wrapped by the ``trainer.update`` plug-in, if one is set

The KL reference (when used) is the model as it was at version 0, kept in the checkpoint
directory so a resumed trainer gets the same one.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from astraflow.models import build_model, build_tokenizer
from astraflow.plugins import PluginSpec
from astraflow.trainer.backends.base import TrainBackend
from astraflow.trainer.batching import Packing
from astraflow.trainer.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_reference,
    save_checkpoint,
    save_reference,
)
from astraflow.trainer.config import TrainerConfig
from astraflow.trainer.optim import build_optimizer, build_scheduler
from astraflow.trainer.step import PolicyUpdate
from astraflow.trainer.updates import UPDATES, Update
from astraflow.trainer.warmup import load_pairs, pair_samples, sft_warmup

__all__ = ["Runtime", "build_runtime"]

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """Everything that changes as the trainer trains (the same on every rank)."""

    config: TrainerConfig
    backend: TrainBackend
    tokenizer: Any
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    update: PolicyUpdate
    """The built-in update (loss, backward, optimizer step)."""
    step: Update
    """What a trainer step runs: the ``trainer.update`` plug-in (wrapping ``update``), else
    ``update`` itself."""
    version: int
    """The version the current weights are (or follow): the next update publishes a higher one."""
    resumed: bool
    """Started from a checkpoint."""
    last_batch_id: str | None
    """Batch of the last update in these weights (re-acked on resume: acks are idempotent)."""

    @property
    def publish_dtype(self) -> torch.dtype:
        """Dtype of published floating-point tensors."""
        from astraflow.models import torch_dtype

        return torch_dtype(self.config.publish_dtype)

    def save(self) -> None:
        """Checkpoint the current version (all ranks call)."""
        save_checkpoint(
            self.config.checkpoint_dir,
            backend=self.backend,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            version=self.version,
            meta={"policy": self.config.policy, "last_batch_id": self.last_batch_id},
            keep=self.config.checkpoint.keep,
        )


def seed_everything(seed: int, rank: int) -> None:
    """Seed this trainer process's torch, python and numpy RNGs (the process owns them)."""
    torch.manual_seed(seed + rank)
    random.seed(seed + rank)
    np.random.seed(seed + rank)


def build_runtime(
    config: TrainerConfig,
    backend: TrainBackend,
    *,
    on_fresh: Callable[[nn.Module, Any], None] | None = None,
) -> Runtime:
    """Build the model and optimizer; warm up when fresh, else load the newest checkpoint.

    ``on_fresh(model, tokenizer)`` runs once the model is built, before the warm-up, when no
    checkpoint is found (the trainer publishes the policy's assets then, so rollout nodes
    build their engines while it warms up).
    """
    seed_everything(config.seed, backend.rank)
    tokenizer = build_tokenizer(config.model)
    model = build_model(config.model, tokenizer).float()
    max_length = getattr(model.config, "max_position_embeddings", None)
    model = backend.wrap(model)
    ckpt = latest_checkpoint(config.checkpoint_dir)
    if ckpt is None and on_fresh is not None:
        on_fresh(model, tokenizer)
    if ckpt is None and config.warmup is not None:
        w = config.warmup
        log.info("warmup start pairs=%s steps=%d", w.pairs, w.steps)
        samples = pair_samples(tokenizer, load_pairs(w.pairs), add_eos=w.add_eos)
        sft_warmup(model, tokenizer, samples, steps=w.steps, lr=w.lr, batch_size=w.batch_size,
                   seed=config.seed, backend=backend)  # fmt: skip
    optimizer = build_optimizer(model, config.optimizer)
    scheduler = build_scheduler(optimizer, config.scheduler)
    ref = _reference(config, backend, model, tokenizer, fresh=ckpt is None)
    update = PolicyUpdate(
        backend,
        model,
        optimizer,
        config.loss,
        Packing(config.batch.micro_batch_tokens, _pad_id(tokenizer), max_length),
        grad_clip=config.optimizer.grad_clip,
        scheduler=scheduler,
        ref_model=ref,
    )
    meta: dict[str, Any] = {}
    if ckpt is not None:
        meta = load_checkpoint(
            ckpt, backend=backend, model=model, optimizer=optimizer, scheduler=scheduler
        )
    version = int(meta.get("version", 0))
    return Runtime(
        config=config,
        backend=backend,
        tokenizer=tokenizer,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        update=update,
        step=_step(config.update, update),
        version=version,
        resumed=ckpt is not None,
        last_batch_id=meta.get("last_batch_id"),
    )


def _step(spec: PluginSpec | str | None, update: PolicyUpdate) -> Update:
    """The plug-in named by ``trainer.update``, built around the built-in ``update``."""
    if spec is None:
        return update
    spec = PluginSpec.coerce(spec)
    step = UPDATES.construct(spec, update)
    log.info("trainer update plug-in %s wraps the built-in update", spec.type)
    return step


def _pad_id(tokenizer: Any) -> int:
    for key in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, key, None)
        if value is not None:
            return int(value)
    return 0


def _reference(
    config: TrainerConfig, backend: TrainBackend, model: nn.Module, tokenizer: Any, *, fresh: bool
) -> nn.Module | None:
    """The frozen KL reference: the version-0 weights, saved once beside the checkpoints."""
    if config.loss.kl_coef <= 0 or config.loss.type == "sft":
        return None
    directory = config.checkpoint_dir
    if fresh:
        state = backend.full_state_dict(model, torch.float32)
        if backend.rank == 0:
            save_reference(directory, state)
        backend.all_reduce_sum(torch.zeros(1))  # barrier: the file exists for every rank
    ref = build_model(config.model, tokenizer).float()
    ref.load_state_dict(load_reference(directory))
    return backend.wrap(ref, trainable=False)
