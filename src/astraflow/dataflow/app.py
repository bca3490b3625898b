"""The ``/v1`` HTTP transport of the dataflow service (Starlette): decode → service → encode.

Control messages are JSON; submissions are msgpack (JSON also accepted); batches are served as
msgpack. Every error is ``{"error": {"code", "message", "field"}}`` with its status from
:data:`STATUS`. With any token configured, every route but ``/v1/health`` needs a bearer token
whose role may call it (``admin`` may call everything). Bodies above the limit get 413 before
they are read whole. No rule lives here: see ``service.py``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from astraflow.dataflow.metrics import metrics_text
from astraflow.dataflow.runtime import ServiceRuntime
from astraflow.dataflow.service import DataflowService
from astraflow.errors import (
    AstraflowError,
    AuthError,
    ConfigError,
    ConflictError,
    ForbiddenError,
    NotFoundError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    ValidationError,
)
from astraflow.records import (
    JSON_MEDIA_TYPE,
    MSGPACK_MEDIA_TYPE,
    AckRequest,
    FailRequest,
    LeaseRequest,
    PolicyVersion,
    PoolSizeRequest,
    ReleaseRequest,
    RenewRequest,
    Role,
    SubmitRequest,
    TakeBatchRequest,
    parse_json,
    unpack,
)

__all__ = ["STATUS", "create_app", "status_for"]

log = logging.getLogger(__name__)

RecordT = TypeVar("RecordT", bound=BaseModel)

#: The one error → HTTP status table (most specific class first in the MRO wins).
STATUS: dict[type[AstraflowError], int] = {
    ValidationError: 400,
    AuthError: 401,
    ForbiddenError: 403,
    NotFoundError: 404,
    ConflictError: 409,
    PayloadTooLargeError: 413,
    ConfigError: 500,
    ServiceUnavailableError: 503,
}

#: Bodies at or below this size are decoded on the event loop; larger ones in a thread.
_INLINE_DECODE_BYTES = 64 * 1024


def status_for(exc: AstraflowError) -> int:
    """HTTP status of an error: the entry of its nearest class in :data:`STATUS`."""
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def _json(data: Any, status: int = 200) -> Response:
    body = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return Response(body, status_code=status, media_type=JSON_MEDIA_TYPE)


def _error(exc: AstraflowError) -> Response:
    return _json(exc.to_wire(), status_for(exc))


class _Auth:
    def __init__(self, tokens: dict[Role, str]) -> None:
        self.tokens = {r: t.encode() for r, t in tokens.items()}

    def check(self, request: Request, role: Role | None) -> None:
        """Raise 401 / 403 unless the request's token opens ``role`` (None: any role)."""
        if not self.tokens:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise AuthError(f"{request.url.path} needs an 'Authorization: Bearer <token>' header")
        held = [r for r, t in self.tokens.items() if hmac.compare_digest(t, token.encode())]
        if not held:
            raise AuthError("the bearer token is not valid for this service")
        if role is None or role in held or "admin" in held:
            return
        raise ForbiddenError(f"a {held[0]} token may not call {request.url.path} (needs {role})")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ValidationError(f"bad Content-Length {declared!r}", field="content-length")
        if int(declared) > limit:
            raise PayloadTooLargeError(
                f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                field="body",
            )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(
                f"request body exceeds the limit of {limit} bytes", field="body"
            )
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(cls: type[RecordT], body: bytes, content_type: str) -> RecordT:
    if not body:
        raise ValidationError(f"empty body: expected a {cls.__name__}", field="body")
    media = content_type.split(";")[0].strip().lower()
    if media in (MSGPACK_MEDIA_TYPE, "application/x-msgpack"):
        return unpack(cls, body)
    if media in (JSON_MEDIA_TYPE, ""):
        return parse_json(cls, body)
    raise ValidationError(
        f"unsupported Content-Type {media!r}: send {JSON_MEDIA_TYPE} or {MSGPACK_MEDIA_TYPE}",
        field="content-type",
    )


Handler = Callable[[Request], Awaitable[Response]]


