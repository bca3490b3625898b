"""The ``curriculum`` selector: levels of a task field, easiest first, opened by reward.

    level 0 ──(mean reward of the last `window` groups >= advance_at, or level used up)──►
    level 1 ──► ... ──► last level ──(used up)──► source exhausted

Rows within a level come in a seeded permutation per pass; state is the current level, a
cursor per level and the reward window.
"""

from __future__ import annotations

import random
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.data_algorithms import SELECTORS
from astraflow.data_algorithms.protocols import GroupResult, SourceView, TaskCatalog, TaskRef
from astraflow.data_algorithms.selectors import Cursor, Interleave, permutation
from astraflow.errors import PluginError

__all__ = ["CurriculumConfig", "CurriculumSelector"]


class CurriculumConfig(ConfigModel):
    """Arguments of the ``curriculum`` selector."""

    field: str
    """Task field whose value sets a row's level (e.g. ``difficulty``); rows sort by it."""
    descending: bool = False
    """Start from the largest value instead of the smallest."""
    shuffle: bool = True
    """Shuffle rows within a level (each pass anew)."""
    advance_at: float = 0.8
    """Mean reward over the last ``window`` groups of the current level that opens the next."""
    window: int = Field(default=32, ge=1)
    """Groups of the current level averaged for ``advance_at``."""
    policy: str | None = None
    """Only this policy's groups count (None: every policy's)."""


@dataclass
class _Ladder:
    members: list[list[int]]
    level_of: dict[str, int]
    current: int = 0
    cursors: dict[int, Cursor] = field(default_factory=dict)
    window: deque[float] = field(default_factory=deque)


@SELECTORS.register("curriculum")
class CurriculumSelector:
    """Levels by a task field; the next level opens on reward (or when a level is used up)."""

    Config = CurriculumConfig

    def __init__(self, config: CurriculumConfig, rng: random.Random) -> None:
        self.config = config
        self.seed = rng.getrandbits(63)
        self.interleave = Interleave()
        self.ladders: dict[str, _Ladder] = {}
        self._pending: dict[str, Any] = {}
        self.advanced = 0

    def _ladder(self, catalog: TaskCatalog, src: SourceView) -> _Ladder:
        ladder = self.ladders.get(src.name)
        if ladder is None:
            ladder = self._build(catalog, src)
            saved = self._pending.pop(src.name, None)
            if saved:
                ladder.current = int(saved["current"])
                ladder.cursors = {int(k): Cursor(*v) for k, v in saved["cursors"].items()}
                ladder.window = deque(saved["window"], maxlen=self.config.window)
            self.ladders[src.name] = ladder
        return ladder

    def _build(self, catalog: TaskCatalog, src: SourceView) -> _Ladder:
        key = self.config.field
        values: list[Any] = []
        for i in range(src.size):
            row = catalog.row(src.name, i)
            if key not in row:
                raise PluginError(
                    f"curriculum field {key!r} is missing from row "
                    f"{catalog.row_id(src.name, i)!r} of source {src.name!r}"
                )
            values.append(row[key])
        try:
            levels = sorted(set(values), reverse=self.config.descending)
        except TypeError as exc:
            raise PluginError(
                f"curriculum field {key!r} of source {src.name!r} has values that cannot be "
                f"ordered: {exc}"
            ) from exc
        rank = {v: i for i, v in enumerate(levels)}
        members: list[list[int]] = [[] for _ in levels]
        level_of: dict[str, int] = {}
        for i, v in enumerate(values):
            members[rank[v]].append(i)
            level_of[catalog.row_id(src.name, i)] = rank[v]
        return _Ladder(members, level_of, window=deque(maxlen=self.config.window))

    def _exhausted(self, catalog: TaskCatalog) -> Callable[[SourceView], bool]:
        def exhausted(src: SourceView) -> bool:
            ladder = self._ladder(catalog, src)
            while ladder.current < len(ladder.members):
                c = ladder.cursors.get(ladder.current)
                if src.epochs is None or c is None or c.epoch < src.epochs:
                    return False
                ladder.current += 1
                ladder.window.clear()
            return True

        return exhausted

    def select(self, catalog: TaskCatalog, n: int) -> list[TaskRef]:
        """Up to ``n`` tasks from the current level of each source."""
        for view in catalog.sources.values():
            self._ladder(catalog, view)  # validates the field on every source
        out: list[TaskRef] = []
        exhausted = self._exhausted(catalog)
        while len(out) < n:
            src = self.interleave.pick(catalog, exhausted)
            if src is None:
                break
            ladder = self.ladders[src.name]
            level = ladder.current
            rows = ladder.members[level]
            c = ladder.cursors.setdefault(level, Cursor())
            pos = c.pos
            if self.config.shuffle:
                pos = permutation(len(rows), f"{self.seed}:{src.name}:{level}:{c.epoch}")[c.pos]
            out.append(TaskRef(src.name, rows[pos], c.epoch))
            c.pos += 1
            if c.pos >= len(rows):
                c.epoch, c.pos = c.epoch + 1, 0
            self.interleave.count(src.name)
        return out

    def feedback(self, result: GroupResult) -> None:
        """Average rewards at the current level; open the next level at ``advance_at``."""
        if self.config.policy is not None and result.policy != self.config.policy:
            return
        ladder = self.ladders.get(result.source)
        if ladder is None or ladder.level_of.get(result.row_id) != ladder.current:
            return
        ladder.window.append(statistics.fmean(result.rewards) if result.rewards else 0.0)
        full = len(ladder.window) >= self.config.window
        if full and statistics.fmean(ladder.window) >= self.config.advance_at:
            if ladder.current + 1 < len(ladder.members):
                ladder.current += 1
                self.advanced += 1
            ladder.window.clear()

    def state_dict(self) -> dict[str, Any]:
        """Seed, current level, cursors per level and the reward window, per source."""
        sources = {
            name: {
                "current": lad.current,
                "cursors": {str(k): [c.epoch, c.pos] for k, c in lad.cursors.items()},
                "window": list(lad.window),
            }
            for name, lad in self.ladders.items()
        }
        sources.update(self._pending)
        return {
            "seed": self.seed,
            "issued": dict(self.interleave.issued),
            "advanced": self.advanced,
            "sources": sources,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore; levels are rebuilt from the catalogue on the next ``select``."""
        self.seed = int(state.get("seed", self.seed))
        self.interleave.issued = {k: int(v) for k, v in state.get("issued", {}).items()}
        self.advanced = int(state.get("advanced", 0))
        self.ladders = {}
        self._pending = dict(state.get("sources", {}))

    def metrics(self) -> dict[str, float]:
        """Levels opened by reward, and the highest current level."""
        top = max((lad.current for lad in self.ladders.values()), default=0)
        return {"levels_advanced": float(self.advanced), "max_level": float(top)}
