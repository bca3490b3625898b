"""Request bodies of the ``/v1`` app: bounded reading, decoding off the writer, a byte budget.

    request ──size > limit?──► 413
            ──large (> 64 kB): wait, unread, for budget (up to busy_wait_s) or 503 busy with
              retry_after_s
            ──read (reserved bytes)──► decode + validate: small on the loop, large in a
              worker thread (never the writer) ──► writer thread: the service call
            ──reply──► budget released

The budget caps the bytes of large bodies being read, decoded and applied at once (JSON
counts :data:`JSON_WEIGHT` times: it decodes into far more memory than msgpack), so the
service's memory stays within a small multiple of it however many big submissions arrive
together; small control messages (lease, renew, take) never wait for it. A body that waits
is not read: uvicorn stops reading its socket past a small buffer, so TCP holds it back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from astraflow.errors import PayloadTooLargeError, ServiceBusyError, ValidationError
from astraflow.records import JSON_MEDIA_TYPE, MSGPACK_MEDIA_TYPE, parse_json, unpack

__all__ = ["INLINE_DECODE_BYTES", "JSON_WEIGHT", "BodyIntake", "decode"]

RecordT = TypeVar("RecordT", bound=BaseModel)

#: Bodies at or below this size are decoded on the event loop, outside the budget.
INLINE_DECODE_BYTES: Final = 64 * 1024
#: How many budget bytes one byte of a JSON body costs (msgpack costs one).
JSON_WEIGHT: Final = 4


def _media(content_type: str) -> str:
    return content_type.split(";")[0].strip().lower()


def decode(cls: type[RecordT], body: bytes | bytearray, content_type: str) -> RecordT:
    """Decode and validate ``body`` as ``cls`` (msgpack or JSON, by content type)."""
    if not body:
        raise ValidationError(f"empty body: expected a {cls.__name__}", field="body")
    media = _media(content_type)
    if media in (MSGPACK_MEDIA_TYPE, "application/x-msgpack"):
        return unpack(cls, body)
    if media in (JSON_MEDIA_TYPE, ""):
        return parse_json(cls, body)
    raise ValidationError(
        f"unsupported Content-Type {media!r}: send {JSON_MEDIA_TYPE} or {MSGPACK_MEDIA_TYPE}",
        field="content-type",
    )


class _Reservation:
    """Budget bytes held by one request; grows as a body of unknown length arrives."""

    def __init__(self, intake: BodyIntake, weight: int) -> None:
        self.intake, self.weight, self.held = intake, weight, 0

    async def cover(self, size: int) -> None:
        """Hold enough for ``size`` body bytes, or raise 503 (nothing held beyond the cap)."""
        want = min(self.intake.cap, size * self.weight) if size > INLINE_DECODE_BYTES else 0
        if want > self.held:
            await self.intake.take(want - self.held)
            self.held = want


class BodyIntake:
    """Reads, bounds and decodes request bodies for one app (all on its event loop)."""

    def __init__(self, limit: int, cap: int, wait_s: float, retry_after_s: float) -> None:
        self.limit = limit
        self.cap = cap
        self.wait_s = wait_s
        self.retry_after_s = retry_after_s
        self.in_use = 0
        """Budget bytes held by requests now."""
        self._freed: asyncio.Condition | None = None

    async def take(self, n: int) -> None:
        """Hold ``n`` more budget bytes, waiting up to ``wait_s``; else ``ServiceBusyError``."""
        if self._freed is None:
            self._freed = asyncio.Condition()
        async with self._freed:
            try:
                await asyncio.wait_for(
                    self._freed.wait_for(lambda: self.in_use + n <= self.cap), self.wait_s
                )
            except TimeoutError:
                raise ServiceBusyError(
                    f"the service is decoding {self.in_use} bytes of large bodies (cap "
                    f"{self.cap}); retry after {self.retry_after_s}s",
                    retry_after_s=self.retry_after_s,
                    field="body",
                ) from None
            self.in_use += n

    async def _give_back(self, n: int) -> None:
        self.in_use -= n  # first: the count is right even if this task is cancelled below
        if n and self._freed is not None:
            async with self._freed:
                self._freed.notify_all()

    @asynccontextmanager
    async def body(self, request: Request) -> AsyncIterator[bytes | bytearray]:
        """The request's body, read within the limit; budget held until the block exits."""
        media = _media(request.headers.get("content-type", ""))
        held = _Reservation(self, JSON_WEIGHT if media in (JSON_MEDIA_TYPE, "") else 1)
        try:
            yield await self._read(request, held)
        finally:
            await self._give_back(held.held)

    async def _read(self, request: Request, held: _Reservation) -> bytes | bytearray:
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ValidationError(f"bad Content-Length {declared!r}", field="content-length")
            if int(declared) > self.limit:
                raise PayloadTooLargeError(
                    f"request body of {declared} bytes exceeds the limit of {self.limit} bytes",
                    field="body",
                )
            await held.cover(int(declared))
        body = bytearray()  # grown in place: one copy of the body, not chunks and a join
        async for chunk in request.stream():
            if len(body) + len(chunk) > self.limit:
                raise PayloadTooLargeError(
                    f"request body exceeds the limit of {self.limit} bytes", field="body"
                )
            await held.cover(len(body) + len(chunk))
            body += chunk
        return body

    @asynccontextmanager
    async def record(self, cls: type[RecordT], request: Request) -> AsyncIterator[RecordT]:
        """The body decoded as ``cls`` (a large one in a worker thread, never the writer);
        its budget is held until the block exits (the service call runs inside it)."""
        ctype = request.headers.get("content-type", "")
        async with self.body(request) as data:
            if len(data) <= INLINE_DECODE_BYTES:
                record = decode(cls, data, ctype)
            else:
                record = await asyncio.to_thread(decode, cls, data, ctype)
            del data  # the bytes can go while the record is applied
            yield record
