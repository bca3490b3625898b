"""Trainer backends: ``local`` (one process) and ``fsdp2`` (torchrun, gloo / NCCL)."""

from astraflow.trainer.backends.base import TrainBackend, build_backend

__all__ = ["TrainBackend", "build_backend"]
