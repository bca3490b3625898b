"""Single-process backend: the whole model on the CPU or on one GPU (bf16 autocast there)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from astraflow.errors import ConfigError

__all__ = ["LocalBackend", "host_copy", "resolve_device"]


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """``auto`` → CUDA when available, else CPU; ``cuda`` without a GPU is a ConfigError."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device: cuda was asked for but no CUDA device is available")
    return torch.device("cuda", local_rank)


def host_copy(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """A contiguous host copy, floating point cast to ``dtype`` (integers keep theirs)."""
    target = dtype if tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to(device="cpu", dtype=target, copy=True).contiguous()


class LocalBackend:
    """Rank 0 of 1: no collectives; a bf16 autocast on GPU."""

    def __init__(self, device: str = "auto", bf16: bool = True) -> None:
        self.rank = 0
        self.world_size = 1
        self.device = resolve_device(device)
        self.autocast_dtype = torch.bfloat16 if self.device.type == "cuda" and bf16 else None

    def wrap(self, model: nn.Module, *, trainable: bool = True) -> nn.Module:
        """Move ``model`` to the device (fp32 master weights)."""
        model = model.to(device=self.device, dtype=torch.float32)
        if not trainable:
            model.requires_grad_(False).eval()
        return model

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Nothing to reduce with one rank."""
        return tensor

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's data is everyone's data."""
        if data is None:
            raise ValueError("rank 0 must pass the bytes to broadcast")
        return data

    def full_state_dict(self, model: nn.Module, dtype: torch.dtype) -> dict[str, Tensor]:
        """The state dict, floating point cast to ``dtype`` (uncast tensors alias the model)."""
        out = {}
        for name, t in model.state_dict().items():
            out[name] = t.detach().to(dtype) if t.is_floating_point() else t.detach()
        return out

    def close(self) -> None:
        """Nothing to release."""
