"""The weight server: a small Starlette app serving a store directory with HTTP range requests.

Standalone (``astraflow weights serve``) or mounted inside another app at ``/v1/weights``::

    GET /v1/weights/health                      {"status": "ok"}
    GET /v1/weights/{policy}/latest             {"policy": p, "version": int | null}
    GET /v1/weights/{policy}/versions           {"policy": p, "versions": [int, ...]}
    GET /v1/weights/{policy}/merged/{a}/{b}     manifest of the merged delta a → b (made once)
    GET /v1/weights/files/{path}                a store file; Range requests answer 206

Only files under a policy directory are served, never temporary files. Composing a merged
delta runs in a worker thread, once per (policy, a, b) however many nodes ask at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route

from astraflow.errors import AstraflowError, NotFoundError, ValidationError
from astraflow.weights.files import StoreFiles
from astraflow.weights.manifest import check_policy
from astraflow.weights.merge import merge

__all__ = ["serve_in_thread", "standalone_app", "weights_app"]

logger = logging.getLogger(__name__)

_STATUS = {"not_found": 404, "invalid": 400, "checksum": 500}


def weights_app(root: str | Path) -> Starlette:
    """The routes (without the ``/v1/weights`` prefix) serving the store directory ``root``."""
    files = StoreFiles(root)
    if not files.local:
        raise ValidationError(f"the weight server serves a local directory, not {root}")
    base = Path(files.base).resolve()
    locks: dict[tuple[str, int, int], asyncio.Lock] = {}

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def latest(request: Request) -> Response:
        policy = check_policy(request.path_params["policy"])
        versions = await asyncio.to_thread(files.versions, policy)
        return JSONResponse({"policy": policy, "version": versions[-1] if versions else None})

    async def versions(request: Request) -> Response:
        policy = check_policy(request.path_params["policy"])
        found = await asyncio.to_thread(files.versions, policy)
        return JSONResponse({"policy": policy, "versions": found})

    async def merged(request: Request) -> Response:
        policy = check_policy(request.path_params["policy"])
        have, want = int(request.path_params["have"]), int(request.path_params["want"])
        lock = locks.setdefault((policy, have, want), asyncio.Lock())
        async with lock:
            manifest = await asyncio.to_thread(merge, files, policy, have, want)
        return Response(manifest.to_json(), media_type="application/json")

    async def file(request: Request) -> Response:
        rel = request.path_params["path"]
        parts = rel.split("/")
        if len(parts) < 2 or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            raise ValidationError(f"bad file path {rel!r}", field="path")
        check_policy(parts[0])
        path = (base / rel).resolve()
        if base not in path.parents or ".tmp" in path.name or not path.is_file():
            raise NotFoundError(f"no file {rel}")
        return FileResponse(path, media_type="application/octet-stream")

    async def on_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, AstraflowError)
        return JSONResponse(exc.to_wire(), status_code=_STATUS.get(exc.code, 409))

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/files/{path:path}", file),
            Route("/{policy}/latest", latest),
            Route("/{policy}/versions", versions),
            Route("/{policy}/merged/{have:int}/{want:int}", merged),
        ],
        exception_handlers={AstraflowError: on_error},
    )


def standalone_app(root: str | Path) -> Starlette:
    """The app ``astraflow weights serve`` runs: ``weights_app`` mounted at ``/v1/weights``."""
    return Starlette(routes=[Mount("/v1/weights", app=weights_app(root))])


@contextmanager
def serve_in_thread(root: str | Path, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``root`` with uvicorn in a background thread; yields the base URL, stops on exit."""
    config = uvicorn.Config(
        standalone_app(root), host=host, port=port, log_level="warning",
        lifespan="off", ws="none", access_log=False,
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="weights-server", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise AstraflowError(f"weight server on {host}:{port} failed to start")
            threading.Event().wait(0.01)
        bound = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
