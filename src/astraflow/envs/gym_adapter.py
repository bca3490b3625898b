"""``gymnasium``: any ``gymnasium.Env`` whose observations are text, as an environment.

    env: {type: gymnasium, id: "MyText-v0", kwargs: {level: 2}}            # gymnasium.make
    env: {type: gymnasium, entry_point: "my_pkg.games:Maze"}               # a class, directly
    env: {type: gymnasium, id: "Grid-v0", action_names: [up, down, left, right]}

Observations must be ``str`` (a ``spaces.Text`` observation space) unless ``stringify`` is
set. Actions: with a ``spaces.Text`` action space the text goes to the environment as is;
with ``spaces.Discrete(n)`` and ``action_names`` (n names) the name is mapped to its index,
the names are the admissible actions, and an unknown name is an invalid action that leaves
the environment untouched. ``max_turns`` is the spec's ``max_episode_steps`` when it has one.
"""

from __future__ import annotations

import importlib
import random
from typing import Any, ClassVar

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.envs.protocol import (
    ADMISSIBLE_ACTIONS,
    DEFAULT_MAX_TURNS,
    INVALID_ACTION,
    StepResult,
)
from astraflow.envs.registry import ENVS
from astraflow.errors import ConfigError
from astraflow.records import exactly_one

__all__ = ["GymEnv", "GymEnvConfig"]


class GymEnvConfig(ConfigModel):
    """Config of ``gymnasium``."""

    id: str | None = None
    """A registered gymnasium id (``gymnasium.make``)."""
    entry_point: str | None = Field(default=None, pattern=r"^[\w.]+:\w+$")
    """Or a ``package.module:Class`` to instantiate directly."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment."""
    action_names: list[str] | None = None
    """Names of a ``Discrete`` action space's actions, in index order."""
    stringify: bool = False
    """Turn non-text observations into text with ``str()`` (else they are an error)."""
    max_turns: int | None = Field(default=None, ge=1)
    """Most actions per episode (default: the spec's max_episode_steps, else 32)."""

    _one_source = exactly_one(
        "id", "entry_point", "gymnasium env needs exactly one of 'id' or 'entry_point'"
    )


@ENVS.register("gymnasium")
class GymEnv:
    """A text gymnasium environment behind the environment protocol."""

    Config = GymEnvConfig
    concurrent_sessions: ClassVar[bool] = True

    def __init__(self, config: GymEnvConfig, rng: random.Random) -> None:
        import gymnasium
        from gymnasium import spaces

        self.config = config
        if config.id is not None:
            self.env = gymnasium.make(config.id, **config.kwargs)
        else:
            module, _, name = str(config.entry_point).partition(":")
            self.env = getattr(importlib.import_module(module), name)(**config.kwargs)
        space = self.env.action_space
        self.names: list[str] | None = None
        if isinstance(space, spaces.Discrete):
            if config.action_names is None or len(config.action_names) != int(space.n):
                raise ConfigError(
                    f"gymnasium env has Discrete({space.n}) actions: give {space.n} action_names"
                )
            self.names = list(config.action_names)
            self.action_format = "admissible"
        elif isinstance(space, spaces.Text):
            self.action_format = "text"
        else:
            raise ConfigError(f"gymnasium env action space {space} is neither Text nor Discrete")
        spec = getattr(self.env, "spec", None)
        steps = getattr(spec, "max_episode_steps", None)
        self.max_turns = config.max_turns or (steps if isinstance(steps, int) else None)
        self.max_turns = self.max_turns or DEFAULT_MAX_TURNS
        self._last_obs = ""

    def _text(self, obs: Any) -> str:
        if isinstance(obs, str):
            return obs
        if self.config.stringify:
            return str(obs)
        raise TypeError(f"observation is {type(obs).__name__}, not text (set stringify: true)")

    def _info(self, info: Any) -> dict[str, Any]:
        out = dict(info or {})
        if self.names is not None:
            out[ADMISSIBLE_ACTIONS] = list(self.names)
        return out

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """``env.reset(seed=..., options=...)``."""
        obs, info = self.env.reset(seed=seed, options=options)
        self._last_obs = self._text(obs)
        return self._last_obs, self._info(info)

    def step(self, action: str) -> StepResult:
        """``env.step``, with the action text mapped to an index for Discrete spaces."""
        if self.names is not None:
            if action not in self.names:
                info = self._info({})
                info[INVALID_ACTION] = True
                return self._last_obs, 0.0, False, False, info
            obs, reward, terminated, truncated, info = self.env.step(self.names.index(action))
        else:
            obs, reward, terminated, truncated, info = self.env.step(action)
        self._last_obs = self._text(obs)
        return self._last_obs, float(reward), bool(terminated), bool(truncated), self._info(info)

    def close(self) -> None:
        """``env.close()``."""
        self.env.close()
