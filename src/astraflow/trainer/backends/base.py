"""The ``TrainBackend`` Protocol: where the model lives and how ranks talk to each other.

A backend places (and shards) the model, reduces across ranks, moves the batch from rank 0
to the others and gathers the full state dict to publish. The training step itself
(trainer/step.py) is the same code for every backend, so a rollout node cannot tell which
backend published a version: same names (HF state-dict keys), dtypes and layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from astraflow.trainer.config import TrainerConfig

__all__ = ["TrainBackend", "build_backend"]


@runtime_checkable
class TrainBackend(Protocol):
    """One process's view of data-parallel training (rank 0 does the I/O)."""

    rank: int
    world_size: int
    device: torch.device
    autocast_dtype: torch.dtype | None
    """Compute dtype for ``torch.autocast`` around the forward (None: no autocast)."""

    def wrap(self, model: nn.Module, *, trainable: bool = True) -> nn.Module:
        """Move (and shard) ``model`` for training; ``trainable=False`` for a frozen reference."""
        ...

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over ranks (returns the result on this rank's device)."""
        ...

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (other ranks pass None)."""
        ...

    def full_state_dict(self, model: nn.Module, dtype: torch.dtype) -> dict[str, Tensor]:
        """On rank 0, every tensor of ``model.state_dict()`` unsharded, floating point cast to
        ``dtype``; ``{}`` on other ranks. A collective: all ranks call. The tensors may alias
        live parameters or sit on the device: copy them before the next optimizer step (the
        weight store's ``publish`` does)."""
        ...

    def close(self) -> None:
        """Release the process group (if this backend created it)."""
        ...


def build_backend(config: TrainerConfig) -> TrainBackend:
    """The backend named by ``config.backend``."""
    if config.backend == "fsdp2":
        from astraflow.trainer.backends.fsdp2 import FSDP2Backend

        return FSDP2Backend(device=config.device, bf16=config.bf16)
    from astraflow.trainer.backends.local import LocalBackend

    return LocalBackend(device=config.device, bf16=config.bf16)
