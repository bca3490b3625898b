"""The ``greso`` selector: selective rollout, after GRESO ("Act Only When It Pays").

A prompt whose recent groups all had zero reward variance teaches GRPO nothing; it is offered
only with probability ``max(floor, decay ** run)``, ``run`` being its streak of zero-variance
groups, with separate floors for all-correct (easy) and all-wrong (hard) prompts. A group with
variance resets the streak. Skip decisions are derived from (seed, prompt, epoch), so they
survive a restart.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.data_algorithms import SELECTORS
from astraflow.data_algorithms.protocols import GroupResult, TaskCatalog, TaskRef
from astraflow.data_algorithms.selectors import Interleave, Orders

__all__ = ["GresoConfig", "GresoSelector"]


class GresoConfig(ConfigModel):
    """Arguments of the ``greso`` selector (selective rollout)."""

    decay: float = Field(default=0.5, gt=0.0, le=1.0)
    """Each further zero-variance group multiplies a prompt's chance of being offered by this."""
    easy_floor: float = Field(default=0.1, ge=0.0, le=1.0)
    """Lowest chance of offering a prompt whose recent groups were all correct."""
    hard_floor: float = Field(default=0.2, ge=0.0, le=1.0)
    """Lowest chance of offering a prompt whose recent groups were all wrong."""
    easy_reward: float = 0.5
    """A zero-variance group with mean reward at or above this counts as all correct."""
    eps: float = Field(default=1e-6, ge=0.0)
    """Rewards spread (max - min) at or below this counts as zero variance."""
    shuffle: bool = True
    """Visit rows in a seeded permutation per epoch (else in source order)."""


@SELECTORS.register("greso")
class GresoSelector:
    """Skip prompts whose recent groups all had zero reward variance, with growing odds."""

    Config = GresoConfig
    _MAX_VISITS = 4096
    """Rows examined per requested task before giving up for this call (bounds the work)."""

    def __init__(self, config: GresoConfig, rng: random.Random) -> None:
        self.config = config
        self.seed = rng.getrandbits(63)
        self.orders = Orders(self.seed, config.shuffle)
        self.interleave = Interleave()
        self.runs: dict[str, list[Any]] = {}
        """Prompt key -> [run of zero-variance groups, 'easy' | 'hard']."""
        self.offered = 0
        self.skipped = 0

    def offer_probability(self, key: str) -> float:
        """Chance that the prompt ``source/row_id`` is offered when its turn comes."""
        run, kind = self.runs.get(key, (0, "hard"))
        floor = self.config.easy_floor if kind == "easy" else self.config.hard_floor
        return max(floor, self.config.decay ** int(run))

    def select(self, catalog: TaskCatalog, n: int) -> list[TaskRef]:
        """Up to ``n`` tasks; prompts with zero-variance streaks are skipped for this epoch."""
        out: list[TaskRef] = []
        budget = self._MAX_VISITS * max(n, 1)
        while len(out) < n and budget > 0:
            src = self.interleave.pick(catalog, self.orders.exhausted)
            if src is None:
                break
            budget -= 1
            ref = self.orders.advance(src)
            key = f"{src.name}/{catalog.row_id(src.name, ref.index)}"
            p = self.offer_probability(key)
            if p < 1.0 and random.Random(f"{self.seed}:{key}:{ref.epoch}").random() >= p:
                self.skipped += 1
                continue
            self.offered += 1
            self.interleave.count(src.name)
            out.append(ref)
        return out

    def feedback(self, result: GroupResult) -> None:
        """Extend or reset the prompt's run of zero-variance groups."""
        if len(result.rewards) < 2:
            return
        key = f"{result.source}/{result.row_id}"
        if max(result.rewards) - min(result.rewards) > self.config.eps:
            self.runs.pop(key, None)
            return
        kind = "easy" if statistics.fmean(result.rewards) >= self.config.easy_reward else "hard"
        run = self.runs.get(key, [0, kind])
        self.runs[key] = [int(run[0]) + 1 if run[1] == kind else 1, kind]

    def state_dict(self) -> dict[str, Any]:
        """Seed, cursors, counters and the streaks of prompts that have one."""
        return {
            "seed": self.seed,
            "cursors": self.orders.state_dict(),
            "issued": dict(self.interleave.issued),
            "runs": dict(self.runs),
            "offered": self.offered,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.seed = int(state.get("seed", self.seed))
        self.orders = Orders(self.seed, self.config.shuffle)
        self.orders.load_state_dict(state.get("cursors", {}))
        self.interleave.issued = {k: int(v) for k, v in state.get("issued", {}).items()}
        self.runs = {k: [int(v[0]), str(v[1])] for k, v in state.get("runs", {}).items()}
        self.offered = int(state.get("offered", 0))
        self.skipped = int(state.get("skipped", 0))

    def metrics(self) -> dict[str, float]:
        """Prompts offered and skipped, and how many have a zero-variance streak."""
        total = self.offered + self.skipped
        return {
            "offered": float(self.offered),
            "skipped": float(self.skipped),
            "skip_rate": self.skipped / total if total else 0.0,
            "tracked_prompts": float(len(self.runs)),
        }
