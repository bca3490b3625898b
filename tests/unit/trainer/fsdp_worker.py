"""Worker of the FSDP2 equivalence test: run under ``torchrun --nproc-per-node 2``.

Trains the tiny model on the scripted batches with the FSDP2 backend (gloo, CPU), then
writes (rank 0) the full fp32 weights, the bf16 tensors a publish would send, the per-step
stats, and a checkpoint, into the directory given as the only argument.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from astraflow.models import build_tokenizer
from astraflow.trainer.backends.fsdp2 import FSDP2Backend
from astraflow.trainer.checkpoint import save_checkpoint
from fixtures.models import tiny_spec
from fixtures.trainer import comparison_update, scripted_batches


def main(out: Path) -> None:
    torch.set_num_threads(1)
    backend = FSDP2Backend(device="cpu")
    tok = build_tokenizer(tiny_spec())
    update = comparison_update(backend, tok)
    model, opt, sched = update.model, update.optimizer, update.scheduler
    stats = [update.run(batch, v) for v, batch in enumerate(scripted_batches(tok))]
    full = backend.full_state_dict(model, torch.float32)
    published = backend.full_state_dict(model, torch.bfloat16)
    save_checkpoint(out / "ckpt", backend=backend, model=model, optimizer=opt, scheduler=sched,
                    version=2, meta={}, keep=1)  # fmt: skip
    if backend.rank == 0:
        save_file({k: v.clone() for k, v in full.items()}, out / "weights.safetensors")
        save_file({k: v.clone() for k, v in published.items()}, out / "published.safetensors")
        (out / "stats.json").write_text(json.dumps(stats))
    backend.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
