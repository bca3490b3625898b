"""Checkpoints restore model, optimizer, scheduler and RNG exactly; partial ones are ignored."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from astraflow.models import build_model
from astraflow.trainer.backends.local import LocalBackend
from astraflow.trainer.batching import Packing
from astraflow.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from astraflow.trainer.config import LossConfig, OptimizerConfig, SchedulerConfig
from astraflow.trainer.optim import build_optimizer, build_scheduler
from astraflow.trainer.step import PolicyUpdate
from fixtures.models import tiny_spec
from fixtures.trainer import text_sample

SCHED = SchedulerConfig(type="cosine", warmup_steps=1, total_steps=10)


def _trained(tok: Any, steps: int = 2) -> tuple[Any, Any, Any, LocalBackend]:
    backend = LocalBackend("cpu")
    model = backend.wrap(build_model(tiny_spec(), tok))
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3, weight_decay=0.01))
    sched = build_scheduler(opt, SCHED)
    update = PolicyUpdate(backend, model, opt, LossConfig(), Packing(512, 0), scheduler=sched)
    batch = [text_sample(tok, "1+1=", "2", reward=1.0), text_sample(tok, "1+1=", "3")]
    for _ in range(steps):
        update.run(batch)
    return model, opt, sched, backend


def test_round_trip_restores_everything(tmp_path: Path, tiny_tokenizer: Any) -> None:
    model, opt, sched, backend = _trained(tiny_tokenizer)
    path = save_checkpoint(tmp_path, backend=backend, model=model, optimizer=opt,
                           scheduler=sched, version=2, meta={"last_batch_id": "b2"},
                           keep=2)  # fmt: skip
    fresh = backend.wrap(build_model(tiny_spec(seed=7), tiny_tokenizer))
    fresh_opt = build_optimizer(fresh, OptimizerConfig(lr=1e-3, weight_decay=0.01))
    fresh_sched = build_scheduler(fresh_opt, SCHED)
    meta = load_checkpoint(path, backend=backend, model=fresh, optimizer=fresh_opt,
                           scheduler=fresh_sched)  # fmt: skip
    assert meta["version"] == 2 and meta["last_batch_id"] == "b2"
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    mine, theirs = opt.state_dict(), fresh_opt.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    for idx, state in mine["state"].items():
        for key, value in state.items():
            assert torch.equal(theirs["state"][idx][key], value), (idx, key)
    assert fresh_sched.state_dict() == sched.state_dict()
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_rng_is_restored(tmp_path: Path, tiny_tokenizer: Any) -> None:
    model, opt, sched, backend = _trained(tiny_tokenizer, steps=1)
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    path = save_checkpoint(tmp_path, backend=backend, model=model, optimizer=opt,
                           scheduler=sched, version=1, meta={}, keep=1)  # fmt: skip
    after = (torch.rand(4).tolist(), random.random(), float(np.random.rand()))
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    load_checkpoint(path, backend=backend, model=model, optimizer=opt, scheduler=sched)
    assert (torch.rand(4).tolist(), random.random(), float(np.random.rand())) == after


def test_latest_ignores_partial_and_keep_prunes(tmp_path: Path, tiny_tokenizer: Any) -> None:
    model, opt, sched, backend = _trained(tiny_tokenizer, steps=1)
    for version in (1, 2, 3):
        save_checkpoint(tmp_path, backend=backend, model=model, optimizer=opt,
                        scheduler=sched, version=version, meta={}, keep=2)  # fmt: skip
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000003"]
    # a crash mid-write leaves a temp dir; a dir without meta.json is not a checkpoint either
    (tmp_path / ".tmp-step-00000009").mkdir()
    (tmp_path / "step-00000008").mkdir()
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step-00000003"
    assert latest_checkpoint(tmp_path / "missing") is None
