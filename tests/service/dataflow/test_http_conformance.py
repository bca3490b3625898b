"""HTTP conformance: 405 with ``Allow`` and its own error code; ``/openapi.json`` describes
exactly the routes served, with the records' rules (ranges, patterns, required fields)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from astraflow.dataflow.openapi import ENDPOINTS, openapi_document
from astraflow.records import MAX_WIRE_INT, NAME_PATTERN


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/lease", "POST"),
        ("DELETE", "/v1/submit", "POST"),
        ("PUT", "/v1/versions", "GET, HEAD, POST"),
        ("POST", "/v1/report", "GET, HEAD"),
        ("PATCH", "/v1/admin/pools", "GET, HEAD, POST"),
    ],
)
def test_wrong_method_is_405_with_allow(
    dataflow_server: str, method: str, path: str, allowed: str
) -> None:
    r = httpx.request(method, dataflow_server + path)
    assert r.status_code == 405
    assert r.headers["allow"] == allowed
    error = r.json()["error"]
    assert error["code"] == "method_not_allowed"
    assert method in error["message"] and path in error["message"]


def test_unknown_path_is_still_404(dataflow_server: str) -> None:
    r = httpx.get(dataflow_server + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def _resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    resolved: dict[str, Any] = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    return resolved


def test_openapi_lists_every_route_served(dataflow_server: str) -> None:
    r = httpx.get(dataflow_server + "/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert doc == openapi_document()  # generated from the endpoint table and the records
    assert doc["openapi"].startswith("3.1")
    published = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert published == {(ep.method, ep.path) for ep in ENDPOINTS}
    for method, path in published:  # each one is served (an empty body: 400, not 404/405) ...
        r = httpx.request(method, dataflow_server + path, content=b"{}")
        assert r.status_code in (200, 400), (method, path, r.status_code)
    for ep in ENDPOINTS:  # ... and the wrong method on it is refused with 405
        other = "DELETE"
        assert httpx.request(other, dataflow_server + ep.path).status_code == 405


def test_openapi_carries_the_records_rules() -> None:
    doc = openapi_document()
    body = doc["paths"]["/v1/lease"]["post"]["requestBody"]["content"]["application/json"]
    lease = _resolve(doc, body["schema"])
    assert set(lease["required"]) == {"node_id", "capacity", "workflows"}
    assert lease["properties"]["capacity"]["maximum"] == 4096
    assert lease["properties"]["node_id"]["pattern"] == NAME_PATTERN
    announce = doc["paths"]["/v1/versions"]["post"]["requestBody"]["content"]
    version = _resolve(doc, announce["application/json"]["schema"])["properties"]["version"]
    assert (version["minimum"], version["maximum"]) == (0, MAX_WIRE_INT)
    submit = _resolve(doc, doc["paths"]["/v1/submit"]["post"]["requestBody"]["content"][
        "application/msgpack"]["schema"])  # fmt: skip
    assert "secret" in submit["required"] and submit["properties"]["secret"]["pattern"]
    take = doc["paths"]["/v1/batches/take"]["post"]["responses"]
    assert "application/msgpack" in take["200"]["content"] and "204" in take
    for path, ops in doc["paths"].items():
        for op in ops.values():
            for status, resp in op["responses"].items():
                if status >= "400":
                    assert "application/json" in resp["content"], (path, status)
