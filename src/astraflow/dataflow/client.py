"""Clients of the dataflow service (httpx), sync and async, with the same typed methods.

This module imports only records, errors and httpx: it is what rollout nodes, trainers and
launchers import to reach the service. Connection errors and 5xx replies are retried with
exponential backoff; a 4xx raises at once the error class the service named
(``errors.error_from_wire``). Retrying is safe: submits are idempotent on
``(task_id, attempt)``; a repeated lease or take only leaves a lease or batch to expire. A
relative pool size change is not idempotent: it is retried only when the request cannot have
reached the service (connection refused) or was refused with a 5xx (nothing committed).
"""

from __future__ import annotations

import asyncio
import functools
import random
import ssl
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import httpx
from pydantic import BaseModel

from astraflow.errors import ServiceUnavailableError, error_from_wire
from astraflow.records import (
    JSON_MEDIA_TYPE,
    MSGPACK_MEDIA_TYPE,
    AckRequest,
    AnnounceReply,
    Batch,
    DataflowReport,
    FailReply,
    FailRequest,
    HandBackReply,
    HandBackRequest,
    LeaseReply,
    LeaseRequest,
    MetricPoint,
    MetricPoints,
    PolicyVersion,
    PoolSize,
    PoolSizeRequest,
    PoolSizes,
    ReleaseReply,
    ReleaseRequest,
    RenewReply,
    RenewRequest,
    SubmitManyReply,
    SubmitManyRequest,
    SubmitReply,
    SubmitRequest,
    TakeBatchRequest,
    WatchVersionsRequest,
    pack,
    parse,
    parse_json,
    unpack,
)

__all__ = ["AsyncDataflowClient", "DataflowClient", "ssl_context"]

T = TypeVar("T", bound=BaseModel)

_MAX_BACKOFF_S = 5.0
#: Connections an asyncio client keeps to the service. Concurrent calls beyond it queue in
#: the pool: a node whose tasks end together (one engine batch) would otherwise open one
#: connection per task, and httpcore checks every pooled connection on each request. A node's
#: version watch holds one of them open.
_ASYNC_CONNECTIONS = 5


Body = tuple[bytes, dict[str, str]]


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """One TLS context per process, shared by every client: building one loads the CA bundle
    (~0.2 s of CPU on a busy machine), which 200 node loops in one process each paid on the
    event loop, stalling every other loop's requests."""
    return ssl.create_default_context()


def _json_body(record: BaseModel) -> Body:
    return record.model_dump_json().encode(), {"content-type": JSON_MEDIA_TYPE}


def _msgpack_body(record: BaseModel) -> Body:
    return pack(record), {"content-type": MSGPACK_MEDIA_TYPE}


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        body: Any = resp.json()
    except ValueError:
        body = None
    raise error_from_wire(
        body, default_message=f"HTTP {resp.status_code} from {resp.request.url}: {resp.text[:200]}"
    )


def _reply(cls: type[T]) -> Callable[[httpx.Response], T]:
    def decode(resp: httpx.Response) -> T:
        return parse_json(cls, resp.content)

    return decode


def _batch(resp: httpx.Response) -> Batch | None:
    return None if resp.status_code == 204 else unpack(Batch, resp.content)


def _versions(resp: httpx.Response) -> dict[str, PolicyVersion]:
    return {p: parse(PolicyVersion, v) for p, v in resp.json().items()}


def _dict(resp: httpx.Response) -> dict[str, Any]:
    data: dict[str, Any] = resp.json()
    return data


def _none(resp: httpx.Response) -> None:
    return None


R = TypeVar("R")


@dataclass(frozen=True)
class _Try:
    delay: float
    """Seconds to wait before sending."""
    request: dict[str, Any]
    """``httpx`` request arguments."""


@dataclass(frozen=True)
class _Done(Generic[R]):
    value: R


