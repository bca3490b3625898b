"""Household pick-and-place games (stand in for ALFWorld), run by TextWorld.

Each episode loads one of the worlds compiled ahead of time into ``cache_dir``
(:mod:`astraflow.envs.household_worlds`; never compiled per episode) and draws a task::

    -= Kitchen =- ... You see a fridge. ...
    Your task is to: put the apple on the dining table.
    > open fridge / take apple from fridge / go east / put apple on dining table

Actions are TextWorld commands; ``info["admissible_actions"]`` lists the valid ones. Reward 1
(and the end of the episode) when the object is in or on the receptacle, judged from the game
state's facts. TextWorld game processes are kept per process and reused across episodes.
"""

from __future__ import annotations

import collections
import functools
import random
import threading
import warnings
from typing import Any

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.envs.holdout import choose, split_of
from astraflow.envs.household_worlds import World, load_worlds
from astraflow.envs.protocol import ADMISSIBLE_ACTIONS, INVALID_ACTION, StepResult
from astraflow.envs.registry import ENVS
from astraflow.envs.turns import TurnLimitedEnv

__all__ = ["Household", "HouseholdConfig"]

_POOL: dict[str, list[Any]] = collections.defaultdict(list)
_POOL_LOCK = threading.Lock()
_LOAD_LOCK = threading.Lock()  # TextWorld's game loading (its grammar parser) is not thread-safe


