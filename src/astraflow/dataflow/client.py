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
import random
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self, TypeVar

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
    LeaseReply,
    LeaseRequest,
    PolicyVersion,
    PoolSize,
    PoolSizeRequest,
    PoolSizes,
    ReleaseReply,
    ReleaseRequest,
    RenewReply,
    RenewRequest,
    SubmitReply,
    SubmitRequest,
    TakeBatchRequest,
    pack,
    parse,
    parse_json,
    unpack,
)

__all__ = ["AsyncDataflowClient", "DataflowClient"]

T = TypeVar("T", bound=BaseModel)

_MAX_BACKOFF_S = 5.0


def _json_body(record: BaseModel) -> tuple[bytes, dict[str, str]]:
    return record.model_dump_json().encode(), {"content-type": JSON_MEDIA_TYPE}


def _msgpack_body(record: BaseModel) -> tuple[bytes, dict[str, str]]:
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


def _pool_request(pool: str, nodes: int | None, delta: int | None) -> tuple[bytes, dict[str, str]]:
    """The body of a pool size request, validated here (``ValidationError`` names the field)."""
    return _json_body(parse(PoolSizeRequest, {"pool": pool, "nodes": nodes, "delta": delta}))


class _Base:
    def __init__(self, url: str, *, token: str | None, timeout_s: float, retries: int) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self._jitter = random.Random()

    def _backoff(self, attempt: int) -> float:
        return min(_MAX_BACKOFF_S, 0.1 * 2.0**attempt) * (0.5 + self._jitter.random())

    def _unknown(self, path: str, last: str) -> ServiceUnavailableError:
        return ServiceUnavailableError(
            f"dataflow service at {self.url}: {path} failed after the request was sent, so it "
            f"may or may not have been applied (not retried: it is not idempotent): {last}"
        )

    def _give_up(self, path: str, last: str) -> ServiceUnavailableError:
        return ServiceUnavailableError(
            f"dataflow service at {self.url} did not answer {path} after "
            f"{self.retries + 1} tries: {last}"
        )


