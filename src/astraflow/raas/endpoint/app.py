"""``AgentEndpoint``: one OpenAI-compatible HTTP server per node, a session per episode.

Uvicorn runs on loopback inside the node's own event loop. Each agent episode gets a session
under a fresh API key (``Authorization: Bearer KEY``, or in the URL: the session's base URL
is ``/e/KEY/v1``, so a bare base URL works too); the key picks the session, the session its
policies and its recorder. Routes decode → ``service`` → encode; every refusal is an
OpenAI error object with a 4xx status, and an unexpected failure a 500 naming no internals.

    POST [/e/KEY]/v1/chat/completions   POST [/e/KEY]/v1/completions
    GET  [/e/KEY]/v1/models             GET  /health
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pydantic
import pydantic_core
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route

from astraflow.errors import ServiceUnavailableError
from astraflow.raas.endpoint.service import chat_completion, list_models, text_completion
from astraflow.raas.endpoint.wire import ChatRequest, CompletionRequest, EndpointError
from astraflow.serving import capped_body
from astraflow.workflows.agent import AgentSession
from astraflow.workflows.sdk_http import SERVER_KEEPALIVE_S, Transport, sdk_http_client

__all__ = ["AgentEndpoint"]

log = logging.getLogger(__name__)

#: Largest request body accepted (a long agent conversation fits easily).
MAX_BODY_BYTES = 16 << 20

Handler = Callable[[AgentSession, Any], Awaitable[dict[str, Any]]]


class _NodeServer(uvicorn.Server):
    """Uvicorn without its signal capture: the node owns SIGTERM/SIGINT, and the endpoint
    must keep serving running agents through the node's graceful stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class AgentEndpoint:
    """The node's endpoint: sessions by API key and the server that serves them."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.url = ""
        self._sessions: dict[str, AgentSession] = {}
        self._server: uvicorn.Server | None = None
        self._serving: asyncio.Task[None] | None = None
        self._clients: dict[Transport, Any] = {}
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self.requests = 0
        self.errors = 0
        self._totals = {"episodes": 0, "calls": 0, "continued": 0, "segments": 0, "breaks": 0}
        api = [
            Route("/chat/completions", self._chat, methods=["POST"]),
            Route("/completions", self._completions, methods=["POST"]),
            Route("/models", self._models, methods=["GET"]),
        ]
        self.app = Starlette(
            routes=[
                Mount("/v1", routes=api),
                Mount("/e/{key}/v1", routes=api),  # the key in the URL: a bare base URL works
                Route("/health", self._health, methods=["GET"]),
            ]
        )

    # ----------------------------------------------------------------- gateway

    def open(self, session: AgentSession) -> AgentSession:
        """Register ``session`` under a fresh key (see ``AgentGateway.open``)."""
        if not self.url:
            raise ServiceUnavailableError("the agent endpoint is not serving")
        key = f"ep-{secrets.token_urlsafe(24)}"
        session.api_key = key
        session.base_url = f"{self.url}/e/{key}/v1"
        self._sessions[key] = session
        return session

    def http_client(self, transport: Transport) -> Any:
        """The node's shared SDK HTTP client for ``transport`` (see ``workflows.sdk_http``)."""
        if not self.url:
            raise ServiceUnavailableError("the agent endpoint is not serving")
        client = self._clients.get(transport)
        if client is None or client.is_closed:
            client = self._clients[transport] = sdk_http_client(transport, self.app)
        return client

    def on_close(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Await ``closer`` first thing in :meth:`stop` (an agent workflow's workers)."""
        self._closers.append(closer)

    def close(self, session: AgentSession) -> None:
        """Revoke the session's key and add its capture figures to the node's totals."""
        if self._sessions.pop(session.api_key, None) is None:
            return
        rec = session.recorder
        for key, value in (
            ("episodes", 1),
            ("calls", rec.calls),
            ("continued", rec.continued),
            ("segments", rec.segments),
            ("breaks", rec.template_breaks),
        ):
            self._totals[key] += value
        if rec.template_breaks:
            log.warning(
                "chat template not append-only: episode split into segments=%d breaks=%d "
                "policies=%s",
                rec.segments,
                rec.template_breaks,
                sorted(session.policies),
            )

    def metrics(self) -> dict[str, float]:
        """Open sessions, requests served and refused, and capture totals of closed episodes
        (``template_breaks``: calls that extended a conversation the template did not)."""
        t = self._totals
        return {
            "sessions": float(len(self._sessions)),
            "requests": float(self.requests),
            "errors": float(self.errors),
            "episodes": float(t["episodes"]),
            "calls": float(t["calls"]),
            "continued_calls": float(t["continued"]),
            "segments": float(t["segments"]),
            "template_breaks": float(t["breaks"]),
        }

    # ----------------------------------------------------------------- lifecycle

    async def start(self, timeout_s: float = 30.0) -> str:
        """Serve on the current event loop; returns the base URL once listening."""
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_keep_alive=int(SERVER_KEEPALIVE_S),
        )
        self._server = _NodeServer(config)
        self._serving = asyncio.create_task(self._server.serve(), name="agent-endpoint")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._server.started:
            if self._serving.done() or loop.time() > deadline:
                raise ServiceUnavailableError("the agent endpoint did not start")
            await asyncio.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        log.info("agent endpoint serving url=%s", self.url)
        return self.url

    async def stop(self) -> None:
        """Stop serving (idempotent); what asked to be closed with the endpoint is closed
        first, then open sessions are dropped and shared clients closed."""
        closers, self._closers = self._closers, []
        for closer in closers:
            try:
                await closer()
            except Exception:  # one failing closer must not keep the server up
                log.exception("closing with the agent endpoint failed")
        self._sessions.clear()
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            await asyncio.gather(self._serving, return_exceptions=True)
        self._server = self._serving = None
        self.url = ""

    # ----------------------------------------------------------------- routes

    def _session(self, request: Request) -> AgentSession:
        key = str(request.path_params.get("key", ""))
        if not key:
            auth = request.headers.get("authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        session = self._sessions.get(key) if key else None
        if session is None:
            raise EndpointError(
                401,
                "Incorrect API key provided: it names no running episode",
                type="authentication_error",
                code="invalid_api_key",
            )
        return session

    async def _chat(self, request: Request) -> Response:
        return await self._serve(request, ChatRequest, chat_completion)

    async def _completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, text_completion)

    async def _models(self, request: Request) -> Response:
        try:
            return JSONResponse(list_models(self._session(request)))
        except EndpointError as exc:
            return self._error(exc)

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"ok": True, "sessions": len(self._sessions)})

    async def _serve(
        self,
        request: Request,
        model: type[ChatRequest] | type[CompletionRequest],
        handler: Handler,
    ) -> Response:
        self.requests += 1
        try:
            session = self._session(request)
            parsed = model.model_validate(await _json_body(request))
            reply = await _while_connected(request, handler(session, parsed))
            if reply is None:  # the agent hung up (cancelled): nobody reads an answer
                return Response(status_code=499)
            if parsed.stream:
                return StreamingResponse(_sse(reply), media_type="text/event-stream")
            return JSONResponse(reply)
        except EndpointError as exc:
            return self._error(exc)
        except pydantic.ValidationError as exc:
            return self._error(_validation_error(exc))
        except Exception:  # request boundary: never a traceback to the client
            log.exception("agent endpoint request failed path=%s", request.url.path)
            return self._error(
                EndpointError(500, "internal error while generating", type="server_error")
            )

    def _error(self, exc: EndpointError) -> Response:
        self.errors += 1
        return JSONResponse(exc.body(), status_code=exc.status)


