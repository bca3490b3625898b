"""What the shipped single-agent text environments share: a config that states ``max_turns``,
one episode at a time, the turn count, truncation and the end-of-episode ``info``.

A subclass names its ``Config`` (a ``ConfigModel`` with a ``max_turns`` field) and a ``label``
for its messages; the class-level ``max_turns`` that :func:`~astraflow.envs.protocol.env_traits`
reads is that field's default, an instance's is its config's. ``step`` brackets an action
with :meth:`TurnLimitedEnv._take_turn` and :meth:`TurnLimitedEnv._end_turn`.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from pydantic import BaseModel

from astraflow.envs.protocol import DEFAULT_MAX_TURNS, SUCCESS, ActionFormat

__all__ = ["TurnLimitedEnv"]


class _TurnLimits(Protocol):
    @property
    def max_turns(self) -> int:
        """Actions per episode before it is truncated."""
        ...


EnvConfigT = TypeVar("EnvConfigT", bound=_TurnLimits)


class TurnLimitedEnv(Generic[EnvConfigT]):
    """Base of an environment whose config caps the actions per episode."""

    Config: type[EnvConfigT]
    label: ClassVar[str]
    """Name in the environment's error messages."""
    max_turns: int = DEFAULT_MAX_TURNS
    action_format: ClassVar[ActionFormat] = "text"
    concurrent_sessions: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        config_cls = cls.__dict__.get("Config")
        if isinstance(config_cls, type) and issubclass(config_cls, BaseModel):
            cls.max_turns = config_cls.model_fields["max_turns"].default

    def __init__(self, config: EnvConfigT | None = None, rng: random.Random | None = None):
        self.config: EnvConfigT = config or self.Config()
        self.max_turns = self.config.max_turns
        self.turns = 0
        self.done = True

    def _start_episode(self) -> None:
        self.turns = 0
        self.done = False

    def _take_turn(self, started: bool = True) -> None:
        """Count one action; an error when no episode is running."""
        if self.done or not started:
            raise RuntimeError(f"{self.label}: the episode is over; call reset()")
        self.turns += 1

    def _end_turn(self, terminated: bool, success: bool, info: dict[str, Any]) -> bool:
        """Whether the action truncates the episode; at the episode's end, mark it done and
        record ``info[SUCCESS]``."""
        truncated = not terminated and self.turns >= self.max_turns
        self.done = terminated or truncated
        if self.done:
            info[SUCCESS] = success
        return truncated

    def close(self) -> None:
        """Nothing to release."""