@dataclass(frozen=True)
class Endpoint(Generic[R]):
    """One ``/v1`` route: how a request is sent and its reply decoded."""

    method: str
    path: str
    decode: Callable[[httpx.Response], R]
    encode: Callable[[BaseModel], Body] = _json_body

    def __call__(
        self, record: BaseModel | None = None, *, timeout_s: float | None = None, once: bool = False
    ) -> _Call[R]:
        """One call of this route (``once``: not idempotent, see ``_Base._tries``)."""
        return _Call(self, record, timeout_s, once)


@dataclass(frozen=True)
class _Call(Generic[R]):
    endpoint: Endpoint[R]
    record: BaseModel | None
    timeout_s: float | None
    once: bool


HEALTH = Endpoint("GET", "/v1/health", _dict)
LEASE = Endpoint("POST", "/v1/lease", _reply(LeaseReply))
RENEW = Endpoint("POST", "/v1/renew", _reply(RenewReply))
SUBMIT = Endpoint("POST", "/v1/submit", _reply(SubmitReply), _msgpack_body)
SUBMIT_MANY = Endpoint("POST", "/v1/submit/many", _reply(SubmitManyReply), _msgpack_body)
FAIL = Endpoint("POST", "/v1/fail", _reply(FailReply))
RELEASE = Endpoint("POST", "/v1/release", _reply(ReleaseReply))
TAKE = Endpoint("POST", "/v1/batches/take", _batch)
ACK = Endpoint("POST", "/v1/batches/ack", _none)
HAND_BACK = Endpoint("POST", "/v1/batches/release", _reply(HandBackReply))
ANNOUNCE = Endpoint("POST", "/v1/versions", _reply(AnnounceReply))
VERSIONS = Endpoint("GET", "/v1/versions", _versions)
WATCH_VERSIONS = Endpoint("POST", "/v1/versions/watch", _versions)
REPORT = Endpoint("GET", "/v1/report", _reply(DataflowReport))
POOL_SIZES = Endpoint("GET", "/v1/admin/pools", _reply(PoolSizes))
SET_POOL_SIZE = Endpoint("POST", "/v1/admin/pools", _reply(PoolSize))
POST_METRICS = Endpoint("POST", "/v1/admin/metrics", _dict)