class DataflowClient(_Base):
    """Blocking client of the dataflow service (``/v1``)."""

    def __init__(
        self, url: str, *, token: str | None = None, timeout_s: float = 30.0, retries: int = 5
    ) -> None:
        super().__init__(url, token=token, timeout_s=timeout_s, retries=retries)
        self._http = httpx.Client(base_url=self.url, headers=self._headers, timeout=timeout_s)

    def _send(
        self,
        method: str,
        path: str,
        body: tuple[bytes, dict[str, str]] | None = None,
        timeout_s: float | None = None,
        once: bool = False,
    ) -> httpx.Response:
        content, headers = body if body is not None else (None, {})
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self._backoff(attempt - 1))
            try:
                resp = self._http.request(
                    method, path, content=content, headers=headers,
                    timeout=timeout_s or self.timeout_s,
                )  # fmt: skip
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                if once and not isinstance(exc, httpx.ConnectError):
                    raise self._unknown(path, last) from exc
                continue
            if resp.status_code >= 500:
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            _raise_for(resp)
            return resp
        raise self._give_up(path, last)

    def health(self) -> dict[str, Any]:
        """Liveness and counts."""
        return _dict(self._send("GET", "/v1/health"))

    def lease(self, req: LeaseRequest) -> LeaseReply:
        """Ask for tasks."""
        return _reply(LeaseReply)(self._send("POST", "/v1/lease", _json_body(req)))

    def renew(self, req: RenewRequest) -> RenewReply:
        """Heartbeat: extend leases."""
        return _reply(RenewReply)(self._send("POST", "/v1/renew", _json_body(req)))

    def submit(self, req: SubmitRequest) -> SubmitReply:
        """Submit a task's samples (idempotent on ``(task_id, attempt)``: safe to retry)."""
        return _reply(SubmitReply)(self._send("POST", "/v1/submit", _msgpack_body(req)))

    def fail(self, req: FailRequest) -> FailReply:
        """Report a failed task."""
        return _reply(FailReply)(self._send("POST", "/v1/fail", _json_body(req)))

    def release(self, req: ReleaseRequest) -> ReleaseReply:
        """Hand leases back (graceful stop)."""
        return _reply(ReleaseReply)(self._send("POST", "/v1/release", _json_body(req)))

    def take_batch(self, req: TakeBatchRequest) -> Batch | None:
        """A batch, or None when the long-poll timed out with nothing to train on."""
        timeout = self.timeout_s + req.timeout_s
        return _batch(self._send("POST", "/v1/batches/take", _json_body(req), timeout))

    def ack(self, req: AckRequest) -> None:
        """The step on this batch is committed."""
        _none(self._send("POST", "/v1/batches/ack", _json_body(req)))

    def announce(self, version: PolicyVersion) -> AnnounceReply:
        """Announce a published policy version."""
        return _reply(AnnounceReply)(self._send("POST", "/v1/versions", _json_body(version)))

    def versions(self) -> dict[str, PolicyVersion]:
        """Latest version per policy."""
        return _versions(self._send("GET", "/v1/versions"))

    def report(self) -> DataflowReport:
        """The pool report."""
        return _reply(DataflowReport)(self._send("GET", "/v1/report"))

    def pool_sizes(self) -> PoolSizes:
        """Admin: desired, observed and dead-band target node counts per pool."""
        return _reply(PoolSizes)(self._send("GET", "/v1/admin/pools"))

    def set_pool_size(
        self, pool: str, nodes: int | None = None, delta: int | None = None
    ) -> PoolSize:
        """Admin: set a pool's desired node count (``nodes``) or change it by ``delta``."""
        body = _pool_request(pool, nodes, delta)
        resp = self._send("POST", "/v1/admin/pools", body, once=delta is not None)
        return _reply(PoolSize)(resp)

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

    def __init__(
        self, url: str, *, token: str | None = None, timeout_s: float = 30.0, retries: int = 5
    ) -> None:
        super().__init__(url, token=token, timeout_s=timeout_s, retries=retries)
        self._http = httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=timeout_s)

    async def _send(
        self,
        method: str,
        path: str,
        body: tuple[bytes, dict[str, str]] | None = None,
        timeout_s: float | None = None,
        once: bool = False,
    ) -> httpx.Response:
        content, headers = body if body is not None else (None, {})
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self._backoff(attempt - 1))
            try:
                resp = await self._http.request(
                    method, path, content=content, headers=headers,
                    timeout=timeout_s or self.timeout_s,
                )  # fmt: skip
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                if once and not isinstance(exc, httpx.ConnectError):
                    raise self._unknown(path, last) from exc
                continue
            if resp.status_code >= 500:
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            _raise_for(resp)
            return resp
        raise self._give_up(path, last)

    async def health(self) -> dict[str, Any]:
        """Liveness and counts."""
        return _dict(await self._send("GET", "/v1/health"))

    async def lease(self, req: LeaseRequest) -> LeaseReply:
        """Ask for tasks."""
        return _reply(LeaseReply)(await self._send("POST", "/v1/lease", _json_body(req)))

    async def renew(self, req: RenewRequest) -> RenewReply:
        """Heartbeat: extend leases."""
        return _reply(RenewReply)(await self._send("POST", "/v1/renew", _json_body(req)))

    async def submit(self, req: SubmitRequest) -> SubmitReply:
        """Submit a task's samples (idempotent on ``(task_id, attempt)``: safe to retry)."""
        return _reply(SubmitReply)(await self._send("POST", "/v1/submit", _msgpack_body(req)))

    async def fail(self, req: FailRequest) -> FailReply:
        """Report a failed task."""
        return _reply(FailReply)(await self._send("POST", "/v1/fail", _json_body(req)))

    async def release(self, req: ReleaseRequest) -> ReleaseReply:
        """Hand leases back (graceful stop)."""
        return _reply(ReleaseReply)(await self._send("POST", "/v1/release", _json_body(req)))

    async def take_batch(self, req: TakeBatchRequest) -> Batch | None:
        """A batch, or None when the long-poll timed out with nothing to train on."""
        timeout = self.timeout_s + req.timeout_s
        return _batch(await self._send("POST", "/v1/batches/take", _json_body(req), timeout))

    async def ack(self, req: AckRequest) -> None:
        """The step on this batch is committed."""
        _none(await self._send("POST", "/v1/batches/ack", _json_body(req)))

    async def announce(self, version: PolicyVersion) -> AnnounceReply:
        """Announce a published policy version."""
        resp = await self._send("POST", "/v1/versions", _json_body(version))
        return _reply(AnnounceReply)(resp)

    async def versions(self) -> dict[str, PolicyVersion]:
        """Latest version per policy."""
        return _versions(await self._send("GET", "/v1/versions"))

    async def report(self) -> DataflowReport:
        """The pool report."""
        return _reply(DataflowReport)(await self._send("GET", "/v1/report"))

    async def pool_sizes(self) -> PoolSizes:
        """Admin: desired, observed and dead-band target node counts per pool."""
        return _reply(PoolSizes)(await self._send("GET", "/v1/admin/pools"))

    async def set_pool_size(
        self, pool: str, nodes: int | None = None, delta: int | None = None
    ) -> PoolSize:
        """Admin: set a pool's desired node count (``nodes``) or change it by ``delta``."""
        body = _pool_request(pool, nodes, delta)
        resp = await self._send("POST", "/v1/admin/pools", body, once=delta is not None)
        return _reply(PoolSize)(resp)

    async def close(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
