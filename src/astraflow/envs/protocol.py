"""The environment protocol: gymnasium semantics with text, sync or async.

An environment is a class built from config like every plug-in (``cls(config, rng)``, with a
pydantic ``Config`` inner class for its keyword arguments) that runs one episode at a time::

    class Corridor:
        max_turns = 8                       # most actions per episode
        class Config(ConfigModel):          # keyword arguments from the run config
            length: int = 4
        def __init__(self, config, rng): ...
        def reset(self, seed=None, options=None) -> tuple[str, dict]: ...
        def step(self, action: str) -> tuple[str, float, bool, bool, dict]: ...
        def close(self) -> None: ...

``reset`` starts an episode (the same ``seed`` gives the same episode) and returns the first
observation, text or chat messages; ``step`` applies one action and returns ``(observation,
reward, terminated, truncated, info)``. Info keys with a meaning to the system are below
(:data:`ADMISSIBLE_ACTIONS`, :data:`SUCCESS`, :data:`INVALID_ACTION`); everything in info must
be JSON-serialisable, so the same class can be served over HTTP (``astraflow env serve``).

Async environments (remote ones, or ones that await I/O) implement ``areset``/``astep``/
``aclose`` instead or as well; :func:`as_async` gives every environment the async face the
``env`` workflow uses, running a sync one in a worker thread.

Optional class attributes (read with :func:`env_traits`, defaults in brackets):
``max_turns`` [32], ``action_format`` ["text": free text; "admissible": one of
``info["admissible_actions"]``], ``concurrent_sessions`` [True: several instances may run at
once in one process; False: the workflow and the server run one episode at a time].

Depends on ``astraflow.records``-level layers only: no torch, no component.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "ADMISSIBLE_ACTIONS",
    "INVALID_ACTION",
    "SUCCESS",
    "ActionFormat",
    "AsyncEnv",
    "AsyncEnvironment",
    "EnvTraits",
    "Environment",
    "Message",
    "Observation",
    "StepResult",
    "as_async",
    "check_reset",
    "check_step",
    "env_traits",
]

Message = Mapping[str, Any]
"""A chat message: ``{"role": ..., "content": ...}``."""

Observation = str | Sequence[Message]
"""What the agent sees: text, or chat messages (rendered with the policy's chat template)."""

StepResult = tuple[Observation, float, bool, bool, dict[str, Any]]
"""``(observation, reward, terminated, truncated, info)`` as gymnasium returns it."""

ActionFormat = Literal["text", "admissible"]

ADMISSIBLE_ACTIONS = "admissible_actions"
"""Info key: ``list[str]`` of the actions valid now, when the action set is finite."""
SUCCESS = "success"
"""Info key (last step): whether the episode reached its goal; absent: success = return > 0."""
INVALID_ACTION = "invalid_action"
"""Info key: True when the action could not be applied (counted in episode metrics)."""

DEFAULT_MAX_TURNS = 32


@runtime_checkable
class Environment(Protocol):
    """A text environment with gymnasium semantics; one episode at a time per instance."""

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Observation, dict[str, Any]]:
        """Start an episode; the same seed gives the same episode."""
        ...

    def step(self, action: str) -> StepResult:
        """Apply one action."""
        ...

    def close(self) -> None:
        """Release what the environment holds (processes, files)."""
        ...


@runtime_checkable
class AsyncEnvironment(Protocol):
    """The async face of an environment (remote environments are natively async)."""

    async def areset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Observation, dict[str, Any]]:
        """Start an episode."""
        ...

    async def astep(self, action: str) -> StepResult:
        """Apply one action."""
        ...

    async def aclose(self) -> None:
        """Release what the environment holds."""
        ...


@dataclass(frozen=True)
class EnvTraits:
    """What an environment class declares about itself."""

    max_turns: int
    """Most actions per episode (the workflow truncates there)."""
    action_format: ActionFormat
    """Free text, or one of ``info['admissible_actions']``."""
    concurrent_sessions: bool
    """Whether several instances may run episodes at once in one process."""


