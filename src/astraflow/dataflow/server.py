"""Serve the dataflow service over HTTP with uvicorn (``astraflow dataflow serve``).

serve(config, stop): write run_dir/dataflow.config.json → open the state → listen until
    SIGTERM or the stop event
ThreadedServer: the same app on a background thread (tests, benchmarks, embedding)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import uvicorn
from starlette.applications import Starlette

from astraflow.config import dump_config
from astraflow.dataflow.app import create_app
from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.service import DataflowService
from astraflow.serving import BackgroundServer

__all__ = ["ThreadedServer", "build_app", "serve"]

log = logging.getLogger(__name__)

#: Seconds a stopping server gives open requests (long-polls) before closing them.
GRACEFUL_SHUTDOWN_S = 2


def build_app(config: DataflowConfig, *, datasets: Mapping[str, Any] | None = None) -> Starlette:
    """Open the run directory's state and wrap it in the ``/v1`` app (which owns it)."""
    return create_app(DataflowService(config, datasets=datasets), owns_service=True)


def _uvicorn_config(app: Starlette, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


def serve(config: DataflowConfig, stop: threading.Event | None = None) -> None:
    """Run the service in this thread until SIGINT / SIGTERM (main thread) or ``stop`` is set;
    either stops it the same way: open requests get ``GRACEFUL_SHUTDOWN_S``, then the state
    is closed."""
    config.run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config, config.run_dir / "dataflow.config.json")
    app = build_app(config)
    page = " dashboard=/dashboard" if config.dashboard.enabled else ""
    log.info("dataflow serving url=http://%s:%d run_dir=%s%s", config.host, config.port,
             config.run_dir, page)  # fmt: skip
    server = uvicorn.Server(_uvicorn_config(app, config.host, config.port))
    if stop is None:
        server.run()
        return
    done = threading.Event()

    def watch() -> None:  # the stop event does what a signal does: ask uvicorn to exit
        while not done.is_set():
            if stop.wait(0.2):
                server.should_exit = True
                return

    threading.Thread(target=watch, name="dataflow-stop", daemon=True).start()
    try:
        server.run()
    finally:
        done.set()


class ThreadedServer(BackgroundServer):
    """The dataflow app served by uvicorn on a background thread."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(uvicorn.Server(_uvicorn_config(app, host, port)), host, "dataflow server")
