"""Moving store files to a node: HTTP range pulls (parallel, resumable) or any fsspec URL.

One file is split into ``streams`` byte ranges fetched on their own connections into a
pre-sized local file. A cut connection resumes from the last byte written; a stream that
receives nothing for ``stall_s`` seconds is cut and retried; the whole file has a deadline.
Errors name the source, the policy, the version and the file::

    range [lo, hi) ──GET Range: bytes=pos-(hi-1)──► write at pos ──► pos == hi: done
          ▲                                                  │ cut / stalled / 5xx
          └──────── backoff, attempt+1 (reset on progress) ◄─┘ ──► too many / deadline: raise
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import ssl
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from astraflow.errors import (
    AuthError,
    ForbiddenError,
    NotFoundError,
    TransferError,
    TransferTimeoutError,
)
from astraflow.weights.files import StoreFiles
from astraflow.weights.manifest import WeightManifest, check_policy

__all__ = ["FsSource", "HttpSource", "Source", "TransferOptions", "open_source"]

logger = logging.getLogger(__name__)

#: Route prefix of the weight server (``astraflow weights serve`` mounts the app here).
PREFIX = "/v1/weights"


@dataclass(frozen=True)
class TransferOptions:
    """Bounds and shape of pulls."""

    timeout_s: float = 600.0
    """Deadline for one file (and for one small request with its retries)."""
    stall_s: float = 30.0
    """A connection that delivers no byte for this long is cut and retried."""
    connect_s: float = 10.0
    """TCP connect timeout."""
    streams: int = 4
    """Parallel range streams for one large file."""
    split_bytes: int = 8 << 20
    """Files at least this large are split across ``streams``."""
    retries: int = 5
    """Consecutive failed attempts (without progress) before a stream gives up."""
    chunk_bytes: int = 1 << 20
    """Read size of one stream."""
    token: str | None = field(default=None, repr=False)
    """Bearer token sent to a weight server (None: none)."""


class Source(Protocol):
    """Where a node reads a store from."""

    url: str

    def read(self, rel: str, what: str) -> bytes:
        """Read a small file whole (manifests, JSON)."""
        ...

    def fetch(self, rel: str, size: int, dest: Path, what: str) -> int:
        """Download ``rel`` (``size`` bytes) to ``dest``; returns the number of resumes."""
        ...

    def chunks(self, rel: str, what: str) -> Iterator[bytes]:
        """Read ``rel`` whole, as it arrives, in one try (no resume: a caller falls back to
        ``fetch``); before its size and checksum are known, e.g. with its manifest."""
        ...

    def latest(self, policy: str) -> int | None:
        """The newest version of ``policy``."""
        ...

    def check(self) -> None:
        """Raise, naming the source, unless it can be read (a server that answers its health
        route; a store root that exists)."""
        ...

    def merged(self, policy: str, have: int, want: int) -> WeightManifest | None:
        """A merged delta ``have`` → ``want`` if the source can make one, else None."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


def open_source(source: str | Path, options: TransferOptions) -> Source:
    """An ``HttpSource`` for http(s) URLs (sending ``options.token``), else an ``FsSource``
    (local path or fsspec URL)."""
    text = str(source)
    if text.startswith(("http://", "https://")):
        return HttpSource(text, options)
    return FsSource(text, options)


