"""Property-based: requests generated from the published OpenAPI document, for every route,
with and without tokens, never get a 5xx, and a refused request changes no stored state.

Bodies are drawn from each route's request schema (``fixtures.schemas``), sometimes
broken on purpose (a field dropped, a value replaced by arbitrary JSON), sent as JSON or
msgpack with each kind of token. After every 4xx the SQLite rows and the report's counts
are the same as before it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from astraflow.dataflow.server import ThreadedServer, build_app
from fixtures.dataflow import make_config, state_snapshot
from fixtures.schemas import values

TOKENS = {"node": "node-token", "trainer": "trainer-token", "admin": "admin-token"}
ADMIN = {"authorization": f"Bearer {TOKENS['admin']}"}


class Service:
    def __init__(self, url: str, db: Path) -> None:
        self.url, self.db = url, db
        self.doc: dict[str, Any] = httpx.get(url + "/openapi.json").json()
        self.http = httpx.Client(base_url=url, timeout=30)

    def snapshot(self) -> dict[str, Any]:
        return state_snapshot(self.db, self.url, ADMIN)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    config = make_config(
        tmp_path_factory.mktemp("openapi") / "df",
        auth=TOKENS,
        lease={"ttl_s": 3600.0},  # nothing expires on its own while the test runs
        policies={"solver": {"vocab_size": 64, "max_buffered": 256, "ack_timeout_s": 3600.0}},
        limits={"max_take_timeout_s": 0.05, "max_body_mb": 1.0, "max_decoding_mb": 4.0},
    )
    server = ThreadedServer(build_app(config))
    svc = Service(server.start(), config.db_path)
    time.sleep(1.5)  # the sweeper's first change stores the plug-ins' initial state
    yield svc
    svc.http.close()
    server.stop()


def _operations() -> list[tuple[str, str]]:
    from astraflow.dataflow.openapi import openapi_document  # the document the app serves

    doc = openapi_document()
    return sorted((p, m) for p, ops in doc["paths"].items() for m in ops)


def _request_schema(doc: dict[str, Any], path: str, method: str) -> dict[str, Any] | None:
    body = doc["paths"][path][method].get("requestBody")
    if body is None:
        return None
    schema: dict[str, Any] = body["content"]["application/json"]["schema"]
    return schema


def _broken(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A schema-valid body with one key dropped or one value replaced by arbitrary JSON."""
    poison = st.sampled_from([2**63, 2**70, -(2**70), float("inf"), float("nan"), ""])
    junk = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | poison,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                     max_size=3),
        max_leaves=6,
    )  # fmt: skip

    @st.composite
    def mutate(draw: st.DrawFn) -> Any:
        body = draw(value)
        if not isinstance(body, dict) or not body:
            return draw(junk)
        key = draw(st.sampled_from(sorted(body)))
        if draw(st.booleans()):
            return {k: v for k, v in body.items() if k != key}
        return {**body, key: draw(junk)}

    return mutate()


def _encode(body: Any, how: str) -> tuple[bytes, str]:
    if how == "msgpack":
        try:
            return msgpack.packb(body, use_bin_type=True), "application/msgpack"
        except (OverflowError, TypeError, ValueError):
            how = "json"
    return json.dumps(body).encode(), "application/json"


@pytest.mark.slow
@pytest.mark.parametrize(("path", "method"), _operations())
def test_generated_requests_never_5xx_and_refusals_change_nothing(
    service: Service, path: str, method: str
) -> None:
    schema = _request_schema(service.doc, path, method)
    valid = values(schema, service.doc) if schema is not None else st.none()
    bodies = st.one_of(valid, _broken(valid)) if schema is not None else st.none()
    tokens = st.sampled_from([None, "not-a-token", *TOKENS.values()])

    @settings(
        max_examples=20,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(body=bodies, token=tokens, how=st.sampled_from(["json", "msgpack"]))
    def check(body: Any, token: str | None, how: str) -> None:  # fmt: skip
        headers = {} if token is None else {"authorization": f"Bearer {token}"}
        content: bytes | None = None
        if schema is not None:
            content, headers["content-type"] = _encode(body, how)
        before = service.snapshot()
        r = service.http.request(method.upper(), path, content=content, headers=headers)
        assert r.status_code < 500, (path, r.status_code, r.text[:500])
        if r.status_code >= 400:
            error = r.json()["error"]
            assert error["code"] and error["message"]
            assert service.snapshot() == before, (path, r.status_code, error)

    check()
