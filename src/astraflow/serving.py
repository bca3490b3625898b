"""An ASGI app served by uvicorn on a background thread: the one runner behind the components'
``Threaded*Server`` classes (tests, benchmarks, embedding). Needs uvicorn only, no torch.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Self

import uvicorn

from astraflow.errors import ServiceUnavailableError

__all__ = ["BackgroundServer"]


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
