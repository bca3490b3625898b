"""Built-in task selectors by order, and the pieces every selector shares.

    catalog ──► pick an eligible, unexhausted source (smooth weighted round robin)
                      │
                      ▼
    sequential  rows 0..n-1, pass after pass
    shuffled    a permutation per (seed, source, epoch): state is a seed and positions

Adaptive selectors live beside: ``curriculum.py`` and ``greso.py``. Every selector's
randomness is derived from its seed and the row, so a restarted service continues with the
same order.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from astraflow.data_algorithms import SELECTORS
from astraflow.data_algorithms.protocols import GroupResult, SourceView, TaskCatalog, TaskRef

__all__ = [
    "Cursor",
    "Interleave",
    "Orders",
    "SequentialSelector",
    "ShuffledSelector",
    "permutation",
]


@dataclass
class Cursor:
    epoch: int = 0
    pos: int = 0


def permutation(size: int, key: str) -> list[int]:
    order = list(range(size))
    random.Random(key).shuffle(order)
    return order


class Interleave:
    """Chooses the source of the next task: eligible, not exhausted, lowest issued/weight."""

    def __init__(self) -> None:
        self.issued: dict[str, int] = {}

    def pick(
        self, catalog: TaskCatalog, exhausted: Callable[[SourceView], bool]
    ) -> SourceView | None:
        best: SourceView | None = None
        best_score = float("inf")
        for src in catalog.sources.values():
            if not src.eligible or src.weight <= 0 or src.size == 0 or exhausted(src):
                continue
            score = (self.issued.get(src.name, 0) + 1) / src.weight
            if score < best_score:
                best, best_score = src, score
        return best

    def count(self, source: str) -> None:
        self.issued[source] = self.issued.get(source, 0) + 1


class Orders:
    """A cursor per source over a sequential or seeded-shuffled order of its rows."""

    def __init__(self, seed: int, shuffle: bool) -> None:
        self.seed = seed
        self.shuffle = shuffle
        self.cursors: dict[str, Cursor] = {}
        self._perm: dict[str, tuple[int, list[int]]] = {}

    def exhausted(self, src: SourceView) -> bool:
        c = self.cursors.get(src.name)
        return src.epochs is not None and c is not None and c.epoch >= src.epochs

    def advance(self, src: SourceView) -> TaskRef:
        c = self.cursors.setdefault(src.name, Cursor())
        index = c.pos
        if self.shuffle:
            cached = self._perm.get(src.name)
            if cached is None or cached[0] != c.epoch or len(cached[1]) != src.size:
                cached = (c.epoch, permutation(src.size, f"{self.seed}:{src.name}:{c.epoch}"))
                self._perm[src.name] = cached
            index = cached[1][c.pos]
        ref = TaskRef(src.name, index, c.epoch)
        c.pos += 1
        if c.pos >= src.size:
            c.epoch, c.pos = c.epoch + 1, 0
        return ref

    def state_dict(self) -> dict[str, list[int]]:
        return {name: [c.epoch, c.pos] for name, c in self.cursors.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.cursors = {name: Cursor(int(v[0]), int(v[1])) for name, v in state.items()}


class _OrderedSelector:
    """Base of the sequential and shuffled selectors: passes over each source in order."""

    shuffle = False

    def __init__(self, config: BaseModel, rng: random.Random) -> None:
        self.seed = rng.getrandbits(63)
        self.orders = Orders(self.seed, self.shuffle)
        self.interleave = Interleave()

    def select(self, catalog: TaskCatalog, n: int) -> list[TaskRef]:
        """Up to ``n`` tasks, interleaving sources by weight."""
        out: list[TaskRef] = []
        while len(out) < n:
            src = self.interleave.pick(catalog, self.orders.exhausted)
            if src is None:
                break
            out.append(self.orders.advance(src))
            self.interleave.count(src.name)
        return out

    def feedback(self, result: GroupResult) -> None:
        """Order-based selectors do not adapt."""

    def state_dict(self) -> dict[str, Any]:
        """Seed, a cursor per source and tasks issued per source."""
        return {
            "seed": self.seed,
            "cursors": self.orders.state_dict(),
            "issued": dict(self.interleave.issued),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore seed and positions."""
        self.seed = int(state.get("seed", self.seed))
        self.orders = Orders(self.seed, self.shuffle)
        self.orders.load_state_dict(state.get("cursors", {}))
        self.interleave.issued = {k: int(v) for k, v in state.get("issued", {}).items()}

    def metrics(self) -> dict[str, float]:
        """Tasks issued in total."""
        return {"issued": float(sum(self.interleave.issued.values()))}


@SELECTORS.register("sequential")
class SequentialSelector(_OrderedSelector):
    """Rows in source order, epoch after epoch."""


@SELECTORS.register("shuffled")
class ShuffledSelector(_OrderedSelector):
    """A fresh seeded permutation of each source per epoch."""

    shuffle = True
