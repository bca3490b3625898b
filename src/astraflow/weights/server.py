"""The weight server: a small Starlette app serving a store directory with HTTP range requests.

Standalone (``astraflow weights serve``) or mounted inside another app at ``/v1/weights``::

    GET /v1/weights/health                      {"status": "ok"}                  public
    GET /v1/weights/{policy}/latest             {"policy": p, "version": int | null}
    GET /v1/weights/{policy}/versions           {"policy": p, "versions": [int, ...]}
    GET /v1/weights/{policy}/merged/{a}/{b}     manifest of the merged delta a → b (cached)
    GET /v1/weights/files/{path}                a store file; Range requests answer 206
    GET /openapi.json                           the OpenAPI document of these routes  public

Routes, roles, parameter rules and replies come from one table (``openapi.Endpoint``); every
path parameter is validated by its model (400 naming the field, NUL bytes included); with
tokens configured every non-public route needs a bearer token (``access``). Only files under
a policy directory are served, never temporary files. Merged deltas are the one write a GET
can cause, bounded by ``MergedCache``. Errors are ``{"error": {"code", "message", "field"}}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pydantic
import uvicorn
from pydantic import Field
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route

from astraflow.config import ConfigModel
from astraflow.errors import (
    AstraflowError,
    AuthError,
    ForbiddenError,
    NotFoundError,
    ValidationError,
)
from astraflow.weights.access import WeightsAuth, WeightsAuthConfig
from astraflow.weights.files import StoreFiles
from astraflow.weights.manifest import WeightManifest, check_policy
from astraflow.weights.merged_cache import MergedCache
from astraflow.weights.openapi import Endpoint, openapi_document
from astraflow.weights.wire import (
    FileParams,
    HealthReply,
    LatestReply,
    MergedParams,
    PolicyParams,
    VersionsReply,
)

__all__ = ["WeightServerConfig", "serve_in_thread", "standalone_app", "weights_app"]

logger = logging.getLogger(__name__)

PREFIX = "/v1/weights"
#: Error class → HTTP status (nearest class in the MRO wins; anything else: 500).
_STATUS: dict[type[AstraflowError], int] = {
    ValidationError: 400,
    AuthError: 401,
    ForbiddenError: 403,
    NotFoundError: 404,
}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


class WeightServerConfig(ConfigModel):
    """The weight server: who may call it and how much a GET may add to the store."""

    auth: WeightsAuthConfig = Field(default_factory=WeightsAuthConfig)
    """Bearer tokens per role (none: an open server)."""
    merged_cache_entries: int = Field(default=8, ge=0, le=4096)
    """Merged deltas kept at most (least recently served evicted; 0: never compose)."""
    merged_cache_mb: float = Field(default=2048.0, gt=0)
    """Bytes of merged deltas kept at most, in MiB."""
    merge_concurrency: int = Field(default=2, ge=1, le=64)
    """Merged deltas composed at once (each in a worker thread)."""


Handler = Callable[[Request, Any], Awaitable[Response]]


def _status(exc: AstraflowError) -> int:
    for cls in type(exc).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return 500


def _error(exc: AstraflowError) -> Response:
    return JSONResponse(exc.to_wire(), status_code=_status(exc))


def _params(model: type[pydantic.BaseModel], request: Request) -> pydantic.BaseModel:
    try:
        return model.model_validate(request.path_params)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise ValidationError(f"bad {field}: {first['msg']}", field=field) from None


class _WeightServer:
    """The handlers of one store directory and the route table they are served by."""

    def __init__(self, root: str | Path, config: WeightServerConfig) -> None:
        self.files = StoreFiles(root)
        if not self.files.local:
            raise ValidationError(f"the weight server serves a local directory, not {root}")
        self.base = Path(self.files.base).resolve()
        self.auth = WeightsAuth(config.auth.tokens())
        self.cache = MergedCache(
            self.files, entries=config.merged_cache_entries,
            max_bytes=int(config.merged_cache_mb * 2**20), concurrency=config.merge_concurrency,
        )  # fmt: skip

    def endpoints(self) -> list[Endpoint]:
        """The route table (relative to the ``/v1/weights`` mount)."""
        return [
            Endpoint("/health", self.health, "liveness", role=None, reply=HealthReply),
            Endpoint("/openapi.json", self.openapi, "this document", role=None),
            Endpoint("/files/{path:path}", self.file, "a store file (Range: 206)",
                     params=FileParams, binary=True),
            Endpoint("/{policy}/latest", self.latest, "newest version of a policy",
                     params=PolicyParams, reply=LatestReply),
            Endpoint("/{policy}/versions", self.versions, "published versions of a policy",
                     params=PolicyParams, reply=VersionsReply),
            Endpoint("/{policy}/merged/{have}/{want}", self.merged,
                     "manifest of the merged delta have -> want (composed once, cached)",
                     params=MergedParams, reply=WeightManifest),
        ]  # fmt: skip

    def routes(self) -> list[Route]:
        """Starlette routes of the table, each behind auth, validation and the error boundary."""
        return [
            Route(ep.route, self._wrap(ep), methods=list(ep.methods)) for ep in self.endpoints()
        ]

    def document(self) -> dict[str, Any]:
        """The OpenAPI document of the standalone server."""
        from astraflow import __version__

        return openapi_document(
            self.endpoints(), prefix=PREFIX, title="astraflow weight server", version=__version__
        )

    def _wrap(self, ep: Endpoint) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            try:
                self.auth.check(request.headers.get("authorization", ""), request.url.path, ep.role)
                params = _params(ep.params, request) if ep.params is not None else None
                return await ep.handler(request, params)
            except AstraflowError as exc:
                return _error(exc)
            except Exception:  # the boundary of one request: answer 500, keep serving
                logger.exception("request crashed path=%r", request.url.path)
                return _error(AstraflowError("internal error; see the weight server log"))

        return handle

    # ------------------------------------------------------------------ handlers

    async def health(self, request: Request, params: None) -> Response:
        """Liveness."""
        return JSONResponse(HealthReply().model_dump())

    async def openapi(self, request: Request, params: None) -> Response:
        """The OpenAPI document."""
        return JSONResponse(self.document())

    async def latest(self, request: Request, params: PolicyParams) -> Response:
        """Newest version."""
        policy = check_policy(params.policy)
        found = await asyncio.to_thread(self.files.versions, policy)
        reply = LatestReply(policy=policy, version=found[-1] if found else None)
        return JSONResponse(reply.model_dump())

    async def versions(self, request: Request, params: PolicyParams) -> Response:
        """Every version."""
        policy = check_policy(params.policy)
        found = await asyncio.to_thread(self.files.versions, policy)
        return JSONResponse(VersionsReply(policy=policy, versions=found).model_dump())

    async def merged(self, request: Request, params: MergedParams) -> Response:
        """Manifest of a merged delta."""
        policy = check_policy(params.policy)
        if params.want <= params.have:
            raise ValidationError(
                f"want must be > have, got {params.have} -> {params.want}", field="want"
            )
        manifest = await self.cache.get(policy, params.have, params.want)
        return Response(manifest.to_json(), media_type="application/json")

    async def file(self, request: Request, params: FileParams) -> Response:
        """A store file."""
        rel = params.path
        check_policy(rel.split("/")[0])
        path = (self.base / rel).resolve()
        if self.base not in path.parents or ".tmp" in path.name or not path.is_file():
            raise NotFoundError(f"no file {rel}")
        return FileResponse(path, media_type="application/octet-stream")


async def _http_error(request: Request, exc: Exception) -> Response:
    """404 / 405 from the router, in the error shape of every other answer (Allow kept)."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else {}
    code = _HTTP_CODES.get(status, "http")
    if status == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
        message += f" (allowed: {headers.get('Allow', headers.get('allow', ''))})"
    else:
        message = f"no route {request.method} {request.url.path}"
    body = {"error": {"code": code, "message": message}}
    return Response(json.dumps(body), status, headers, media_type="application/json")


