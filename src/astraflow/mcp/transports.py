"""Serving the MCP server over stdio or streamable HTTP (the latter behind the admin token).

Over HTTP every request must carry ``Authorization: Bearer <admin token>`` (compared in
constant time); anything else is answered 401 before it reaches the MCP session layer.
Without a token (an open dataflow service) HTTP binds to loopback only.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer
from starlette.types import ASGIApp, Receive, Scope, Send

from astraflow.errors import ConfigError

__all__ = ["BearerGate", "http_app", "serve_http", "serve_stdio"]

#: The MCP endpoint path of the HTTP transport.
MCP_PATH = "/mcp"


class BearerGate:
    """ASGI middleware: HTTP requests need the bearer token; lifespan events pass through."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self._expected = None if token is None else f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._expected is None:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        body = json.dumps(
            {"error": {"code": "unauthorized", "message": "no valid bearer token: "
                       "send 'Authorization: Bearer <the run's admin token>'"}}
        ).encode()  # fmt: skip
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
            (b"content-length", str(len(body)).encode()),
        ]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def http_app(server: MCPServer, token: str | None, host: str) -> Any:
    """The streamable-HTTP app at ``/mcp`` behind the bearer gate."""
    if token is None and not _loopback(host):
        raise ConfigError(
            f"astraflow mcp over HTTP on {host} needs the admin token (ASTRAFLOW_ADMIN_TOKEN): "
            "without one it serves on a loopback address only"
        )
    app = server.streamable_http_app(streamable_http_path=MCP_PATH, host=host)
    return BearerGate(app, token)


def serve_http(server: MCPServer, token: str | None, host: str, port: int) -> None:
    """Serve over streamable HTTP until interrupted."""
    app = http_app(server, token, host)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).run()


def serve_stdio(server: MCPServer) -> None:
    """Serve over stdin/stdout until the client closes them."""
    server.run("stdio")
