"""The ``/v1`` HTTP transport of the dataflow service (Starlette): decode → service → encode.

Control messages are JSON; submissions are msgpack (JSON also accepted); batches are served as
msgpack. Every error is ``{"error": {"code", "message", "field"}}`` with its status from
:data:`STATUS`. With any token configured, every route but ``/v1/health`` needs a bearer token
whose role may call it (``admin`` may call everything). Bodies above the limit get 413 before
they are read whole; large bodies are decoded off the writer thread within a byte budget
(``intake.py``: 503 with ``retry_after_s`` beyond it). A known path with another method gets
405 with ``Allow``. Routes come from ``openapi.ENDPOINTS``, which ``GET /openapi.json``
publishes. No rule lives here: see ``service.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from astraflow.dataflow.dashboard import DashboardRoutes
from astraflow.dataflow.history import FigureHistory
from astraflow.dataflow.intake import BodyIntake
from astraflow.dataflow.metrics import metrics_text
from astraflow.dataflow.openapi import ENDPOINTS, openapi_document
from astraflow.dataflow.runtime import WRITER_TIMES, ServiceRuntime
from astraflow.dataflow.service import DataflowService
from astraflow.errors import (
    AstraflowError,
    AuthError,
    ConfigError,
    ConflictError,
    ForbiddenError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    ServiceBusyError,
    ServiceUnavailableError,
    ValidationError,
)
from astraflow.records import (
    JSON_MEDIA_TYPE,
    MSGPACK_MEDIA_TYPE,
    AckRequest,
    DataflowReport,
    FailRequest,
    HandBackRequest,
    LeaseRequest,
    MetricPoints,
    PolicyVersion,
    PoolSizeRequest,
    ReleaseRequest,
    RenewRequest,
    Role,
    SubmitManyRequest,
    SubmitRequest,
    TakeBatchRequest,
    WatchVersionsRequest,
)

__all__ = ["STATUS", "create_app", "status_for"]

log = logging.getLogger(__name__)

RecordT = TypeVar("RecordT", bound=BaseModel)
ResultT = TypeVar("ResultT")

#: The one error → HTTP status table (most specific class first in the MRO wins).
STATUS: dict[type[AstraflowError], int] = {
    ValidationError: 400,
    AuthError: 401,
    ForbiddenError: 403,
    NotFoundError: 404,
    MethodNotAllowedError: 405,
    ConflictError: 409,
    PayloadTooLargeError: 413,
    ConfigError: 500,
    ServiceUnavailableError: 503,
}


def status_for(exc: AstraflowError) -> int:
    """HTTP status of an error: the entry of its nearest class in :data:`STATUS`."""
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def _json(data: Any, status: int = 200) -> Response:
    body = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return Response(body, status_code=status, media_type=JSON_MEDIA_TYPE)


def _server_timing(started: float, writer: list[tuple[float, float]] | None) -> str:
    """``Server-Timing``: the handler's time, and its calls' wait for and time on the writer."""
    wait = sum(w for w, _ in writer or ())
    run = sum(r for _, r in writer or ())
    total = time.perf_counter() - started
    return (
        f"app;dur={total * 1e3:.2f}, writer-wait;dur={wait * 1e3:.2f}, writer;dur={run * 1e3:.2f}"
    )


async def _hang_up(request: Request, gone: asyncio.Event) -> None:
    """Set ``gone`` when the client of ``request`` (its body already read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()


def _error(exc: AstraflowError) -> Response:
    response = _json(exc.to_wire(), status_for(exc))
    if isinstance(exc, ServiceBusyError):
        response.headers["retry-after"] = str(max(1, math.ceil(exc.retry_after_s)))
    return response


class _Auth:
    def __init__(self, tokens: dict[Role, str]) -> None:
        self.tokens = {r: t.encode() for r, t in tokens.items()}

    def roles(self, token: str) -> list[Role]:
        """The roles ``token`` opens (none for an unknown token)."""
        return [r for r, t in self.tokens.items() if hmac.compare_digest(t, token.encode())]

    def check(self, request: Request, role: Role | None) -> None:
        """Raise 401 / 403 unless the request's token opens ``role`` (None: any role)."""
        if not self.tokens:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise AuthError(f"{request.url.path} needs an 'Authorization: Bearer <token>' header")
        held = self.roles(token)
        if not held:
            raise AuthError("the bearer token is not valid for this service")
        if role is None or role in held or "admin" in held:
            return
        raise ForbiddenError(f"a {held[0]} token may not call {request.url.path} (needs {role})")


Handler = Callable[[Request], Awaitable[Response]]


class _Routes:
    """Request handlers: authorise, decode, run on the writer thread, encode."""

    def __init__(self, service: DataflowService) -> None:
        self.service = service
        self.runtime = ServiceRuntime(service)
        self.auth = _Auth(service.config.auth.tokens())
        self.document = openapi_document()
        limits = service.config.limits
        self.intake = BodyIntake(
            int(limits.max_body_mb * 1024 * 1024),
            int(limits.max_decoding_mb * 1024 * 1024),
            limits.busy_wait_s,
            limits.busy_retry_after_s,
        )
        self.history = FigureHistory(service.config.dashboard.history)
        self.dashboard = DashboardRoutes(
            service.config.dashboard, self.history, lambda t: bool(self.auth.roles(t)),
            open_=not self.auth.tokens,
        )  # fmt: skip

    def endpoint(
        self, role: Role | None, fn: Callable[[Request], Awaitable[Any]], *, public: bool = False
    ) -> Handler:
        """Wrap ``fn`` with auth and the error boundary of one request."""

        async def handle(request: Request) -> Response:
            started, times = time.perf_counter(), WRITER_TIMES.set([])
            response = await answer(request)
            response.headers["server-timing"] = _server_timing(started, WRITER_TIMES.get())
            WRITER_TIMES.reset(times)
            return response

        async def answer(request: Request) -> Response:
            try:
                if not public:
                    self.auth.check(request, role)
                result = await fn(request)
            except AstraflowError as exc:
                if status_for(exc) >= 500 and not isinstance(exc, ServiceBusyError):
                    log.error("request failed path=%s error=%s", request.url.path, exc)
                return _error(exc)
            except Exception:  # the boundary of one request: answer 500, keep serving
                log.exception("request crashed path=%s", request.url.path)
                return _error(AstraflowError("internal error; see the service log"))
            return result if isinstance(result, Response) else _json(result)

        return handle

    def call(
        self, cls: type[RecordT], method: Callable[[RecordT], Any]
    ) -> Callable[[Request], Awaitable[Any]]:
        """A handler that decodes ``cls`` (off the writer) and passes it to a service method
        on the writer thread; a large body's budget is held until the method returns."""

        async def run(request: Request) -> Any:
            async with self.intake.record(cls, request) as record:
                return await self.runtime.call(method, record)

        return run

    async def lease(self, request: Request) -> Any:
        """Lease tasks (held a while in sync mode when the round has none)."""
        async with self.intake.record(LeaseRequest, request) as req:
            return await self.runtime.lease(req)

    async def _long_poll(
        self,
        request: Request,
        cls: type[RecordT],
        wait: Callable[[RecordT, asyncio.Event], Awaitable[ResultT]],
    ) -> ResultT:
        """Decode ``cls`` and wait on it; a caller that hangs up sets the event ``wait`` gets
        (it then ends at once, giving the caller nothing)."""
        async with self.intake.record(cls, request) as req:
            gone = asyncio.Event()
            watcher = asyncio.create_task(_hang_up(request, gone))
            try:
                return await wait(req, gone)
            finally:
                watcher.cancel()

    async def take(self, request: Request) -> Response:
        """Long-poll for a batch: msgpack, or 204 when the wait timed out."""
        got = await self._long_poll(request, TakeBatchRequest, self.runtime.take_batch)
        if got is None:
            return Response(status_code=204)
        batch_id, data, n = got
        headers = {"x-batch-id": batch_id, "x-batch-samples": str(n)}
        return Response(data, media_type=MSGPACK_MEDIA_TYPE, headers=headers)

    async def ack(self, request: Request) -> dict[str, Any]:
        """Ack a batch."""
        await self.call(AckRequest, self.service.ack)(request)
        return {}

    async def hand_back(self, request: Request) -> Any:
        """A stopping trainer gives back the batches it will not train."""
        async with self.intake.record(HandBackRequest, request) as req:
            return await self.runtime.hand_back(req)

    async def health(self, request: Request) -> Any:
        """Liveness."""
        return await self.runtime.call(self.service.health)

    async def announce(self, request: Request) -> Any:
        """Announce a version; the version watches answer."""
        reply = await self.call(PolicyVersion, self.service.announce)(request)
        self.runtime.announced()
        return reply

    async def watch_versions(self, request: Request) -> Any:
        """Long-poll for versions newer than the caller knows of."""
        latest = await self._long_poll(request, WatchVersionsRequest, self.runtime.watch_versions)
        return {p: v.model_dump(mode="json") for p, v in latest.items()}

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

    async def post_metrics(self, request: Request) -> dict[str, Any]:
        """Remember metric points for the dashboard (memory only, no service state)."""
        async with self.intake.record(MetricPoints, request) as req:
            self.history.add_points(req.points)
        return {"accepted": len(req.points)}

    async def openapi(self, request: Request) -> Any:
        """The OpenAPI document of the ``/v1`` API."""
        return self.document

    def handlers(self) -> dict[str, Callable[[Request], Awaitable[Any]]]:
        """Handler of each endpoint name in :data:`ENDPOINTS`."""
        s, call = self.service, self.call
        return {
            "health": self.health, "lease": self.lease, "renew": call(RenewRequest, s.renew),
            "submit": call(SubmitRequest, s.submit), "fail": call(FailRequest, s.fail),
            "submit_many": call(SubmitManyRequest, s.submit_many),
            "release": call(ReleaseRequest, s.release), "take": self.take, "ack": self.ack,
            "hand_back": self.hand_back,
            "announce": self.announce, "versions": self.versions,
            "watch_versions": self.watch_versions,
            "report": self.report, "pool_sizes": self.pool_sizes,
            "set_pool_size": call(PoolSizeRequest, s.set_pool_size), "metrics": self.metrics,
            "post_metrics": self.post_metrics,
        }  # fmt: skip

    def routes(self) -> list[Route]:
        """The route table, built from :data:`ENDPOINTS` (and the public ``/openapi.json``)."""
        fns = self.handlers()
        routes = [
            Route(ep.path, self.endpoint(ep.role, fns[ep.name], public=ep.public),
                  methods=[ep.method])
            for ep in ENDPOINTS
        ]  # fmt: skip
        routes.append(Route("/openapi.json", self.endpoint(None, self.openapi, public=True),
                            methods=["GET"]))  # fmt: skip
        if self.service.config.dashboard.enabled:
            routes += self.dashboard.routes()
        return routes

    async def report_snapshot(self) -> DataflowReport:
        """The report, built on the writer thread (the dashboard's sampler)."""
        return await self.runtime.call(self.service.report)


def _allowed(routes: list[Route], path: str) -> list[str]:
    methods: set[str] = set()
    for route in routes:
        if route.path_regex.match(path) and route.methods:
            methods |= route.methods
    return sorted(methods)


def _no_route(routes: list[Route]) -> Callable[[Request, Exception], Awaitable[Response]]:
    async def handle(request: Request, exc: Exception) -> Response:
        code = exc.status_code if isinstance(exc, HTTPException) else 500
        err: AstraflowError = NotFoundError(f"no route {request.method} {request.url.path}")
        headers: dict[str, str] = {}
        if code == 405:
            allowed = _allowed(routes, request.url.path)
            headers["allow"] = ", ".join(allowed)
            err = MethodNotAllowedError(
                f"{request.url.path} does not take {request.method}; allowed: {', '.join(allowed)}"
            )
        body = json.dumps(err.to_wire())
        return Response(body, status_code=code, media_type=JSON_MEDIA_TYPE, headers=headers)

    return handle


def create_app(service: DataflowService, *, owns_service: bool = False) -> Starlette:
    """The ASGI app serving ``service``; with ``owns_service`` it closes it on shutdown."""
    handlers = _Routes(service)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await handlers.runtime.start()
        sampler = None
        if service.config.dashboard.enabled:
            sampler = asyncio.create_task(handlers.dashboard.sample(handlers.report_snapshot))
        try:
            yield
        finally:
            if sampler is not None:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
            await handlers.runtime.stop()
            if owns_service:
                service.close()

    routes = handlers.routes()
    return Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _no_route(routes)}
    )
