"""Data algorithms: plug-ins at the three points of the data path (records only, no server).

Registries (``astraflow.plugins.Registry``; built-ins register on first lookup)::

    SELECTORS  before rollout     sequential, shuffled, curriculum, greso
    FILTERS    after rollout      dynamic_sampling, length
    SAMPLERS   at batch serving   fifo, freshest, edf, replay, mixing

A config names a plug-in by registry name or ``package.module:Class`` plus its arguments.
"""

from __future__ import annotations

from astraflow.data_algorithms.protocols import (
    BatchQuery,
    BatchSampler,
    GroupResult,
    GroupView,
    SourceView,
    TaskCatalog,
    TaskRef,
    TaskSelector,
    TrajectoryFilter,
)
from astraflow.plugins import Registry

__all__ = [
    "FILTERS",
    "SAMPLERS",
    "SELECTORS",
    "BatchQuery",
    "BatchSampler",
    "GroupResult",
    "GroupView",
    "SourceView",
    "TaskCatalog",
    "TaskRef",
    "TaskSelector",
    "TrajectoryFilter",
]

# mypy rejects a Protocol as type[T]; Registry only uses it for isinstance checks
SELECTORS: Registry[TaskSelector] = Registry(
    "selector",
    TaskSelector,
    (
        "astraflow.data_algorithms.selectors",
        "astraflow.data_algorithms.curriculum",
        "astraflow.data_algorithms.greso",
    ),
)
FILTERS: Registry[TrajectoryFilter] = Registry(
    "filter",
    TrajectoryFilter,
    ("astraflow.data_algorithms.filters",),
)
SAMPLERS: Registry[BatchSampler] = Registry(
    "sampler",
    BatchSampler,
    ("astraflow.data_algorithms.samplers",),
)
