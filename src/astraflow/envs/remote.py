"""``remote``: an environment served by ``astraflow env serve`` (or any server speaking the
same OpenEnv wire), used exactly like an in-process one.

    env: {type: remote, url: "http://envhost:8300"}     # token from ASTRAFLOW_ENV_TOKEN

Each instance is one session (one episode at a time): ``areset`` opens it on the server,
``astep`` sends actions with its ``episode_id``, ``aclose`` closes it. ``max_turns`` and the
action format are read from the server's ``/health`` when the session opens. Any failure —
refused connection, timeout, a 4xx/5xx answer — raises :class:`~astraflow.errors.EnvError`, so
the ``env`` workflow fails the task (re-queued) rather than training on it.
"""

from __future__ import annotations

import os
import random
from typing import Any, ClassVar

import httpx
from pydantic import Field, SecretStr

from astraflow.config import ConfigModel
from astraflow.envs.protocol import DEFAULT_MAX_TURNS, Observation, StepResult
from astraflow.envs.registry import ENVS
from astraflow.envs.wire import StepReply
from astraflow.errors import EnvError

__all__ = ["RemoteEnv", "RemoteEnvConfig"]

TOKEN_ENV = "ASTRAFLOW_ENV_TOKEN"


class RemoteEnvConfig(ConfigModel):
    """Config of ``remote``."""

    url: str = Field(pattern=r"^https?://")
    """Base URL of the environment server."""
    token: SecretStr | None = None
    """Bearer token (default: env ASTRAFLOW_ENV_TOKEN)."""
    timeout_s: float = Field(default=60.0, gt=0)
    """Per-request timeout."""


@ENVS.register("remote")
class RemoteEnv:
    """A session on an environment server."""

    Config = RemoteEnvConfig
    max_turns: int = DEFAULT_MAX_TURNS
    action_format: str = "text"
    concurrent_sessions: ClassVar[bool] = True

    def __init__(self, config: RemoteEnvConfig, rng: random.Random) -> None:
        self.config = config
        self.url = config.url.rstrip("/")
        token = config.token.get_secret_value() if config.token else os.environ.get(TOKEN_ENV)
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._headers = headers
        self._client: httpx.AsyncClient | None = None
        self.episode_id: str | None = None
        self._traits_read = False

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                headers=self._headers, timeout=self.config.timeout_s, trust_env=False
            )
        return self._client

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = await self._http().request(method, self.url + path, json=body)
        except httpx.HTTPError as exc:
            raise EnvError(
                f"env server {self.url} unreachable on {path}: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            data = response.json()
        except ValueError:
            data = None
        if response.status_code != 200:
            err = data.get("error") if isinstance(data, dict) else None
            message = err.get("message") if isinstance(err, dict) else response.text[:200]
            raise EnvError(
                f"env server {self.url}{path} answered {response.status_code}: {message}"
            )
        return data

    async def _read_traits(self) -> None:
        health = await self._request("GET", "/health")
        if isinstance(health, dict):
            turns = health.get("max_turns")
            if isinstance(turns, int) and not isinstance(turns, bool) and turns >= 1:
                self.max_turns = turns
            if health.get("action_format") in ("text", "admissible"):
                self.action_format = str(health["action_format"])
        self._traits_read = True

    def _parse(self, data: Any) -> tuple[Observation, StepReply]:
        try:
            reply = StepReply.model_validate(data)
        except ValueError as exc:
            raise EnvError(f"env server {self.url} sent a malformed reply: {exc}") from exc
        obs = reply.observation
        if obs.messages is not None:
            return obs.messages, reply
        if obs.text is None:
            raise EnvError(f"env server {self.url} sent an observation without text or messages")
        return obs.text, reply

    async def areset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Observation, dict[str, Any]]:
        """Open (or restart) this instance's session."""
        if not self._traits_read:
            await self._read_traits()
        body: dict[str, Any] = {"seed": seed, "options": options}
        if self.episode_id is not None:
            body["episode_id"] = self.episode_id
        observation, reply = self._parse(await self._request("POST", "/reset", body))
        self.episode_id = reply.episode_id
        return observation, dict(reply.observation.metadata)

    async def astep(self, action: str) -> StepResult:
        """Send one action."""
        if self.episode_id is None:
            raise EnvError("step before reset on a remote env")
        body = {"episode_id": self.episode_id, "action": {"message": action}}
        observation, reply = self._parse(await self._request("POST", "/step", body))
        reward = 0.0 if reply.reward is None else float(reply.reward)
        terminated = reply.done and not reply.truncated
        return observation, reward, terminated, reply.truncated, dict(reply.observation.metadata)

    async def astate(self) -> dict[str, Any]:
        """``GET /state`` of this session."""
        data = await self._request("GET", f"/state?episode_id={self.episode_id}")
        return dict(data) if isinstance(data, dict) else {}

    async def aclose(self) -> None:
        """Close the session (best effort) and the connection."""
        try:
            if self.episode_id is not None:
                await self._request("POST", "/close", {"episode_id": self.episode_id})
        except EnvError:
            pass
        finally:
            self.episode_id = None
            if self._client is not None:
                await self._client.aclose()
                self._client = None