def _app(routes: list[Route | Mount]) -> Starlette:
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})


def weights_app(root: str | Path, config: WeightServerConfig | None = None) -> Starlette:
    """The routes (without the ``/v1/weights`` prefix) serving the store directory ``root``."""
    return _app(list(_WeightServer(root, config or WeightServerConfig()).routes()))


def standalone_app(root: str | Path, config: WeightServerConfig | None = None) -> Starlette:
    """The app ``astraflow weights serve`` runs: the routes at ``/v1/weights``, and the
    OpenAPI document at ``/openapi.json``."""
    server = _WeightServer(root, config or WeightServerConfig())

    async def document(request: Request) -> Response:
        return JSONResponse(server.document())

    mount = Mount(PREFIX, app=_app(list(server.routes())))
    return _app([Route("/openapi.json", document), mount])


@contextmanager
def serve_in_thread(
    root: str | Path,
    host: str = "127.0.0.1",
    port: int = 0,
    config: WeightServerConfig | None = None,
) -> Iterator[str]:
    """Serve ``root`` with uvicorn in a background thread; yields the base URL, stops on exit."""
    config_ = uvicorn.Config(
        standalone_app(root, config), host=host, port=port, log_level="warning",
        lifespan="off", ws="none", access_log=False,
    )  # fmt: skip
    server = uvicorn.Server(config_)
    thread = threading.Thread(target=server.run, name="weights-server", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise AstraflowError(f"weight server on {host}:{port} failed to start")
            threading.Event().wait(0.01)
        bound = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
