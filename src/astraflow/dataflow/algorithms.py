"""The service's data-algorithm plug-ins (selector, filters, sampler) and their durable state.

    PluginSet(config) ──► load(store)  at start-up, and after a failed change
                      ──► save(store)  at the end of every change: the states that changed

Each plug-in's ``state_dict`` is stored under meta ``plugin.<place>`` with its type; a saved
state of another plug-in type (the config changed) is ignored with a warning.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from astraflow.data_algorithms import FILTERS, SAMPLERS, SELECTORS
from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.store import Store
from astraflow.plugins import PluginSpec

__all__ = ["PluginSet"]

log = logging.getLogger(__name__)


def _spec_name(spec: PluginSpec | str) -> str:
    return spec if isinstance(spec, str) else spec.type


class PluginSet:
    """The configured plug-ins by place: ``selector``, ``filter.<i>``, ``sampler``."""

    def __init__(self, config: DataflowConfig) -> None:
        self.selector = SELECTORS.build(config.selector, seed=config.seed)
        self.filters = [FILTERS.build(f, seed=config.seed) for f in config.filters]
        self.sampler = SAMPLERS.build(config.sampler, seed=config.seed)
        self.places: dict[str, tuple[str, Any]] = {
            "selector": (_spec_name(config.selector), self.selector)
        }
        for i, (spec, f) in enumerate(zip(config.filters, self.filters, strict=True)):
            self.places[f"filter.{i}"] = (_spec_name(spec), f)
        self.places["sampler"] = (_spec_name(config.sampler), self.sampler)
        self._saved: dict[str, str] = {}

    def __getitem__(self, place: str) -> tuple[str, Any]:
        """(type name, plug-in) at ``place``."""
        return self.places[place]

    def load(self, store: Store) -> None:
        """Restore every plug-in's saved state."""
        self._saved.clear()
        for where, (name, plugin) in self.places.items():
            saved = store.get_meta(f"plugin.{where}")
            if saved is None:
                continue
            if saved.get("type") != name:
                log.warning("plug-in changed, its saved state is ignored where=%s was=%s now=%s",
                            where, saved.get("type"), name)  # fmt: skip
                continue
            plugin.load_state_dict(saved["state"])
            self._saved[where] = json.dumps(saved["state"], sort_keys=True)

    def save(self, store: Store) -> None:
        """Store the states that changed since they were last loaded or saved."""
        for where, (name, plugin) in self.places.items():
            state = plugin.state_dict()
            text = json.dumps(state, sort_keys=True)
            if self._saved.get(where) != text:
                store.set_meta(f"plugin.{where}", {"type": name, "state": state})
                self._saved[where] = text

    def metrics(self) -> dict[str, dict[str, float]]:
        """Each plug-in's ``metrics()`` by place."""
        return {where: plugin.metrics() for where, (_, plugin) in self.places.items()}
