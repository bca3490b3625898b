"""FSDP2 backend: ``fully_shard`` per decoder layer + root, gloo on CPU, NCCL on GPUs.

One process per rank (``torchrun``; a lone process forms a group of one). Parameters stay
fp32 DTensor shards (the master weights); on GPU the forward/backward run in bf16
(``MixedPrecisionPolicy``) with fp32 gradient reduction. Rank 0 does all I/O: the batch comes
to the other ranks as the msgpack bytes of the record (no pickle), and the state dict to
publish is gathered to rank 0 one tensor at a time.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from astraflow.trainer.backends.local import host_copy, resolve_device

__all__ = ["FSDP2Backend"]

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FSDP2Backend:
    """Data-parallel training with the model sharded over all ranks of the process group."""

    def __init__(self, device: str = "auto", bf16: bool = True, timeout_s: float = 1800.0) -> None:
        self._owns_group = not dist.is_initialized()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = resolve_device(device, local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self._owns_group:
            kind = "nccl" if self.device.type == "cuda" else "gloo"
            timeout = datetime.timedelta(seconds=timeout_s)
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                dist.init_process_group(kind, timeout=timeout)
            else:  # not under torchrun: a group of one
                dist.init_process_group(
                    kind,
                    init_method=f"tcp://127.0.0.1:{_free_port()}",
                    rank=0,
                    world_size=1,
                    timeout=timeout,
                )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.autocast_dtype: torch.dtype | None = None  # mixed precision is FSDP's job here
        self._mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.device.type == "cuda" and bf16
            else MixedPrecisionPolicy()
        )
        log.info("fsdp2 rank=%d world_size=%d device=%s", self.rank, self.world_size, self.device)

    def wrap(self, model: nn.Module, *, trainable: bool = True) -> nn.Module:
        """Shard every block named in the model's ``_no_split_modules``, then the root."""
        model = model.to(device=self.device, dtype=torch.float32)
        if not trainable:
            model.requires_grad_(False).eval()
        blocks = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if module is not model and type(module).__name__ in blocks:
                fully_shard(module, mp_policy=self._mp)
        fully_shard(model, mp_policy=self._mp)
        return model

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum over ranks."""
        out = tensor.to(self.device).clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Broadcast a byte string from rank 0: its length, then its bytes."""
        if self.rank == 0 and data is None:
            raise ValueError("rank 0 must pass the bytes to broadcast")
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.long)
        size = size.to(self.device)
        dist.broadcast(size, src=0)
        n = int(size.item())
        if self.rank == 0:
            assert data is not None
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0)
            buf = buf.to(device=self.device, dtype=torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        if n:
            dist.broadcast(buf, src=0)
        return data if self.rank == 0 and data is not None else bytes(buf.cpu().numpy())

    def full_state_dict(self, model: nn.Module, dtype: torch.dtype) -> dict[str, Tensor]:
        """Gather each sharded tensor in state-dict order; rank 0 keeps host copies."""
        out: dict[str, Tensor] = {}
        for name, tensor in model.state_dict().items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if self.rank == 0:
                out[name] = host_copy(full, dtype)
        return out

    def close(self) -> None:
        """Destroy the process group if this backend created it."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
