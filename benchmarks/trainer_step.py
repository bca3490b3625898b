"""Training-step throughput of the trainer: single process vs FSDP2 x2, CPU (and GPU if any).

One step = the trainer's real update (whole-group advantages, micro-batching, GRPO loss with
TIS, backward, grad clip, AdamW) on a synthetic batch of 16 samples x 128 tokens (112
generated). Reported: median seconds per step and trained tokens/s; the baseline is the
single-process backend measured in the same run, the ratio is FSDP2 / single.

    .venv/bin/python benchmarks/trainer_step.py            # tiny + ~30M on CPU, GPU if present
    .venv/bin/python benchmarks/trainer_step.py --quick    # fewer steps, tiny model only

On CPU the two FSDP2 ranks share the machine's cores with each other (torchrun gives each
OMP_NUM_THREADS=1), so on a 2-core box FSDP2 x2 measures overhead, not speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch

from astraflow.models import ModelSpec, TokenizerSpec, build_model, build_tokenizer
from astraflow.records import Sample
from astraflow.trainer.backends.base import TrainBackend
from astraflow.trainer.batching import Packing
from astraflow.trainer.config import LossConfig, OptimizerConfig
from astraflow.trainer.optim import build_optimizer
from astraflow.trainer.step import PolicyUpdate

CPU_MODELS: dict[str, dict[str, Any]] = {
    "tiny-0.4M": {"hidden_size": 128, "num_hidden_layers": 2, "vocab_size": 64},
    "30M": {"hidden_size": 512, "num_hidden_layers": 8, "vocab_size": 8192},
}
# Qwen2.5-0.5B's shape, built from a config with random init (no download)
GPU_MODEL: dict[str, Any] = {
    "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
    "head_dim": 64, "max_position_embeddings": 4096, "tie_word_embeddings": True,
}  # fmt: skip


def spec_for(values: dict[str, Any]) -> ModelSpec:
    """A Qwen3 spec from a few architecture values (heads and MLP filled in)."""
    hidden = values["hidden_size"]
    config = {
        "intermediate_size": 3 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": hidden // 4, "max_position_embeddings": 256, "tie_word_embeddings": True,
    }  # fmt: skip
    config.update(values)
    return ModelSpec(model_type="qwen3", config=config, tokenizer=TokenizerSpec(type="char"))


def synthetic_batch(
    vocab: int, rows: int = 16, length: int = 128, prompt: int = 16
) -> list[Sample]:
    """Groups of 4 samples with random tokens, rewards and behaviour logprobs (seeded)."""
    rng = np.random.default_rng(0)
    mask = np.r_[np.zeros(prompt), np.ones(length - prompt)].astype(np.uint8)
    return [
        Sample(
            policy="p",
            task_id=f"t{i // 4}",
            group_id=f"g{i // 4}",
            token_ids=rng.integers(4, vocab, length).astype(np.int32),
            loss_mask=mask,
            logprobs=(-rng.random(length) * mask).astype(np.float32),
            versions=np.where(mask == 1, 0, -1).astype(np.int32),
            reward=float(rng.random()),
        )
        for i in range(rows)
    ]


def measure(backend: TrainBackend, values: dict[str, Any], steps: int, rows: int,
            length: int) -> dict[str, float]:  # fmt: skip
    """Median step time of the real update on ``backend``; trained tokens per second."""
    spec = spec_for(values)
    model = backend.wrap(build_model(spec, build_tokenizer(spec)))
    params = sum(p.numel() for p in model.parameters())  # DTensors count their full size
    opt = build_optimizer(model, OptimizerConfig(lr=1e-5))
    update = PolicyUpdate(backend, model, opt, LossConfig(tis_cap=2.0), Packing(8192, 0),
                          grad_clip=1.0)  # fmt: skip
    batch = synthetic_batch(int(values["vocab_size"]), rows, length)
    trained = sum(s.num_generated for s in batch)
    update.run(batch)  # warm-up (allocator, autotuning)
    times = []
    for _ in range(steps):
        if backend.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        update.run(batch)
        if backend.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return {"params_m": params / 1e6, "step_s": step_s, "tokens_per_s": trained / step_s}


def run_fsdp(name: str, steps: int, device: str, nproc: int = 2) -> dict[str, float] | None:
    """The same measurement under ``torchrun --nproc-per-node 2`` (this script, worker mode)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1", f"--master-port={port}", __file__,
        "--worker", name, "--steps", str(steps), "--device", device,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, float] = json.loads(line.removeprefix("RESULT "))
            return result
    print(f"  fsdp2 run failed for {name}:\n{proc.stderr[-2000:]}", file=sys.stderr)
    return None


def worker(name: str, steps: int, device: str) -> None:
    """torchrun worker: FSDP2 backend, print the result on rank 0."""
    from astraflow.trainer.backends.fsdp2 import FSDP2Backend

    backend = FSDP2Backend(device=device)
    values = GPU_MODEL if name == "0.5B" else CPU_MODELS[name]
    rows, length = (8, 512) if name == "0.5B" else (16, 128)
    result = measure(backend, values, steps, rows, length)
    if backend.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    backend.close()


def row(name: str, backend: str, r: dict[str, float] | None, base: dict[str, float]) -> str:
    if r is None:
        return f"{name:<10} {backend:<14} {'failed':>10}"
    ratio = r["tokens_per_s"] / base["tokens_per_s"]
    return (f"{name:<10} {backend:<14} {r['params_m']:>8.1f}M {r['step_s']:>9.3f}s "
            f"{r['tokens_per_s']:>11.0f} {ratio:>7.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 steps, tiny model only")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per setting")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = args.steps or (3 if args.quick else 10)
    if args.worker:
        worker(args.worker, steps, args.device)
        return
    from astraflow.trainer.backends.local import LocalBackend

    print(f"trainer step: 16 samples x 128 tokens (112 trained), GRPO + TIS, AdamW, "
          f"median of {steps} steps; torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} threads single-process, 1 per FSDP2 rank")  # fmt: skip
    header = (
        f"{'model':<10} {'backend':<14} {'params':>9} {'step':>10} {'tokens/s':>11} {'ratio':>8}"
    )
    print(header)
    print("-" * len(header))
    models = ["tiny-0.4M"] if args.quick else list(CPU_MODELS)
    for name in models:
        base = measure(LocalBackend("cpu"), CPU_MODELS[name], steps, 16, 128)
        print(row(name, "local (CPU)", base, base), flush=True)
        print(row(name, "fsdp2 x2 (CPU)", run_fsdp(name, steps, "cpu"), base), flush=True)
    if not torch.cuda.is_available():
        print("GPU: skipped (no CUDA device here): 0.5B bf16 runs when one is available")
        return
    print("GPU, 0.5B (Qwen2.5-0.5B shape, random init), bf16, 8 samples x 512 tokens:")
    base = measure(LocalBackend("cuda"), GPU_MODEL, steps, 8, 512)
    print(row("0.5B", "local (GPU)", base, base), flush=True)
    if torch.cuda.device_count() >= 2:
        print(row("0.5B", "fsdp2 x2 (GPU)", run_fsdp("0.5B", steps, "cuda"), base))
    else:
        print("  fsdp2 x2 (GPU): skipped (needs 2 GPUs)")


if __name__ == "__main__":
    main()
