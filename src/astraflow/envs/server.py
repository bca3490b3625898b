"""``astraflow env serve``: any registered environment over HTTP, on the OpenEnv wire.

Routes and bodies: :mod:`astraflow.envs.wire`. One session (environment instance) per
episode, at most ``max_sessions`` at once, closed after ``idle_timeout_s`` without a call.
With a token configured (``--token`` or ``ASTRAFLOW_ENV_TOKEN``) every route but ``/health``
needs ``Authorization: Bearer <token>``: none → 401, a wrong one → 403. Bodies are JSON only
(never pickles), bounded in size; errors answer ``{"error": {"code", "message"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, TypeVar

import pydantic
import pydantic_core
import uvicorn
from pydantic import BaseModel, Field, SecretStr, field_validator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from astraflow.config import ConfigModel
from astraflow.envs.registry import EnvFactory
from astraflow.envs.remote import TOKEN_ENV
from astraflow.envs.sessions import SessionPool
from astraflow.envs.wire import CloseRequest, ResetRequest, StepRequest
from astraflow.errors import (
    AstraflowError,
    AuthError,
    ConflictError,
    EnvError,
    ForbiddenError,
    NotFoundError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    ValidationError,
)
from astraflow.plugins import ENV_SPEC, PluginSpec
from astraflow.serving import BackgroundServer, capped_body

__all__ = ["TOKEN_ENV", "EnvServer", "EnvServerConfig", "ThreadedEnvServer", "create_app", "serve"]

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


_STATUS: tuple[tuple[type[AstraflowError], int], ...] = (
    (ForbiddenError, 403),
    (AuthError, 401),
    (PayloadTooLargeError, 413),
    (ValidationError, 400),
    (NotFoundError, 404),
    (ConflictError, 409),
    (ServiceUnavailableError, 503),
    (EnvError, 500),
)


class EnvServerConfig(ConfigModel):
    """One environment server."""

    env: Annotated[PluginSpec, ENV_SPEC]
    """The environment served (``ENVS`` name or ``module:Class`` plus kwargs)."""
    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = Field(default=8300, ge=0, le=65535)
    """Port to bind (0: any free port)."""
    token: SecretStr | None = None
    """Bearer token clients must present (default: env ASTRAFLOW_ENV_TOKEN; none: open)."""
    max_sessions: int = Field(default=256, ge=1)
    """Most live sessions (1 for environments without concurrent sessions)."""
    idle_timeout_s: float = Field(default=300.0, gt=0)
    """A session without a call for this long is closed."""
    call_timeout_s: float = Field(default=60.0, gt=0)
    """Longest reset/step; longer closes the session and answers 500."""
    max_body_kb: int = Field(default=1024, ge=1)
    """Larger request bodies are refused with 413."""
    seed: int = 0
    """Seed of the environments' private RNGs."""

    @field_validator("env", mode="before")
    @classmethod
    def _env_name(cls, value: Any) -> Any:
        return {"type": value} if isinstance(value, str) else value

    def bearer(self) -> str | None:
        """The configured token, or the environment's."""
        value = self.token.get_secret_value() if self.token else os.environ.get(TOKEN_ENV, "")
        return value or None


def _status(exc: AstraflowError) -> int:
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    return 500