class _Base:
    """What both clients share: the endpoint table above and the retry rules; they differ
    only in their send loop (blocking or asyncio)."""

    def __init__(
        self, url: str, *, token: str | None = None, timeout_s: float = 30.0, retries: int = 5
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self._jitter = random.Random()
        self._http = self._open()

    def _open(self) -> Any:
        """The connection pool (blocking or asyncio)."""
        raise NotImplementedError

    def _backoff(self, attempt: int) -> float:
        return min(_MAX_BACKOFF_S, 0.1 * 2.0**attempt) * (0.5 + self._jitter.random())

    def _tries(
        self, call: _Call[R]
    ) -> Generator[_Try | _Done[R], httpx.Response | httpx.TransportError, None]:
        """The retry rules of one call, without I/O: yields a ``_Try`` for each try and is sent
        what the try got (a response or a transport error); yields ``_Done`` with the reply.

        Connection errors and 5xx replies are retried with backoff; a 4xx raises its error.
        ``once``: not idempotent, so not retried once the request may have been sent.
        """
        ep = call.endpoint
        content, headers = ep.encode(call.record) if call.record is not None else (None, {})
        request = {
            "method": ep.method, "url": ep.path, "content": content, "headers": headers,
            "timeout": call.timeout_s or self.timeout_s,
        }  # fmt: skip
        last = ""
        for attempt in range(self.retries + 1):
            got = yield _Try(self._backoff(attempt - 1) if attempt else 0.0, request)
            if isinstance(got, httpx.TransportError):
                last = f"{type(got).__name__}: {got}"
                if call.once and not isinstance(got, httpx.ConnectError):
                    raise ServiceUnavailableError(
                        f"dataflow service at {self.url}: {ep.path} failed after the request "
                        f"was sent, so it may or may not have been applied (not retried: it is "
                        f"not idempotent): {last}"
                    ) from got
            elif got.status_code >= 500:
                last = f"HTTP {got.status_code}: {got.text[:200]}"
            else:
                _raise_for(got)
                yield _Done(ep.decode(got))
                return
        raise ServiceUnavailableError(
            f"dataflow service at {self.url} did not answer {ep.path} after "
            f"{self.retries + 1} tries: {last}"
        )


def _pool_request(pool: str, nodes: int | None, delta: int | None) -> PoolSizeRequest:
    """A pool size request, validated here (``ValidationError`` names the field)."""
    return parse(PoolSizeRequest, {"pool": pool, "nodes": nodes, "delta": delta})


class DataflowClient(_Base):
    """Blocking client of the dataflow service (``/v1``)."""

    _http: httpx.Client

    def _open(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers=self._headers, timeout=self.timeout_s, verify=ssl_context()
        )

    def _call(self, call: _Call[R]) -> R:
        tries = self._tries(call)
        step = next(tries)
        while isinstance(step, _Try):
            if step.delay:
                time.sleep(step.delay)
            try:
                got: httpx.Response | httpx.TransportError = self._http.request(**step.request)
            except httpx.TransportError as exc:
                got = exc
            step = tries.send(got)
        return step.value

    def health(self) -> dict[str, Any]:
        """Liveness and counts."""
        return self._call(HEALTH())

    def lease(self, req: LeaseRequest) -> LeaseReply:
        """Ask for tasks."""
        return self._call(LEASE(req))

    def renew(self, req: RenewRequest) -> RenewReply:
        """Heartbeat: extend leases."""
        return self._call(RENEW(req))

    def submit(self, req: SubmitRequest) -> SubmitReply:
        """Submit a task's samples (idempotent on ``(task_id, attempt)``: safe to retry)."""
        return self._call(SUBMIT(req))

    def submit_many(self, req: SubmitManyRequest) -> SubmitManyReply:
        """Several tasks' samples in one request: one outcome each (idempotent, like submit)."""
        return self._call(SUBMIT_MANY(req))

    def fail(self, req: FailRequest) -> FailReply:
        """Report a failed task."""
        return self._call(FAIL(req))

    def release(self, req: ReleaseRequest) -> ReleaseReply:
        """Hand leases back (graceful stop)."""
        return self._call(RELEASE(req))

    def take_batch(self, req: TakeBatchRequest) -> Batch | None:
        """A batch, or None when the long-poll timed out with nothing to train on."""
        return self._call(TAKE(req, timeout_s=self.timeout_s + req.timeout_s))

    def hand_back(self, req: HandBackRequest) -> HandBackReply:
        """Give back the batches a stopping trainer will not train."""
        return self._call(HAND_BACK(req))

    def ack(self, req: AckRequest) -> None:
        """The step on this batch is committed."""
        self._call(ACK(req))

    def announce(self, version: PolicyVersion) -> AnnounceReply:
        """Announce a published policy version."""
        return self._call(ANNOUNCE(version))

    def versions(self) -> dict[str, PolicyVersion]:
        """Latest version per policy."""
        return self._call(VERSIONS())

    def watch_versions(self, req: WatchVersionsRequest) -> dict[str, PolicyVersion]:
        """Latest version per policy, once one in ``req.known`` is newer (or at the timeout)."""
        return self._call(WATCH_VERSIONS(req, timeout_s=self.timeout_s + req.timeout_s))

    def report(self) -> DataflowReport:
        """The pool report."""
        return self._call(REPORT())

    def pool_sizes(self) -> PoolSizes:
        """Admin: desired, observed and dead-band target node counts per pool."""
        return self._call(POOL_SIZES())

    def set_pool_size(
        self, pool: str, nodes: int | None = None, delta: int | None = None
    ) -> PoolSize:
        """Admin: set a pool's desired node count (``nodes``) or change it by ``delta``."""
        req = _pool_request(pool, nodes, delta)
        return self._call(SET_POOL_SIZE(req, once=delta is not None))

    def post_metrics(self, points: list[MetricPoint]) -> None:
        """Admin: metric points for the dashboard (held-out accuracy per version ...)."""
        self._call(POST_METRICS(MetricPoints(points=points)))

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncDataflowClient(_Base):
    """asyncio client of the dataflow service, with the same methods as ``DataflowClient``."""

    _http: httpx.AsyncClient

    def _open(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url, headers=self._headers, timeout=self.timeout_s, verify=ssl_context(),
            limits=httpx.Limits(max_connections=_ASYNC_CONNECTIONS,
                                max_keepalive_connections=_ASYNC_CONNECTIONS),
        )  # fmt: skip

    async def _call(self, call: _Call[R]) -> R:
        tries = self._tries(call)
        step = next(tries)
        while isinstance(step, _Try):
            if step.delay:
                await asyncio.sleep(step.delay)
            try:
                got: httpx.Response | httpx.TransportError = await self._http.request(
                    **step.request
                )
            except httpx.TransportError as exc:
                got = exc
            step = tries.send(got)
        return step.value

    async def health(self) -> dict[str, Any]:
        """Liveness and counts."""
        return await self._call(HEALTH())

    async def lease(self, req: LeaseRequest) -> LeaseReply:
        """Ask for tasks."""
        return await self._call(LEASE(req))

    async def renew(self, req: RenewRequest) -> RenewReply:
        """Heartbeat: extend leases."""
        return await self._call(RENEW(req))

    async def submit(self, req: SubmitRequest) -> SubmitReply:
        """Submit a task's samples (idempotent on ``(task_id, attempt)``: safe to retry)."""
        return await self._call(SUBMIT(req))

    async def submit_many(self, req: SubmitManyRequest) -> SubmitManyReply:
        """Several tasks' samples in one request: one outcome each (idempotent, like submit)."""
        return await self._call(SUBMIT_MANY(req))

    async def fail(self, req: FailRequest) -> FailReply:
        """Report a failed task."""
        return await self._call(FAIL(req))

    async def release(self, req: ReleaseRequest) -> ReleaseReply:
        """Hand leases back (graceful stop)."""
        return await self._call(RELEASE(req))

    async def take_batch(self, req: TakeBatchRequest) -> Batch | None:
        """A batch, or None when the long-poll timed out with nothing to train on."""
        return await self._call(TAKE(req, timeout_s=self.timeout_s + req.timeout_s))

    async def hand_back(self, req: HandBackRequest) -> HandBackReply:
        """Give back the batches a stopping trainer will not train."""
        return await self._call(HAND_BACK(req))

    async def ack(self, req: AckRequest) -> None:
        """The step on this batch is committed."""
        await self._call(ACK(req))

    async def announce(self, version: PolicyVersion) -> AnnounceReply:
        """Announce a published policy version."""
        return await self._call(ANNOUNCE(version))

    async def versions(self) -> dict[str, PolicyVersion]:
        """Latest version per policy."""
        return await self._call(VERSIONS())

    async def watch_versions(self, req: WatchVersionsRequest) -> dict[str, PolicyVersion]:
        """Latest version per policy, once one in ``req.known`` is newer (or at the timeout)."""
        return await self._call(WATCH_VERSIONS(req, timeout_s=self.timeout_s + req.timeout_s))

    async def report(self) -> DataflowReport:
        """The pool report."""
        return await self._call(REPORT())

    async def pool_sizes(self) -> PoolSizes:
        """Admin: desired, observed and dead-band target node counts per pool."""
        return await self._call(POOL_SIZES())

    async def set_pool_size(
        self, pool: str, nodes: int | None = None, delta: int | None = None
    ) -> PoolSize:
        """Admin: set a pool's desired node count (``nodes``) or change it by ``delta``."""
        req = _pool_request(pool, nodes, delta)
        return await self._call(SET_POOL_SIZE(req, once=delta is not None))

    async def post_metrics(self, points: list[MetricPoint]) -> None:
        """Admin: metric points for the dashboard (held-out accuracy per version ...)."""
        await self._call(POST_METRICS(MetricPoints(points=points)))

    async def close(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
