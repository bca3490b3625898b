"""The OpenEnv wire format, as JSON bodies (never pickles): what server and client exchange.

    POST /reset  {"seed"?, "episode_id"?, "options"?}        → StepReply (reward null)
    POST /step   {"episode_id", "action": {"message": str}}  → StepReply
    POST /close  {"episode_id"}                              → {"closed": true}
    GET  /state?episode_id=…                                 → {"episode_id", "step_count", …}
    GET  /health                                             → {"status": "healthy", traits…}
    GET  /schema                                             → JSON schemas of the bodies

A reply is OpenEnv's ``{"observation": {...}, "reward", "done"}``: the observation carries
``text`` (or chat ``messages``) and ``metadata`` (the environment's info dict); ``truncated``
and ``episode_id`` ride beside ``done`` (terminated = done and not truncated).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ActionBody",
    "CloseRequest",
    "ObservationBody",
    "ResetRequest",
    "StepReply",
    "StepRequest",
]

#: Longest accepted session id, and action text.
MAX_ID_CHARS = 128
MAX_ACTION_CHARS = 65536


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ResetRequest(BaseModel):
    """Body of ``POST /reset`` (extra keys, which OpenEnv clients may send, are ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    seed: int | None = None
    """Episode seed."""
    episode_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    """Session to (re)start; none: the server opens a new one and returns its id."""
    options: dict[str, Any] | None = None
    """The environment's reset options."""


class ActionBody(BaseModel):
    """An action: OpenEnv text environments send ``{"message": ...}``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    message: str = Field(max_length=MAX_ACTION_CHARS)
    """The action text."""


class StepRequest(BaseModel):
    """Body of ``POST /step``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    action: ActionBody
    """The action."""
    episode_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    """Session the action belongs to."""


class CloseRequest(_Wire):
    """Body of ``POST /close``."""

    episode_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    """Session to close."""


class ObservationBody(_Wire):
    """An observation, OpenEnv-style."""

    text: str | None = None
    """Text observation."""
    messages: list[dict[str, Any]] | None = None
    """Chat observation."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """The environment's info dict."""
    done: bool = False
    """Whether the episode ended."""
    reward: float | None = None
    """Reward of the step (None after reset)."""


class StepReply(_Wire):
    """Reply of ``/reset`` and ``/step``."""

    observation: ObservationBody
    """What the agent sees."""
    reward: float | None = None
    """Reward of the step (None after reset)."""
    done: bool = False
    """Terminated or truncated."""
    truncated: bool = False
    """Ended by a limit rather than by the task."""
    episode_id: str
    """Session id (send it with every step)."""
