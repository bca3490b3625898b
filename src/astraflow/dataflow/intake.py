"""Request bodies of the ``/v1`` app: bounded reading, decoding off the writer, a byte budget.

    request ──size > limit?──► 413
            ──large (> 64 kB) and the budget is spent?──► 503 busy, retry_after_s
            ──read (reserved bytes)──► decode + validate: small on the loop, large in a
              worker thread (never the writer) ──► writer thread: the service call
            ──reply──► budget released

The budget caps the bytes of large bodies being read, decoded and applied at once (JSON
counts :data:`JSON_WEIGHT` times: it decodes into far more memory than msgpack), so the
service's memory stays within a small multiple of it however many big submissions arrive
together; small control messages (lease, renew, take) never wait for it.
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


def decode(cls: type[RecordT], body: bytes, content_type: str) -> RecordT:
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

    def cover(self, size: int) -> None:
        """Hold enough for ``size`` body bytes, or raise 503 (nothing held beyond the cap)."""
        want = min(self.intake.cap, size * self.weight) if size > INLINE_DECODE_BYTES else 0
        if want > self.held:
            self.intake.take(want - self.held)
            self.held = want


class BodyIntake:
    """Reads, bounds and decodes request bodies for one app (all on its event loop)."""

    def __init__(self, limit: int, cap: int, retry_after_s: float) -> None:
        self.limit = limit
        self.cap = cap
        self.retry_after_s = retry_after_s
        self.in_use = 0
        """Budget bytes held by requests now."""
        self.peak = 0

    def take(self, n: int) -> None:
        """Hold ``n`` more budget bytes, or raise ``ServiceBusyError``."""
        if self.in_use + n > self.cap:
            raise ServiceBusyError(
                f"the service is decoding {self.in_use} bytes of large bodies already (cap "
                f"{self.cap}); retry after {self.retry_after_s}s",
                retry_after_s=self.retry_after_s,
                field="body",
            )
        self.in_use += n
        self.peak = max(self.peak, self.in_use)

    @asynccontextmanager
    async def body(self, request: Request) -> AsyncIterator[bytes]:
        """The request's body, read within the limit; budget held until the block exits."""
        media = _media(request.headers.get("content-type", ""))
        held = _Reservation(self, JSON_WEIGHT if media in (JSON_MEDIA_TYPE, "") else 1)
        try:
            yield await self._read(request, held)
        finally:
            self.in_use -= held.held

    async def _read(self, request: Request, held: _Reservation) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ValidationError(f"bad Content-Length {declared!r}", field="content-length")
            if int(declared) > self.limit:
                raise PayloadTooLargeError(
                    f"request body of {declared} bytes exceeds the limit of {self.limit} bytes",
                    field="body",
                )
            held.cover(int(declared))
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.limit:
                raise PayloadTooLargeError(
                    f"request body exceeds the limit of {self.limit} bytes", field="body"
                )
            held.cover(size)
            chunks.append(chunk)
        return b"".join(chunks)

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
