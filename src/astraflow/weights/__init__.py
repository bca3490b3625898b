"""The weight store: versioned weights per policy, full snapshots and bit-exact sparse deltas.

Trainers write with :class:`WeightStore` (``publish`` returns a future; announce the version
when it resolves); nodes read with :class:`WeightClient` (``pull`` updates tensors in place by
the cheapest path). The store is a directory (or fsspec URL) served over HTTP by
``astraflow weights serve``. Layout and wire: ``docs/interfaces.md`` section 2.
"""

from astraflow.weights.client import PullStats, WeightClient
from astraflow.weights.manifest import TensorEntry, WeightManifest, manifest_ref
from astraflow.weights.store import WeightStore, WeightStoreConfig
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
