"""Sessions of a served environment: one environment instance per episode, bounded in
number, each closed when its client closes it, when it stays idle too long, or at shutdown.

Calls of one session are serialised; every environment call runs in a worker thread under
a timeout (a session whose environment timed out or raised is closed: its state is unknown).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from astraflow.envs.protocol import (
    AsyncEnvironment,
    Observation,
    as_async,
    check_reset,
    check_step,
)
from astraflow.envs.registry import EnvFactory
from astraflow.envs.wire import ObservationBody, ResetRequest, StepReply, StepRequest
from astraflow.errors import (
    ConflictError,
    EnvError,
    NotFoundError,
    ServiceUnavailableError,
)

__all__ = ["Session", "SessionPool"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Session:
    """One episode's environment on the server."""

    episode_id: str
    env: AsyncEnvironment
    raw: Any
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    step_count: int = 0
    done: bool = False


def _observation(obs: Observation, info: dict[str, Any], reward: float | None, done: bool) -> Any:
    text = obs if isinstance(obs, str) else None
    messages = None if isinstance(obs, str) else [dict(m) for m in obs]
    return ObservationBody(text=text, messages=messages, metadata=info, done=done, reward=reward)


class SessionPool:
    """The sessions of one served environment."""

    def __init__(
        self,
        factory: EnvFactory,
        *,
        max_sessions: int,
        idle_timeout_s: float,
        call_timeout_s: float,
    ) -> None:
        self.factory = factory
        self.max_sessions = max_sessions if factory.traits.concurrent_sessions else 1
        self.idle_timeout_s = idle_timeout_s
        self.call_timeout_s = call_timeout_s
        self.sessions: dict[str, Session] = {}
        self.expired = 0
        self._guard = asyncio.Lock()

    async def _call(self, session: Session | None, call: Awaitable[T], what: str) -> T:
        try:
            return await asyncio.wait_for(call, self.call_timeout_s)
        except Exception as exc:
            if session is not None:
                await self.close(session.episode_id)
            if isinstance(exc, TimeoutError):
                raise EnvError(f"env {what} took longer than {self.call_timeout_s}s") from None
            raise EnvError(f"env {what} failed: {type(exc).__name__}: {exc}") from exc

    async def reset(self, req: ResetRequest) -> StepReply:
        """Open a session (or restart one) and reset its environment."""
        await self.expire()
        async with self._guard:
            session = self.sessions.get(req.episode_id or "")
            if session is None:
                if len(self.sessions) >= self.max_sessions:
                    raise ServiceUnavailableError(
                        f"all {self.max_sessions} sessions are in use; close one or retry"
                    )
                episode_id = req.episode_id or secrets.token_hex(8)
                raw = await self._call(None, asyncio.to_thread(self.factory.create), "create")
                session = Session(episode_id, as_async(raw), raw)
                self.sessions[episode_id] = session
        async with session.lock:
            result = await self._call(
                session, session.env.areset(seed=req.seed, options=req.options), "reset"
            )
            try:
                obs, info = check_reset(result)
            except (TypeError, ValueError) as exc:
                await self.close(session.episode_id)
                raise EnvError(f"env reset: {exc}") from exc
            session.step_count, session.done, session.last_used = 0, False, time.monotonic()
        return StepReply(
            observation=_observation(obs, info, None, False), episode_id=session.episode_id
        )

    def get(self, episode_id: str) -> Session:
        """A live session, or ``NotFoundError``."""
        session = self.sessions.get(episode_id)
        if session is None:
            raise NotFoundError(
                f"no session {episode_id!r} (never opened, closed or expired after "
                f"{self.idle_timeout_s}s idle); POST /reset opens one"
            )
        return session

    async def step(self, req: StepRequest) -> StepReply:
        """Apply one action in a session."""
        session = self.get(req.episode_id)
        async with session.lock:
            if session.done:
                raise ConflictError(f"episode {req.episode_id!r} has ended; POST /reset")
            result = await self._call(session, session.env.astep(req.action.message), "step")
            try:
                obs, reward, terminated, truncated, info = check_step(result)
            except (TypeError, ValueError) as exc:
                await self.close(session.episode_id)
                raise EnvError(f"env step: {exc}") from exc
            session.step_count += 1
            session.done = terminated or truncated
            session.last_used = time.monotonic()
        return StepReply(
            observation=_observation(obs, info, reward, session.done),
            reward=reward,
            done=session.done,
            truncated=truncated and not terminated,
            episode_id=session.episode_id,
        )

    def state(self, episode_id: str) -> dict[str, Any]:
        """``episode_id``, ``step_count``, ``done`` and the environment's own ``state()``."""
        session = self.get(episode_id)
        session.last_used = time.monotonic()
        out: dict[str, Any] = {
            "episode_id": episode_id,
            "step_count": session.step_count,
            "done": session.done,
        }
        own = getattr(session.raw, "state", None)
        if callable(own):
            value = own()
            if isinstance(value, dict):
                out["env"] = value
        return out

    async def close(self, episode_id: str) -> bool:
        """Close a session; False when there was none."""
        session = self.sessions.pop(episode_id, None)
        if session is None:
            return False
        with contextlib.suppress(Exception):
            await asyncio.wait_for(session.env.aclose(), self.call_timeout_s)
        return True

    async def expire(self) -> None:
        """Close sessions idle for longer than ``idle_timeout_s``."""
        now = time.monotonic()
        stale = [
            s.episode_id
            for s in self.sessions.values()
            if now - s.last_used > self.idle_timeout_s and not s.lock.locked()
        ]
        for episode_id in stale:
            if await self.close(episode_id):
                self.expired += 1
                log.info("env session %s expired", episode_id)

    async def close_all(self) -> None:
        """Close every session (shutdown)."""
        for episode_id in list(self.sessions):
            await self.close(episode_id)
