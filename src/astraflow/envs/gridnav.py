"""``gridnav``: walk to a goal on a small grid — a multi-turn text game for tiny models.

The agent stands on cell ``x,y`` of a ``width`` × ``height`` grid and is told where the goal
is; each turn it answers one move (``n`` north = y+1, ``s``, ``e`` east = x+1, ``w``) and sees
where it stands now. It has ``distance + slack`` moves; reaching the goal gives reward 1 and
ends the episode (``progress_reward`` adds shaping: that much per move towards the goal, minus
as much per move away). A move off the grid or an unknown action wastes the turn (flagged
``invalid_action``). Observations are short (``goal 4,1 at 0,3 >``, then ``at 1,3 >``) so a
0.4M-parameter character model can play it; :meth:`GridNav.expert_action` is the scripted
expert the CPU recipe warms up from. ``info["success"]`` (last step) says whether it got there.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from astraflow.config import ConfigModel
from astraflow.envs.protocol import ADMISSIBLE_ACTIONS, INVALID_ACTION, SUCCESS, StepResult
from astraflow.envs.registry import ENVS

__all__ = ["GridNav", "GridNavConfig"]

MOVES: dict[str, tuple[int, int]] = {"n": (0, 1), "s": (0, -1), "e": (1, 0), "w": (-1, 0)}


class GridNavConfig(ConfigModel):
    """Config of ``gridnav``."""

    width: int = Field(default=5, ge=2, le=10)
    """Columns (x is one digit: 0..width-1)."""
    height: int = Field(default=5, ge=1, le=10)
    """Rows (y is one digit: 0..height-1)."""
    slack: int = Field(default=1, ge=0, le=20)
    """Moves allowed beyond the shortest path."""
    min_distance: int = Field(default=2, ge=1)
    """Shortest start-to-goal distance of an episode."""
    progress_reward: float = Field(default=0.0, ge=0.0, le=1.0)
    """Shaping: reward per move that brings the agent closer to the goal (minus as much per
    move away); reaching the goal adds 1 on top. 0: reward only at the goal."""
    view: Literal["absolute", "relative"] = "absolute"
    """What the agent is told: cells (``goal 4,1 at 0,3 >``, then ``at 1,3 >``) or the goal's
    offset from where it stands (``goal 4e 2s >`` every turn)."""
    holdout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Share of (start, goal) layouts kept for ``options={"split": "eval"}`` episodes;
    ``"train"`` episodes never see them (0: no split)."""

    @model_validator(mode="after")
    def _reachable(self) -> GridNavConfig:
        if self.min_distance > self.width + self.height - 2:
            raise ValueError(
                f"min_distance {self.min_distance} exceeds the grid's largest distance "
                f"{self.width + self.height - 2}"
            )
        return self


@ENVS.register("gridnav")
class GridNav:
    """Reach the goal cell within ``distance + slack`` moves."""

    Config = GridNavConfig
    max_turns: ClassVar[int] = 38
    action_format: ClassVar[str] = "admissible"
    concurrent_sessions: ClassVar[bool] = True

    def __init__(self, config: GridNavConfig, rng: random.Random) -> None:
        self.config = config
        self._rng = rng
        self.pos = (0, 0)
        self.goal = (0, 0)
        self.budget = 0
        self.steps = 0
        self.done = True

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """A new start and goal (from ``seed`` when given)."""
        rng = random.Random(seed) if seed is not None else self._rng
        cfg = self.config
        split = (options or {}).get("split")
        if split not in (None, "train", "eval"):
            raise ValueError(f"options.split must be 'train' or 'eval', got {split!r}")
        cells = [(x, y) for x in range(cfg.width) for y in range(cfg.height)]
        while True:
            self.pos, self.goal = rng.choice(cells), rng.choice(cells)
            if self.distance() < cfg.min_distance:
                continue
            if split is None or cfg.holdout == 0 or self._held_out() == (split == "eval"):
                break
        self.budget = self.distance() + cfg.slack
        self.steps = 0
        self.done = False
        if self.config.view == "relative":
            return self._relative(), self._info()
        obs = f"goal {self.goal[0]},{self.goal[1]} at {self.pos[0]},{self.pos[1]} >"
        return obs, self._info()

    def _relative(self) -> str:
        dx, dy = self.goal[0] - self.pos[0], self.goal[1] - self.pos[1]
        return f"goal {abs(dx)}{'e' if dx >= 0 else 'w'} {abs(dy)}{'n' if dy >= 0 else 's'} >"

    def _held_out(self) -> bool:
        key = f"{self.pos}{self.goal}".encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:4], "big") < self.config.holdout * 2**32

    def distance(self) -> int:
        """Moves left on the shortest path."""
        return abs(self.goal[0] - self.pos[0]) + abs(self.goal[1] - self.pos[1])

    def step(self, action: str) -> StepResult:
        """Apply one move."""
        if self.done:
            raise RuntimeError("step() after the episode ended; call reset()")
        self.steps += 1
        before = self.distance()
        move = MOVES.get(action.strip().lower())
        invalid = move is None
        if move is not None:
            x, y = self.pos[0] + move[0], self.pos[1] + move[1]
            if 0 <= x < self.config.width and 0 <= y < self.config.height:
                self.pos = (x, y)
            else:
                invalid = True
        won = self.pos == self.goal
        truncated = not won and self.steps >= self.budget
        self.done = won or truncated
        info = self._info()
        info[INVALID_ACTION] = invalid
        if self.done:
            info[SUCCESS] = won
        reward = (1.0 if won else 0.0) + self.config.progress_reward * (before - self.distance())
        if self.config.view == "relative":
            return self._relative(), reward, won, truncated, info
        return f"at {self.pos[0]},{self.pos[1]} >", reward, won, truncated, info

    def expert_action(self) -> str:
        """A shortest-path move (x first, then y)."""
        dx, dy = self.goal[0] - self.pos[0], self.goal[1] - self.pos[1]
        if dx:
            return "e" if dx > 0 else "w"
        if dy:
            return "n" if dy > 0 else "s"
        return "n"

    def state(self) -> dict[str, Any]:
        """Where the agent and goal are, and moves used."""
        return {
            "pos": list(self.pos),
            "goal": list(self.goal),
            "steps": self.steps,
            "budget": self.budget,
        }

    def close(self) -> None:
        """Nothing to release."""

    def _info(self) -> dict[str, Any]:
        return {ADMISSIBLE_ACTIONS: list(MOVES), "moves_left": self.budget - self.steps}