async def _while_connected(
    request: Request, work: Awaitable[dict[str, Any]]
) -> dict[str, Any] | None:
    """What ``work`` returns, or None when the client hangs up first: ``work`` is then
    cancelled, so a departed agent's generation stops taking the engine's batch slots (an
    agent cancelled in a worker process, or any client over loopback)."""
    job = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not job.done():
            job.cancel()
    if job.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await job
        return None
    return job.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is read: only that message is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _json_body(request: Request) -> Any:
    body = await capped_body(request, MAX_BODY_BYTES)
    if body is None:  # refused before it is read in full
        raise EndpointError(413, f"request body over {MAX_BODY_BYTES} bytes")
    try:  # pydantic's parser: bounded nesting, no lone surrogates (json.loads has neither)
        data = pydantic_core.from_json(body)
    except ValueError as exc:
        raise EndpointError(400, f"the body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise EndpointError(400, "the body must be a JSON object")
    return data


def _validation_error(exc: pydantic.ValidationError) -> EndpointError:
    first = exc.errors(include_url=False)[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
        for e in exc.errors(include_url=False)[:5]
    )
    return EndpointError(400, f"invalid request: {problems}", param=param)


async def _sse(reply: dict[str, Any]) -> Any:
    """A finished reply as OpenAI stream chunks (one content chunk per choice, then DONE)."""
    chunk_type = "chat.completion.chunk" if reply["object"] == "chat.completion" else None
    for choice in reply["choices"]:
        if chunk_type is None:
            chunk: dict[str, Any] = {**reply, "choices": [choice]}
        else:
            delta = dict(choice["message"])
            if delta.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(delta["tool_calls"])]
            chunk = {
                **{k: v for k, v in reply.items() if k != "usage"},
                "object": chunk_type,
                "choices": [
                    {
                        "index": choice["index"],
                        "delta": delta,
                        "finish_reason": choice["finish_reason"],
                        "logprobs": choice.get("logprobs"),
                    }
                ],
            }
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
