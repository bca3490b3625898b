"""Checkpoints: model, optimizer, scheduler, version, RNG (per rank), last acked batch.

    <dir>/step-00000012/model.safetensors   full fp32 state dict, HF names (backend-agnostic)
                        optimizer.pt        full optimizer state, keyed by parameter name
                        scheduler.json      LR scheduler state
                        rng/rank0.json ...  torch / python / numpy RNG of each rank
                        meta.json           version, last acked batch, world size
    <dir>/reference.safetensors             frozen KL reference (written once)

Written to ``.tmp-step-N`` and renamed: a ``step-N`` directory is always complete. State is
gathered full (not sharded), so a checkpoint of one backend resumes on the other.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from astraflow.errors import ConfigError
from astraflow.trainer.backends.base import TrainBackend

__all__ = [
    "latest_checkpoint",
    "load_checkpoint",
    "load_reference",
    "save_checkpoint",
    "save_reference",
]

log = logging.getLogger(__name__)
_PREFIX = "step-"


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint in ``directory`` (None when there is none)."""
    if not directory.is_dir():
        return None
    done = [p for p in directory.glob(f"{_PREFIX}*") if (p / "meta.json").is_file()]
    return max(done, key=lambda p: int(p.name.removeprefix(_PREFIX)), default=None)


def _barrier(backend: TrainBackend) -> None:
    backend.all_reduce_sum(torch.zeros(1))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: Any) -> None:
    with path.open("w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def rng_state() -> dict[str, Any]:
    """This process's torch, CUDA, python and numpy RNG state, as JSON-able values."""
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)
    py_state = random.getstate()
    return {
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()]
        if torch.cuda.is_available()
        else [],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))


def save_checkpoint(
    directory: Path,
    *,
    backend: TrainBackend,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    version: int,
    meta: dict[str, Any],
    keep: int,
) -> Path:
    """Write a checkpoint of ``version`` atomically (all ranks call); prune to ``keep``."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    # torch would "initialise" a stateless optimizer with a zero-lr step, which counts as an
    # Adam step: a fresh optimizer is saved as empty instead
    optim_sd = (
        get_optimizer_state_dict(model, optimizer, options=options) if optimizer.state else {}
    )
    final = directory / f"{_PREFIX}{version:08d}"
    tmp = directory / f".tmp-{final.name}"
    if backend.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    _barrier(backend)
    _write_json(tmp / "rng" / f"rank{backend.rank}.json", rng_state())
    _barrier(backend)
    if backend.rank == 0:
        # tied weights share storage, which safetensors refuses: store each name's own copy
        tensors = {k: v for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
        save_file({k: v.detach().clone().contiguous() for k, v in tensors.items()},
                  tmp / "model.safetensors")  # fmt: skip
        torch.save(optim_sd, tmp / "optimizer.pt")
        _write_json(tmp / "scheduler.json", scheduler.state_dict())
        body = dict(meta, version=version, world_size=backend.world_size, created_at=time.time(),
                    optimizer_state=bool(optimizer.state))  # fmt: skip
        _write_json(tmp / "meta.json", body)
        _fsync_dir(tmp)
        if final.exists():  # the same version again (e.g. at a graceful stop): replace it
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(directory)
        _prune(directory, keep)
        log.info("checkpoint saved version=%d path=%s", version, final)
    _barrier(backend)
    return final


def _prune(directory: Path, keep: int) -> None:
    done = sorted(
        (p for p in directory.glob(f"{_PREFIX}*") if (p / "meta.json").is_file()),
        key=lambda p: int(p.name.removeprefix(_PREFIX)),
    )
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    path: Path,
    *,
    backend: TrainBackend,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and this rank's RNG from ``path``; returns meta."""
    meta: dict[str, Any] = json.loads((path / "meta.json").read_text())
    distributed = dist.is_initialized()
    if backend.rank == 0 or not distributed:
        model_sd: dict[str, Any] = dict(load_file(path / "model.safetensors"))
        optim_sd: dict[str, Any] = torch.load(path / "optimizer.pt", weights_only=True)
    else:
        model_sd, optim_sd = {}, {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed)
    set_model_state_dict(model, model_sd, options=options)
    if meta.get("optimizer_state", True):  # False: saved before the first update
        set_optimizer_state_dict(model, optimizer, optim_sd, options=options)
    for group in optimizer.param_groups:  # the round trip turns tuples into lists
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    scheduler.load_state_dict(json.loads((path / "scheduler.json").read_text()))
    rng_file = path / "rng" / f"rank{backend.rank}.json"
    if rng_file.is_file():
        set_rng_state(json.loads(rng_file.read_text()))
    else:
        log.warning("checkpoint %s has no RNG state for rank %d (world size changed?)",
                    path, backend.rank)  # fmt: skip
    log.info("checkpoint loaded version=%s path=%s", meta.get("version"), path)
    return meta


def save_reference(directory: Path, state: dict[str, torch.Tensor]) -> None:
    """Write the frozen KL reference weights once (rank 0 passes the full state)."""
    target = directory / "reference.safetensors"
    tmp = directory / ".tmp-reference.safetensors"
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.clone().contiguous() for k, v in state.items()}, tmp)
    tmp.rename(target)


def load_reference(directory: Path) -> dict[str, torch.Tensor]:
    """The reference weights written by :func:`save_reference`."""
    target = directory / "reference.safetensors"
    if not target.is_file():
        raise ConfigError(f"loss.kl_coef > 0 but the checkpoint has no reference: {target}")
    return dict(load_file(target))