class HttpSource:
    """A weight server (``astraflow weights serve`` or the app mounted elsewhere)."""

    def __init__(self, url: str, options: TransferOptions) -> None:
        self.url = url.rstrip("/")
        self.options = options
        limits = httpx.Limits(max_connections=max(8, 2 * options.streams))
        headers = {"authorization": f"Bearer {options.token}"} if options.token else {}
        self._client = httpx.Client(
            limits=limits,
            timeout=self._timeout(options.stall_s),
            headers=headers,
            verify=_ssl_context(),
        )
        self._closed = threading.Event()

    def _timeout(self, read_s: float) -> httpx.Timeout:
        o = self.options
        return httpx.Timeout(connect=o.connect_s, read=read_s, write=o.stall_s, pool=o.timeout_s)

    def read(self, rel: str, what: str) -> bytes:
        return self._get(f"{PREFIX}/files/{rel}", what)

    def check(self) -> None:
        self._get(f"{PREFIX}/health", "health")

    def latest(self, policy: str) -> int | None:
        body = json.loads(self._get(f"{PREFIX}/{check_policy(policy)}/latest", f"{policy} latest"))
        version = body.get("version")
        return None if version is None else int(version)

    def merged(self, policy: str, have: int, want: int) -> WeightManifest | None:
        what = f"policy {policy} merged delta v{have}->v{want}"
        try:
            data = self._get(f"{PREFIX}/{check_policy(policy)}/merged/{have}/{want}", what)
        except NotFoundError:
            return None
        return WeightManifest.from_json(data, where=f"{self.url} {what}")

    def _get(self, path: str, what: str) -> bytes:
        deadline = time.monotonic() + self.options.timeout_s
        attempt = 0
        while True:
            try:
                reply = self._client.get(
                    f"{self.url}{path}", timeout=self._timeout(self._read_s(deadline))
                )
            except httpx.TransportError as exc:
                attempt = self._failed(attempt, deadline, what, exc)
                continue
            if reply.status_code == 404:
                raise NotFoundError(f"{self.url}: {what}: not found")
            _raise_refused(reply, self.url, what)
            if reply.status_code >= 400:
                exc2 = TransferError(f"HTTP {reply.status_code}: {reply.text[:200]}")
                if reply.status_code < 500:
                    raise TransferError(f"pull from {self.url} failed: {what}: {exc2}")
                attempt = self._failed(attempt, deadline, what, exc2)
                continue
            return reply.content

    def chunks(self, rel: str, what: str) -> Iterator[bytes]:
        url = f"{self.url}{PREFIX}/files/{rel}"
        with self._client.stream("GET", url) as reply:
            if reply.status_code == 404:
                raise NotFoundError(f"{self.url}: {what}: not found")
            if reply.status_code != 200:
                reply.read()
                _raise_refused(reply, self.url, what)
                raise TransferError(
                    f"pull from {self.url} failed: {what}: HTTP {reply.status_code}"
                )
            yield from reply.iter_bytes()

    def fetch(self, rel: str, size: int, dest: Path, what: str) -> int:
        deadline = time.monotonic() + self.options.timeout_s
        with dest.open("wb") as f:
            f.truncate(size)
        if size == 0:
            return 0
        parts = self.options.streams if size >= self.options.split_bytes else 1
        bounds = [size * i // parts for i in range(parts + 1)]
        stop = threading.Event()
        fd = os.open(dest, os.O_WRONLY)
        try:
            with ThreadPoolExecutor(parts, thread_name_prefix="weights-pull") as pool:
                futures = [
                    pool.submit(self._stream, rel, fd, lo, hi, what, deadline, stop)
                    for lo, hi in itertools.pairwise(bounds)
                ]
                try:
                    return sum(f.result() for f in futures)
                finally:
                    stop.set()
        finally:
            os.close(fd)

    def _stream(
        self, rel: str, fd: int, lo: int, hi: int, what: str, deadline: float, stop: threading.Event
    ) -> int:
        """Fetch bytes [lo, hi) into ``fd``; returns how many times it resumed."""
        pos, attempt, resumes = lo, 0, 0
        url = f"{self.url}{PREFIX}/files/{rel}"
        while pos < hi and not stop.is_set():
            if pos > lo and attempt:
                resumes += 1
            headers = {"Range": f"bytes={pos}-{hi - 1}"}
            progressed = False
            try:
                timeout = self._timeout(self._read_s(deadline))
                with self._client.stream("GET", url, headers=headers, timeout=timeout) as reply:
                    self._check_range_reply(reply, pos, hi, what)
                    for chunk in reply.iter_bytes():  # as received: a cut loses nothing
                        if pos + len(chunk) > hi:
                            raise TransferError(f"pull from {self.url} failed: {what}: too long")
                        os.pwrite(fd, chunk, pos)
                        pos += len(chunk)
                        progressed = True
                        if stop.is_set() or time.monotonic() > deadline:
                            break
                if pos < hi:
                    raise httpx.RemoteProtocolError("connection closed before the range ended")
            except (httpx.TransportError, _Retryable) as exc:
                attempt = 0 if progressed else attempt
                attempt = self._failed(attempt, deadline, f"{what} at byte {pos}", exc)
        return resumes

    def _check_range_reply(self, reply: httpx.Response, pos: int, hi: int, what: str) -> None:
        if reply.status_code == 404:
            raise NotFoundError(f"{self.url}: {what}: not found")
        if reply.status_code in (401, 403):
            reply.read()
            _raise_refused(reply, self.url, what)
        if reply.status_code >= 500:
            raise _Retryable(f"HTTP {reply.status_code}")
        if reply.status_code != 206:
            raise TransferError(
                f"pull from {self.url} failed: {what}: expected 206 for bytes {pos}-{hi - 1}, "
                f"got HTTP {reply.status_code}"
            )

    def _read_s(self, deadline: float) -> float:
        return max(0.05, min(self.options.stall_s, deadline - time.monotonic()))

    def _failed(self, attempt: int, deadline: float, what: str, exc: Exception) -> int:
        attempt += 1
        left = deadline - time.monotonic()
        stalled = isinstance(exc, httpx.TimeoutException)
        if attempt > self.options.retries or left <= 0:
            cls = TransferTimeoutError if stalled or left <= 0 else TransferError
            reason = "no progress" if stalled else type(exc).__name__
            raise cls(
                f"pull from {self.url} failed: {what}: {reason} ({exc}) after {attempt} attempts"
            ) from exc
        logger.warning(
            "pull retry source=%s what=%r attempt=%d error=%s", self.url, what, attempt, exc
        )
        if self._closed.wait(min(0.1 * 2**attempt, 2.0, max(left, 0.0))):
            raise TransferError(f"pull from {self.url} failed: {what}: client closed")
        return attempt

    def close(self) -> None:
        self._closed.set()
        self._client.close()


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """httpx's default verifying context, made once per process: building one (reading the
    CA bundle) costs ~25 ms of CPU, which a client made per pull paid each time."""
    return httpx.create_ssl_context()


def _raise_refused(reply: httpx.Response, url: str, what: str) -> None:
    """401 / 403 from the server: the token is missing, wrong, or of the wrong role."""
    if reply.status_code not in (401, 403):
        return
    cls = AuthError if reply.status_code == 401 else ForbiddenError
    raise cls(
        f"pull from {url} refused: {what}: HTTP {reply.status_code} {reply.text[:200]} "
        "(set ASTRAFLOW_WEIGHTS_READ_TOKEN)"
    )


class _Retryable(Exception):
    """A server answer worth retrying (5xx)."""


class FsSource:
    """A store read directly: a local directory or any fsspec URL (object storage)."""

    def __init__(self, url: str, options: TransferOptions) -> None:
        self.url = url
        self.options = options
        self.files = StoreFiles(url, create=False)

    def read(self, rel: str, what: str) -> bytes:
        data: bytes = self._retry(lambda: self.files.read(rel), what)
        return data

    def latest(self, policy: str) -> int | None:
        versions = self._retry(lambda: self.files.versions(policy), f"{policy} versions")
        return versions[-1] if versions else None

    def check(self) -> None:
        if not self._retry(lambda: self.files.fs.isdir(self.files.base), "store root"):
            raise NotFoundError(f"{self.url}: no weight store there (not a directory)")

    def merged(self, policy: str, have: int, want: int) -> WeightManifest | None:
        return None  # composing is done by the client for plain stores

    def chunks(self, rel: str, what: str) -> Iterator[bytes]:
        try:
            with self.files.fs.open(self.files.path(rel), "rb") as src:
                while chunk := src.read(self.options.chunk_bytes):
                    yield chunk
        except FileNotFoundError:
            raise NotFoundError(f"{self.url}: {what}: not found") from None

    def fetch(self, rel: str, size: int, dest: Path, what: str) -> int:
        deadline = time.monotonic() + self.options.timeout_s
        pos, resumes, attempt = 0, 0, 0
        with dest.open("wb") as out:
            while True:
                try:
                    with self.files.fs.open(self.files.path(rel), "rb") as src:
                        src.seek(pos)
                        while chunk := src.read(self.options.chunk_bytes):
                            out.write(chunk)
                            pos += len(chunk)
                            if time.monotonic() > deadline:
                                raise TransferTimeoutError(
                                    f"pull from {self.url} failed: {what}: deadline passed"
                                )
                    return resumes
                except FileNotFoundError:
                    raise NotFoundError(f"{self.url}: {what}: not found") from None
                except OSError as exc:
                    attempt += 1
                    resumes += 1
                    if attempt > self.options.retries or time.monotonic() > deadline:
                        raise TransferError(f"pull from {self.url} failed: {what}: {exc}") from exc
                    time.sleep(min(0.1 * 2**attempt, 2.0))

    def _retry(self, fn: Any, what: str) -> Any:
        attempt = 0
        while True:
            try:
                return fn()
            except OSError as exc:
                attempt += 1
                if attempt > self.options.retries:
                    raise TransferError(f"pull from {self.url} failed: {what}: {exc}") from exc
                time.sleep(min(0.1 * 2**attempt, 2.0))

    def close(self) -> None:
        return None
