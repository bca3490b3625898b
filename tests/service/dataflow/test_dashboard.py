"""``/dashboard`` over HTTP: refused without a token, a token traded once for a session
cookie (never echoed, never logged), its data and static files behind the same door."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from astraflow.dataflow.dashboard import COOKIE
from fixtures.dataflow import make_config

TOKENS = {"admin": "admin-secret-9", "read": "read-secret-7"}
POINT = {"policy": "solver", "source": "eval", "version": 3, "time": 1.5e9,
         "values": {"accuracy": 0.25}}  # fmt: skip


def _wait_snapshots(client: httpx.Client, url: str) -> dict[str, object]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        data = client.get(url + "/dashboard/data").json()
        if data["snapshots"]:
            return dict(data)
        time.sleep(0.1)
    raise AssertionError("the dashboard's history took no report snapshot")


def test_dashboard_needs_a_token_and_trades_it_for_a_cookie(
    tmp_path: Path, dataflow_factory: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    config = make_config(tmp_path / "df", auth=TOKENS, dashboard={"sample_s": 0.1})
    url = dataflow_factory(config)
    with httpx.Client() as anon:
        for path in ("/dashboard", "/dashboard?token=wrong"):
            page = anon.get(url + path)
            assert page.status_code == 401 and "dashboard.js" not in page.text
            assert "name=token" in page.text  # the page asks for the token
        assert anon.get(url + "/dashboard/data").status_code == 401
        assert anon.get(url + "/dashboard/static/dashboard.js").status_code == 404
        assert not anon.cookies

    with httpx.Client(follow_redirects=True) as browser:
        got = browser.get(url + "/dashboard", params={"token": TOKENS["read"]})
        first = got.history[0]
        assert first.status_code == 303 and first.headers["location"] == "/dashboard"
        cookie = first.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/dashboard" in cookie
        assert TOKENS["read"] not in first.headers["set-cookie"]
        assert got.status_code == 200 and "dashboard.js" in got.text
        assert got.headers["cache-control"] == "no-store"
        for name in ("dashboard.js", "dashboard.css", "uPlot.iife.min.js", "uPlot.min.css"):
            assert browser.get(url + f"/dashboard/static/{name}").status_code == 200, name
        assert browser.get(url + "/dashboard/static/..%2fhistory.py").status_code == 404
        data = _wait_snapshots(browser, url)
        assert "policy/solver/buffered_samples" in data["snapshots"][-1]["f"]  # type: ignore[index]
        assert data["report"]["policies"]["solver"]["max_buffered"] == 256  # type: ignore[index]

        admin = {"authorization": f"Bearer {TOKENS['admin']}"}
        posted = httpx.post(url + "/v1/admin/metrics", json={"points": [POINT]}, headers=admin)
        assert posted.status_code == 200, posted.text
        seq = int(data["seq"])  # type: ignore[call-overload]
        newer = browser.get(url + "/dashboard/data", params={"after": seq}).json()
        assert newer["points"] == [POINT]
        assert all(s["t"] >= data["snapshots"][-1]["t"] for s in newer["snapshots"])  # type: ignore[index]
        bad = httpx.post(url + "/v1/admin/metrics", headers=admin,
                         json={"points": [{**POINT, "values": {"accuracy": "x"}}]})  # fmt: skip
        assert bad.status_code == 400 and "values" in bad.json()["error"]["message"]

    with httpx.Client(follow_redirects=True) as form:  # the page's form posts the token instead
        assert form.post(url + "/dashboard/login", data={"token": "nope"}).status_code == 401
        opened = form.post(url + "/dashboard/login", data={"token": TOKENS["read"]})
        assert opened.status_code == 200 and COOKIE in form.cookies
    bearer = {"authorization": f"Bearer {TOKENS['read']}"}
    assert httpx.get(url + "/dashboard/data", headers=bearer).status_code == 200
    ours = [r.getMessage() for r in caplog.records if r.name.startswith(("astraflow", "uvicorn"))]
    assert ours and not any(t in m for t in TOKENS.values() for m in ours)


def test_open_service_opens_the_dashboard(
    tmp_path: Path, dataflow_factory: Callable[..., str]
) -> None:
    url = dataflow_factory(make_config(tmp_path / "df"))
    assert httpx.get(url + "/dashboard").status_code == 200
    off = dataflow_factory(make_config(tmp_path / "off", dashboard={"enabled": False}))
    assert httpx.get(off + "/dashboard").status_code == 404