class EnvServer:
    """Handlers of one served environment."""

    def __init__(self, config: EnvServerConfig) -> None:
        self.config = config
        self.factory = EnvFactory(config.env, seed=config.seed)
        self.pool = SessionPool(
            self.factory,
            max_sessions=config.max_sessions,
            idle_timeout_s=config.idle_timeout_s,
            call_timeout_s=config.call_timeout_s,
        )
        token = config.bearer()
        self._token = token.encode() if token else None

    def _authorise(self, request: Request) -> None:
        if self._token is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise AuthError(f"{request.url.path} needs an 'Authorization: Bearer <token>' header")
        if not hmac.compare_digest(self._token, token.encode()):
            raise ForbiddenError("the bearer token is not valid for this environment server")

    async def _body(self, request: Request, model: type[M]) -> M:
        raw = await capped_body(request, self.config.max_body_kb * 1024)
        if raw is None:
            raise PayloadTooLargeError(f"request body over {self.config.max_body_kb} KiB")
        try:  # pydantic's parser: bounded nesting, no lone surrogates (json.loads has neither)
            data = pydantic_core.from_json(raw or b"{}")
        except ValueError as exc:
            raise ValidationError(f"request body is not JSON: {exc}") from exc
        try:
            return model.model_validate(data)
        except pydantic.ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in err["loc"]) or "body"
            raise ValidationError(f"{where}: {err['msg']}", field=where) from exc

    def route(
        self, fn: Callable[[Request], Awaitable[Any]], *, auth: bool = True
    ) -> Callable[[Request], Awaitable[Response]]:
        """``fn`` behind auth and the error boundary."""

        async def handler(request: Request) -> Response:
            try:
                if auth:
                    self._authorise(request)
                result = await fn(request)
            except AstraflowError as exc:
                if isinstance(exc, EnvError):
                    log.warning("env error on %s: %s", request.url.path, exc)
                return JSONResponse(exc.to_wire(), status_code=_status(exc))
            body = result.model_dump(mode="json") if isinstance(result, BaseModel) else result
            return JSONResponse(body)

        return handler

    async def reset(self, request: Request) -> Any:
        """POST /reset."""
        return await self.pool.reset(await self._body(request, ResetRequest))

    async def step(self, request: Request) -> Any:
        """POST /step."""
        return await self.pool.step(await self._body(request, StepRequest))

    async def close(self, request: Request) -> Any:
        """POST /close."""
        req = await self._body(request, CloseRequest)
        return {"closed": await self.pool.close(req.episode_id), "episode_id": req.episode_id}

    async def state(self, request: Request) -> Any:
        """GET /state?episode_id=…."""
        episode_id = request.query_params.get("episode_id")
        if not episode_id:
            raise ValidationError("GET /state needs ?episode_id=", field="episode_id")
        return self.pool.state(episode_id)

    async def health(self, request: Request) -> Any:
        """GET /health (no token needed): status and the environment's traits."""
        traits = self.factory.traits
        return {
            "status": "healthy",
            "env": self.factory.name,
            "max_turns": traits.max_turns,
            "action_format": traits.action_format,
            "concurrent_sessions": traits.concurrent_sessions,
            "sessions": len(self.pool.sessions),
            "max_sessions": self.pool.max_sessions,
            "expired_sessions": self.pool.expired,
        }

    async def schema(self, request: Request) -> Any:
        """GET /schema: JSON schemas of the request and reply bodies."""
        from astraflow.envs import wire

        return {
            "action": wire.ActionBody.model_json_schema(),
            "observation": wire.ObservationBody.model_json_schema(),
            "reset": wire.ResetRequest.model_json_schema(),
            "step": wire.StepRequest.model_json_schema(),
        }

    async def expire_loop(self) -> None:
        """Close idle sessions, forever (cancelled at shutdown)."""
        period = max(0.05, min(5.0, self.config.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            await self.pool.expire()


def create_app(config: EnvServerConfig) -> Starlette:
    """The Starlette app serving ``config.env``."""
    server = EnvServer(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(server.expire_loop())
        try:
            yield
        finally:
            task.cancel()
            await server.pool.close_all()

    routes = [
        Route("/reset", server.route(server.reset), methods=["POST"]),
        Route("/step", server.route(server.step), methods=["POST"]),
        Route("/close", server.route(server.close), methods=["POST"]),
        Route("/state", server.route(server.state), methods=["GET"]),
        Route("/schema", server.route(server.schema), methods=["GET"]),
        Route("/health", server.route(server.health, auth=False), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.env_server = server
    return app


def _uvicorn(app: Starlette, host: str, port: int) -> uvicorn.Server:
    return uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False,
                       lifespan="on", ws="none", timeout_graceful_shutdown=2)
    )  # fmt: skip


def serve(config: EnvServerConfig) -> None:
    """Serve until SIGINT / SIGTERM."""
    log.info("env serving env=%s url=http://%s:%d", config.env.type, config.host, config.port)
    _uvicorn(create_app(config), config.host, config.port).run()


class ThreadedEnvServer(BackgroundServer):
    """The server on a background thread (tests, benchmarks); ``url`` is set by ``start``."""

    def __init__(self, config: EnvServerConfig) -> None:
        super().__init__(_uvicorn(create_app(config), config.host, config.port), config.host,
                         "env server")  # fmt: skip
