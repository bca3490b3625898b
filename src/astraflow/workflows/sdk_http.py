"""Shared HTTP clients for the ``openai`` SDK clients of agents (``agent`` workflow).

An ``openai.AsyncOpenAI`` built per episode with its own HTTP client pays for a fresh TLS
context (the CA bundle read and parsed, ~25 ms of CPU on the event loop) and new
connections every episode. Agents instead share one client per transport: the node's
endpoint makes and closes those of agents in its process, an agent worker process
(``workflows.agent_worker``) makes its own loopback one:

    in_process  requests go straight into the endpoint's ASGI app (no sockets, no HTTP
                parsing on either side): the cheapest path, same routes, same errors
    loopback    real HTTP to the endpoint's port, keep-alive connections pooled

The client is the ``httpx`` flavour the installed ``openai`` package builds its own with
(``openai.DefaultAsyncHttpxClient``), so it is accepted as ``http_client``.
"""

from __future__ import annotations

import importlib
from typing import Any, Literal

__all__ = ["CLIENT_KEEPALIVE_S", "SERVER_KEEPALIVE_S", "Transport", "sdk_http_client"]

Transport = Literal["in_process", "loopback"]

#: Keep-alive connections kept per loopback client (one per concurrent agent call).
MAX_KEEPALIVE = 512
#: Seconds the endpoint's server keeps an idle connection open, and (well under it) the
#: seconds a loopback client reuses one: with both at the libraries' 5 s, a connection idle
#: for ~5 s (an agent's tool call, a loaded machine) was reused just as the server closed it,
#: and the call failed with a read error while its generation was cancelled.
SERVER_KEEPALIVE_S = 60.0
CLIENT_KEEPALIVE_S = 20.0


def _httpx_flavour(client_cls: type) -> Any:
    """The ``httpx``-like package ``client_cls`` derives from (httpx, or a successor)."""
    for base in client_cls.__mro__:
        if base.__name__ == "AsyncClient":
            return importlib.import_module(base.__module__.split(".")[0])
    raise TypeError(f"{client_cls!r} is not an httpx AsyncClient")


def sdk_http_client(transport: Transport, app: Any) -> Any:
    """A new HTTP client for ``openai.AsyncOpenAI(http_client=...)`` reaching ``app``."""
    import openai

    client_cls = openai.DefaultAsyncHttpxClient
    lib = _httpx_flavour(client_cls)
    if transport == "in_process":
        # the app answers every failure itself (a 500 naming no internals): never re-raise
        asgi = lib.ASGITransport(app=app, raise_app_exceptions=False)
        return client_cls(transport=asgi, trust_env=False)
    limits = lib.Limits(
        max_connections=None,
        max_keepalive_connections=MAX_KEEPALIVE,
        keepalive_expiry=CLIENT_KEEPALIVE_S,
    )
    # trust_env=False: a proxy from the environment must never see loopback agent traffic
    return client_cls(limits=limits, trust_env=False)