def env_traits(env: object) -> EnvTraits:
    """The traits an environment (class or instance) declares, with defaults."""
    max_turns = getattr(env, "max_turns", DEFAULT_MAX_TURNS)
    if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
        raise TypeError(f"{env!r}: max_turns must be a positive int, got {max_turns!r}")
    raw = getattr(env, "action_format", "text")
    fmt: ActionFormat
    if raw == "text":
        fmt = "text"
    elif raw == "admissible":
        fmt = "admissible"
    else:
        raise TypeError(f"{env!r}: action_format must be 'text' or 'admissible', got {raw!r}")
    concurrent = bool(getattr(env, "concurrent_sessions", True))
    return EnvTraits(max_turns=max_turns, action_format=fmt, concurrent_sessions=concurrent)


class AsyncEnv:
    """A sync :class:`Environment` behind the async face, each call in a worker thread.

    Calls of one instance are serialised; with ``exclusive`` (environments that declare
    ``concurrent_sessions = False``) all instances sharing that lock are, too.
    """

    def __init__(self, env: Environment, exclusive: threading.Lock | None = None) -> None:
        self.env = env
        self._exclusive = exclusive

    def _call(self, fn: Any, *args: Any) -> Any:
        if self._exclusive is None:
            return fn(*args)
        with self._exclusive:
            return fn(*args)

    async def areset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Observation, dict[str, Any]]:
        """``env.reset`` in a thread."""
        result: tuple[Observation, dict[str, Any]] = await asyncio.to_thread(
            self._call, self.env.reset, seed, options
        )
        return result

    async def astep(self, action: str) -> StepResult:
        """``env.step`` in a thread."""
        result: StepResult = await asyncio.to_thread(self._call, self.env.step, action)
        return result

    async def aclose(self) -> None:
        """``env.close`` in a thread."""
        await asyncio.to_thread(self._call, self.env.close)


def as_async(env: object, exclusive: threading.Lock | None = None) -> AsyncEnvironment:
    """``env`` itself when it is async, else a thread-backed :class:`AsyncEnv`."""
    if isinstance(env, AsyncEnvironment):
        return env
    if isinstance(env, Environment):
        return AsyncEnv(env, exclusive)
    raise TypeError(f"{type(env).__name__} implements neither Environment nor AsyncEnvironment")


def _check_observation(obs: Any, what: str) -> Observation:
    if isinstance(obs, str):
        return obs
    if isinstance(obs, Sequence) and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m for m in obs
    ):
        return [dict(m) for m in obs]
    raise TypeError(f"{what}: observation must be text or chat messages, got {type(obs).__name__}")


def _check_info(info: Any, what: str) -> dict[str, Any]:
    if info is None:
        return {}
    if not isinstance(info, Mapping):
        raise TypeError(f"{what}: info must be a dict, got {type(info).__name__}")
    actions = info.get(ADMISSIBLE_ACTIONS)
    if actions is not None and not (
        isinstance(actions, Sequence)
        and not isinstance(actions, str)
        and all(isinstance(a, str) for a in actions)
    ):
        raise TypeError(f"{what}: info['{ADMISSIBLE_ACTIONS}'] must be a list of strings")
    return dict(info)


def check_reset(result: Any) -> tuple[Observation, dict[str, Any]]:
    """A ``reset`` return value, checked: ``(observation, info)``."""
    if not isinstance(result, tuple) or len(result) != 2:
        raise TypeError(f"reset must return (observation, info), got {type(result).__name__}")
    return _check_observation(result[0], "reset"), _check_info(result[1], "reset")


def check_step(result: Any) -> StepResult:
    """A ``step`` return value, checked: 5 fields, a finite reward, boolean flags."""
    if not isinstance(result, tuple) or len(result) != 5:
        raise TypeError(
            "step must return (observation, reward, terminated, truncated, info), got "
            f"{type(result).__name__} of length {len(result) if isinstance(result, tuple) else '?'}"
        )
    obs, reward, terminated, truncated, info = result
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise TypeError(f"step: reward must be a number, got {type(reward).__name__}")
    if not math.isfinite(reward):
        raise ValueError(f"step: reward must be finite, got {reward}")
    return (
        _check_observation(obs, "step"),
        float(reward),
        bool(terminated),
        bool(truncated),
        _check_info(info, "step"),
    )
