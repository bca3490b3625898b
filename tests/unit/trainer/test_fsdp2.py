"""FSDP2 with 2 processes on CPU (gloo) trains like the single-process backend, and what it
publishes and checkpoints is indistinguishable from what the local backend would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from astraflow.models import build_model, build_tokenizer
from astraflow.trainer.backends.local import LocalBackend
from astraflow.trainer.checkpoint import latest_checkpoint, load_checkpoint
from astraflow.trainer.config import OptimizerConfig
from astraflow.trainer.optim import build_optimizer, build_scheduler
from fixtures.models import tiny_spec
from fixtures.net import free_port
from fixtures.trainer import comparison_update, scripted_batches

HERE = Path(__file__).parent
TESTS = HERE.parents[1]


def _run_fsdp(out: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(TESTS))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(HERE / "fsdp_worker.py"), str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow
def test_fsdp2_two_ranks_match_local_backend(tmp_path: Path) -> None:
    _run_fsdp(tmp_path)
    torch.manual_seed(0)
    tok = build_tokenizer(tiny_spec())
    backend = LocalBackend("cpu")
    update = comparison_update(backend, tok)
    model, opt, sched = update.model, update.optimizer, update.scheduler
    local_stats = [update.run(b, v) for v, b in enumerate(scripted_batches(tok))]

    fsdp_stats = json.loads((tmp_path / "stats.json").read_text())
    for a, b in zip(local_stats, fsdp_stats, strict=True):
        for key in ("loss", "kl", "grad_norm", "trained_tokens", "m2po_masked_frac", "clip_frac"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert any(s["m2po_masked_frac"] > 0 for s in local_stats)  # the M2PO gather mattered

    weights = load_file(tmp_path / "weights.safetensors")
    for name, p in model.state_dict().items():
        assert torch.allclose(weights[name], p, atol=2e-5), name

    # what a rollout node would receive: same names, dtypes, shapes (and values to bf16)
    published = load_file(tmp_path / "published.safetensors")
    local_pub = backend.full_state_dict(model, torch.bfloat16)
    assert sorted(published) == sorted(local_pub)  # safetensors files sort their keys
    for name, t in local_pub.items():
        assert published[name].dtype == t.dtype and published[name].shape == t.shape
        assert torch.allclose(published[name].float(), t.float(), atol=1e-2), name

    # the FSDP2 checkpoint resumes on the local backend with the same optimizer state
    fresh = backend.wrap(build_model(tiny_spec(seed=9), tok))
    fresh_opt = build_optimizer(fresh, OptimizerConfig(lr=1e-3))
    fresh_sched = build_scheduler(fresh_opt, None)
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    assert ckpt is not None
    meta = load_checkpoint(
        ckpt, backend=backend, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched
    )
    assert meta["version"] == 2 and meta["world_size"] == 2
    assert fresh_sched.last_epoch == sched.last_epoch == 2
    mine, theirs = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert mine.keys() == theirs.keys()
    for idx in mine:
        assert float(theirs[idx]["step"]) == float(mine[idx]["step"]) == 2.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(theirs[idx][key], mine[idx][key], rtol=1e-3, atol=1e-8)
