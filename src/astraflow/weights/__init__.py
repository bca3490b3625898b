"""The weight store: versioned weights per policy, full snapshots and bit-exact sparse deltas.

Trainers write with :class:`WeightStore` (``publish`` returns a future; announce the version
when it resolves); nodes read with :class:`WeightClient` (``pull`` updates tensors in place by
the cheapest path). The store is a directory (or fsspec URL) served over HTTP by
``astraflow weights serve``. Layout and wire: ``docs/interfaces.md`` section 2.

The names that need torch (``WeightStore``, ``WeightClient``, ``SafetensorsFile``) are
imported on first use, so serving a store (``weights.server``) runs without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from astraflow.weights.config import WeightStoreConfig
from astraflow.weights.manifest import TensorEntry, WeightManifest, manifest_ref

if TYPE_CHECKING:
    from astraflow.weights.client import PullStats, WeightClient
    from astraflow.weights.store import WeightStore
    from astraflow.weights.tensors import SafetensorsFile

__all__ = [
    "PullStats",
    "SafetensorsFile",
    "TensorEntry",
    "WeightClient",
    "WeightManifest",
    "WeightStore",
    "WeightStoreConfig",
    "manifest_ref",
]

_TORCH_NAMES = {
    "PullStats": "astraflow.weights.client",
    "WeightClient": "astraflow.weights.client",
    "WeightStore": "astraflow.weights.store",
    "SafetensorsFile": "astraflow.weights.tensors",
}


def __getattr__(name: str) -> Any:
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'astraflow.weights' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