class HouseholdConfig(ConfigModel):
    """Where the compiled worlds are, and episode limits."""

    cache_dir: str = "runs/cache/household"
    """Directory of the worlds compiled ahead of time."""
    worlds: int = Field(default=8, ge=1, le=10000)
    """Worlds used (seeds ``first_seed`` ..)."""
    first_seed: int = Field(default=0, ge=0)
    """Seed of the first world."""
    max_turns: int = Field(default=20, ge=1, le=200)
    """Actions per episode before it is truncated."""
    list_actions: bool = False
    """Append the admissible commands to every observation (as ALFWorld prompts do)."""
    holdout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Share of tasks (world, object, receptacle) kept for ``options={"split": "eval"}``
    episodes (0: no split)."""


@functools.cache
def _worlds(cache_dir: str, worlds: int, first_seed: int) -> tuple[World, ...]:
    return tuple(load_worlds(cache_dir, worlds, first_seed))


@functools.cache
def _tasks(cache_dir: str, count: int, first_seed: int) -> list[tuple[str, str, str]]:
    """Every (world, object, receptacle) with the object not already there."""
    worlds = _worlds(cache_dir, count, first_seed)
    return [
        (w.name, o, r) for w in worlds for o in w.objects for r in sorted(w.receptacles)
        if w.places[o] != r
    ]  # fmt: skip


def _start(path: str) -> Any:
    with _POOL_LOCK:
        if _POOL[path]:
            return _POOL[path].pop()
    import textworld  # type: ignore[import-untyped]

    # no ``description``: TextWorld gets it by sending an extra "look" each step (2x the cost)
    infos = textworld.EnvInfos(admissible_commands=True, facts=True)
    with _LOAD_LOCK, warnings.catch_warnings():
        # jericho warns that it cannot track score of TextWorld games: we never read its score
        warnings.filterwarnings("ignore", message=".*is not fully supported")
        return textworld.start(path, infos)


def _release(path: str, game: Any) -> None:
    with _POOL_LOCK:
        _POOL[path].append(game)


def _clean(feedback: str) -> str:
    lines = [ln.rstrip() for ln in feedback.splitlines() if not ln.lstrip().startswith(">")]
    return "\n".join(ln for ln in lines if ln).strip()


@ENVS.register("household")
class Household(TurnLimitedEnv[HouseholdConfig]):
    """Put an object in or on a receptacle somewhere in a small house."""

    Config = HouseholdConfig
    label = "household"
    action_format = "admissible"

    def __init__(self, config: HouseholdConfig | None = None, rng: random.Random | None = None):
        super().__init__(config, rng)
        self.worlds = _worlds(self.config.cache_dir, self.config.worlds, self.config.first_seed)
        self.world = self.worlds[0]
        self.game: Any = None
        self.game_state: Any = None
        self.task = ("", "")

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """A world and a task drawn by ``seed``."""
        rng = random.Random(f"household-task:{seed}" if seed is not None else None)
        self._release()
        split, share = split_of(options), self.config.holdout
        cfg = self.config
        tasks = _tasks(cfg.cache_dir, cfg.worlds, cfg.first_seed)
        w, obj, rec = choose(rng, tasks, lambda t: ":".join(t), share, split)
        self.world = next(world for world in self.worlds if world.name == w)
        self.game = _start(self.world.path)
        self.game_state = self.game.reset()
        self.task = (obj, rec)
        self._start_episode()
        obj, rec = self.task
        prep = "in" if self.world.receptacles[rec][1] == "c" else "on"
        room = self.game_state.feedback[
            max(0, self.game_state.feedback.find("-= ")) :
        ]  # after the banner
        obs = f"{_clean(room)}\n\nYour task is to: put the {obj} {prep} the {rec}."
        return self._with_actions(obs), {ADMISSIBLE_ACTIONS: self._admissible()}

    def step(self, action: str) -> StepResult:
        """One TextWorld command."""
        self._take_turn(started=self.game is not None)
        command = " ".join(str(action).strip().lower().split())[:200]
        invalid = command not in self.game_state.admissible_commands
        if invalid:
            obs = "Nothing happens."
        else:
            self.game_state, _, _ = self.game.step(command)
            obs = _clean(self.game_state.feedback) or "Nothing happens."
        won = self._places().get(self.task[0]) == self.task[1]
        info: dict[str, Any] = {ADMISSIBLE_ACTIONS: self._admissible(), INVALID_ACTION: invalid}
        truncated = self._end_turn(won, won, info)
        if self.done:
            self._release()
        return self._with_actions(obs), 1.0 if won else 0.0, won, truncated, info

    def state(self) -> dict[str, Any]:
        """World, task and actions used (``GET /state``)."""
        return {"world": self.world.name, "task": list(self.task), "turns": self.turns}

    def close(self) -> None:
        """Give the game process back to the pool."""
        self._release()

    def _release(self) -> None:
        if self.game is not None:
            _release(self.world.path, self.game)
            self.game = None

    def _with_actions(self, obs: str) -> str:
        if not self.config.list_actions or self.game is None:
            return obs
        return f"{obs}\nAvailable actions: {', '.join(self._admissible())}"

    def _admissible(self) -> list[str]:
        return sorted(str(c) for c in self.game_state.admissible_commands)

    def _facts(self) -> list[tuple[str, list[str]]]:
        return [(f.name, [a.name for a in f.arguments]) for f in self.game_state.facts]

    def _places(self) -> dict[str, str]:
        """Object/receptacle → where it is (receptacle, room, or "I" when carried)."""
        return {args[0]: args[1] for name, args in self._facts() if name in ("in", "on", "at")}

    def _is_closed(self, receptacle: str) -> bool:
        return ("closed", [receptacle]) in self._facts()

    # ------------------------------------------------------------------ scripted agents

    def expert_action(self) -> str:
        """Fetch the object (opening what is closed), walk to the receptacle, put it there."""
        obj, rec = self.task
        where = self._places()
        here = where.get("P", "")
        holder = where.get(obj, "")
        if holder != "I":
            room = holder if holder in self.world.rooms else self.world.receptacles[holder][0]
            if room != here:
                return self._walk(here, room)
            if holder in self.world.rooms:
                return f"take {obj}"
            if self._is_closed(holder):
                return f"open {holder}"
            return f"take {obj} from {holder}"
        room, kind = self.world.receptacles[rec]
        if room != here:
            return self._walk(here, room)
        if kind == "c" and self._is_closed(rec):
            return f"open {rec}"
        return f"insert {obj} into {rec}" if kind == "c" else f"put {obj} on {rec}"

    def _walk(self, start: str, goal: str) -> str:
        """The first move of a shortest path (breadth-first over the room graph)."""
        first: dict[str, str] = {start: ""}
        queue = collections.deque([start])
        while queue:
            room = queue.popleft()
            for direction, other in sorted(self.world.rooms[room].items()):
                if other not in first:
                    first[other] = first[room] or direction
                    queue.append(other)
        return f"go {first.get(goal) or 'east'}"

    def valid_actions(self) -> list[str]:
        """The admissible commands (what a random agent picks from)."""
        return self._admissible()
