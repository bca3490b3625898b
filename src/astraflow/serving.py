"""An ASGI app served by uvicorn on a background thread: the one runner behind the components'
``Threaded*Server`` classes (tests, benchmarks, embedding), and the capped read of a request
body every server uses. Needs uvicorn only, no torch.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING, Self

import uvicorn

from astraflow.errors import ServiceUnavailableError

if TYPE_CHECKING:
    from starlette.requests import Request

__all__ = ["BackgroundServer", "capped_body"]


async def capped_body(request: Request, limit: int) -> bytes | None:
    """The request body, or ``None`` as soon as it is known to be over ``limit`` bytes: by its
    ``Content-Length`` before anything is read, else while it streams in (a client on the
    network must not make a server hold an unbounded body in memory)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


class BackgroundServer:
    """``server`` on a daemon thread named ``name``; ``url`` is valid after ``start``."""

    def __init__(self, server: uvicorn.Server, host: str, name: str) -> None:
        self.server = server
        self.host = host
        self.name = name
        self.url = ""
        self._thread = threading.Thread(target=self.server.run, name=name, daemon=True)

    def start(self, timeout_s: float = 30.0) -> str:
        """Start serving; returns the base URL once the socket listens."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ServiceUnavailableError(f"the {self.name} did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self.url

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop serving and wait for the thread (the app closes its state on shutdown)."""
        self.server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