class _Routes:
    """Request handlers: authorise, decode, run on the writer thread, encode."""

    def __init__(self, service: DataflowService) -> None:
        self.service = service
        self.runtime = ServiceRuntime(service)
        self.auth = _Auth(service.config.auth.tokens())
        self.limit = int(service.config.limits.max_body_mb * 1024 * 1024)

    def endpoint(
        self, role: Role | None, fn: Callable[[Request], Awaitable[Any]], *, public: bool = False
    ) -> Handler:
        """Wrap ``fn`` with auth and the error boundary of one request."""

        async def handle(request: Request) -> Response:
            try:
                if not public:
                    self.auth.check(request, role)
                result = await fn(request)
            except AstraflowError as exc:
                if status_for(exc) >= 500:
                    log.error("request failed path=%s error=%s", request.url.path, exc)
                return _error(exc)
            except Exception:  # the boundary of one request: answer 500, keep serving
                log.exception("request crashed path=%s", request.url.path)
                return _error(AstraflowError("internal error; see the service log"))
            return result if isinstance(result, Response) else _json(result)

        return handle

    async def body(self, request: Request, cls: type[RecordT]) -> RecordT:
        """Read (bounded) and decode the request body as ``cls``."""
        data = await _read_body(request, self.limit)
        ctype = request.headers.get("content-type", "")
        if len(data) <= _INLINE_DECODE_BYTES:
            return _decode(cls, data, ctype)
        return await asyncio.to_thread(_decode, cls, data, ctype)

    def call(
        self, cls: type[RecordT], method: Callable[[RecordT], Any]
    ) -> Callable[[Request], Awaitable[Any]]:
        """A handler that decodes ``cls`` and passes it to a service method."""

        def decode_and_run(data: bytes, ctype: str) -> Any:
            return method(_decode(cls, data, ctype))

        async def run(request: Request) -> Any:
            data = await _read_body(request, self.limit)
            ctype = request.headers.get("content-type", "")
            if len(data) <= _INLINE_DECODE_BYTES:
                return await self.runtime.call(method, _decode(cls, data, ctype))
            # a large body is decoded on the writer thread too: one thread hop, not two
            return await self.runtime.call(decode_and_run, data, ctype)

        return run

    async def lease(self, request: Request) -> Any:
        """Lease tasks (held a while in sync mode when the round has none)."""
        return await self.runtime.lease(await self.body(request, LeaseRequest))

    async def take(self, request: Request) -> Response:
        """Long-poll for a batch: msgpack, or 204 when the wait timed out."""
        got = await self.runtime.take_batch(await self.body(request, TakeBatchRequest))
        if got is None:
            return Response(status_code=204)
        batch_id, data, n = got
        headers = {"x-batch-id": batch_id, "x-batch-samples": str(n)}
        return Response(data, media_type=MSGPACK_MEDIA_TYPE, headers=headers)

    async def ack(self, request: Request) -> dict[str, Any]:
        """Ack a batch."""
        await self.runtime.call(self.service.ack, await self.body(request, AckRequest))
        return {}

    async def health(self, request: Request) -> Any:
        """Liveness."""
        return await self.runtime.call(self.service.health)

    async def versions(self, request: Request) -> Any:
        """Latest versions."""
        latest = await self.runtime.call(self.service.versions)
        return {p: v.model_dump(mode="json") for p, v in latest.items()}

    async def report(self, request: Request) -> Any:
        """The JSON report."""
        return await self.runtime.call(self.service.report)

    async def pool_sizes(self, request: Request) -> Any:
        """Desired, observed and target node counts per pool."""
        return await self.runtime.call(self.service.pool_sizes)

    async def metrics(self, request: Request) -> Response:
        """The report as Prometheus gauges."""
        text = metrics_text(await self.runtime.call(self.service.report))
        return Response(text, media_type="text/plain; version=0.0.4")

    def routes(self) -> list[Route]:
        """The ``/v1`` route table."""
        s, ep, call = self.service, self.endpoint, self.call
        post = ["POST"]
        return [
            Route("/v1/health", ep(None, self.health, public=True)),
            Route("/v1/lease", ep("node", self.lease), methods=post),
            Route("/v1/renew", ep("node", call(RenewRequest, s.renew)), methods=post),
            Route("/v1/submit", ep("node", call(SubmitRequest, s.submit)), methods=post),
            Route("/v1/fail", ep("node", call(FailRequest, s.fail)), methods=post),
            Route("/v1/release", ep("node", call(ReleaseRequest, s.release)), methods=post),
            Route("/v1/batches/take", ep("trainer", self.take), methods=post),
            Route("/v1/batches/ack", ep("trainer", self.ack), methods=post),
            Route("/v1/versions", ep("trainer", call(PolicyVersion, s.announce)), methods=post),
            Route("/v1/versions", ep(None, self.versions), methods=["GET"]),
            Route("/v1/report", ep(None, self.report), methods=["GET"]),
            Route("/v1/admin/pools", ep("admin", self.pool_sizes), methods=["GET"]),
            Route(
                "/v1/admin/pools",
                ep("admin", call(PoolSizeRequest, s.set_pool_size)),
                methods=post,
            ),
            Route("/metrics", ep(None, self.metrics), methods=["GET"]),
        ]


async def _no_route(request: Request, exc: Exception) -> Response:
    code = exc.status_code if isinstance(exc, HTTPException) else 500
    err = NotFoundError(f"no route {request.method} {request.url.path}")
    return Response(json.dumps(err.to_wire()), status_code=code, media_type=JSON_MEDIA_TYPE)


def create_app(service: DataflowService, *, owns_service: bool = False) -> Starlette:
    """The ASGI app serving ``service``; with ``owns_service`` it closes it on shutdown."""
    handlers = _Routes(service)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await handlers.runtime.start()
        try:
            yield
        finally:
            await handlers.runtime.stop()
            if owns_service:
                service.close()

    return Starlette(
        routes=handlers.routes(), lifespan=lifespan, exception_handlers={HTTPException: _no_route}
    )
