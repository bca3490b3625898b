"""The live dashboard in the browser: a page, its data, its static files (no build step).

    GET /dashboard?token=T ──valid──► 303 /dashboard + a session cookie (the token leaves the
                                      address bar and the history at once)
    POST /dashboard/login (form) ──valid──► the same (the page's token form)
    GET /dashboard, /dashboard/data?after=SEQ, /dashboard/static/F
        session cookie or bearer token ──► page / JSON / file;  none ──► 401 (the token form)

Any valid token opens it (``read`` is enough); with no token configured the service is open
and so is this. Sessions live in memory (a restart asks again), the cookie is HttpOnly,
SameSite=Strict and scoped to ``/dashboard``; tokens never reach a log (uvicorn's access log
is off and errors log the path only). The charts are uPlot (MIT, vendored in ``static/``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Final
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from astraflow.dataflow.config import DashboardConfig
from astraflow.dataflow.history import FigureHistory
from astraflow.records import DataflowReport
from astraflow.serving import capped_body

__all__ = ["COOKIE", "DashboardRoutes"]

log = logging.getLogger(__name__)

COOKIE: Final = "astraflow_dashboard"
_MAX_SESSIONS: Final = 1024
_MAX_FORM_BYTES: Final = 4096
_STATIC: Final = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
}
_HEADERS: Final = {
    "cache-control": "no-store",
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
    "content-security-policy": (
        "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "frame-ancestors 'none'; form-action 'self'"
    ),
}


def _asset(name: str) -> bytes:
    return (resources.files("astraflow.dataflow") / "static" / name).read_bytes()


class DashboardRoutes:
    """The dashboard's routes and sessions, over a :class:`FigureHistory`."""

    def __init__(
        self, config: DashboardConfig, history: FigureHistory, valid: Callable[[str], bool],
        *, open_: bool,
    ) -> None:  # fmt: skip
        self.config = config
        self.history = history
        self.valid = valid
        """Whether a bearer token is one of the service's (any role)."""
        self.open = open_
        """No token is configured: the service, and so the dashboard, is open."""
        self._sessions: OrderedDict[str, float] = OrderedDict()

    def routes(self) -> list[Route]:
        """``/dashboard``, its login form target, its data and its static files."""
        return [
            Route("/dashboard", self.page, methods=["GET"]),
            Route("/dashboard/login", self.login, methods=["POST"]),
            Route("/dashboard/data", self.data, methods=["GET"]),
            Route("/dashboard/static/{name}", self.static, methods=["GET"]),
        ]

    async def sample(self, report: Callable[[], Awaitable[DataflowReport]]) -> None:
        """Add a report snapshot to the history every ``sample_s`` until cancelled."""
        while True:
            try:
                self.history.add_report(await report())
            except Exception:  # one loop turn's boundary: a failed snapshot is a gap in the curves
                log.exception("dashboard snapshot failed")
            await asyncio.sleep(self.config.sample_s)

    # ------------------------------------------------------------------ auth

    def _authorized(self, request: Request) -> bool:
        if self.open:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token and self.valid(token):
            return True
        sid = request.cookies.get(COOKIE, "")
        expiry = self._sessions.get(sid)
        if expiry is None:
            return False
        if expiry < time.monotonic():
            del self._sessions[sid]
            return False
        return True

    def _session(self) -> Response:
        """A redirect to the page that carries a fresh session cookie."""
        sid = secrets.token_urlsafe(32)
        self._sessions[sid] = time.monotonic() + self.config.session_ttl_s
        while len(self._sessions) > _MAX_SESSIONS:
            self._sessions.popitem(last=False)
        response = RedirectResponse("/dashboard", status_code=303, headers=_HEADERS)
        response.set_cookie(
            COOKIE, sid, max_age=int(self.config.session_ttl_s), path="/dashboard",
            httponly=True, samesite="strict",
        )  # fmt: skip
        return response

    @staticmethod
    def _refused(failed: bool = False) -> Response:
        note = "<p class=bad>That token is not valid here.</p>" if failed else ""
        return Response(_LOGIN.replace("{note}", note), 401, headers=_HEADERS,
                        media_type="text/html")  # fmt: skip

    # ------------------------------------------------------------------ handlers

    async def page(self, request: Request) -> Response:
        """The page; ``?token=`` trades a valid token for a session cookie."""
        token = request.query_params.get("token")
        if token is not None and not self.open:
            return self._session() if self.valid(token) else self._refused(failed=True)
        if not self._authorized(request):
            return self._refused()
        return Response(_asset("dashboard.html"), headers=_HEADERS, media_type="text/html")

    async def login(self, request: Request) -> Response:
        """The token form: a valid token gets a session cookie."""
        body = await capped_body(request, _MAX_FORM_BYTES)
        if body is None:
            return self._refused(failed=True)
        token = parse_qs(body.decode("utf-8", "replace")).get("token", [""])[0]
        if self.open or (token and self.valid(token)):
            return self._session()
        return self._refused(failed=True)

    async def data(self, request: Request) -> Response:
        """History entries newer than ``?after=SEQ`` and the latest report (JSON)."""
        if not self._authorized(request):
            return JSONResponse({"error": {"code": "unauthorized", "message": "no session"}},
                                401, headers=_HEADERS)  # fmt: skip
        after = 0
        with contextlib.suppress(ValueError):
            after = max(0, int(request.query_params.get("after", "0")))
        return JSONResponse(self.history.since(after), headers=_HEADERS)

    async def static(self, request: Request) -> Response:
        """One of the shipped static files."""
        name = request.path_params["name"]
        if name not in _STATIC or not self._authorized(request):
            return Response("not found", 404, headers=_HEADERS)
        return Response(_asset(name), headers=_HEADERS, media_type=_STATIC[name])


_LOGIN: Final = """<!doctype html>
<html lang=en><head><meta charset=utf-8><title>astraflow dashboard</title>
<meta name=viewport content="width=device-width, initial-scale=1">
<link rel=icon href="data:,"></head>
<body style="font-family: system-ui, sans-serif; margin: 3em">
<h1>astraflow dashboard</h1>
<p>This service needs a token (any role; the <code>read</code> token is enough).</p>{note}
<form method=post action="/dashboard/login">
<input type=password name=token autocomplete=off placeholder="token" size=40>
<button type=submit>Open</button></form></body></html>
"""
