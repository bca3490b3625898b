"""The weight server as a hostile client meets it: tokens, bad paths, GETs that would grow the
store, methods it does not serve, and requests generated from its own OpenAPI document."""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from openapi_spec_validator import validate

from astraflow.errors import AuthError
from astraflow.weights import WeightClient, WeightStore, WeightStoreConfig
from astraflow.weights.access import WeightsAuthConfig
from astraflow.weights.server import WeightServerConfig, serve_in_thread
from astraflow.weights.transfer import TransferOptions

READ, PUBLISH = "read-secret-1", "publish-secret-2"
VERSIONS = 8
CACHE_ENTRIES = 2


def _publish(root: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(4096, generator=gen).bfloat16()}
    with WeightStore(root, WeightStoreConfig(full_every=100, keep=100)) as store:
        for version in range(VERSIONS):
            state = {"w": state["w"].clone()}
            state["w"][version * 50 : version * 50 + 400] += 1  # overlapping: merges pay off
            store.publish("p", version, state).result(timeout=60)


def _snapshot(root: Path) -> dict[str, int]:
    """Every file under the store and its size."""
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("weights")
    _publish(root)
    return root


@pytest.fixture(scope="module")
def server(store_root: Path) -> Iterator[str]:
    config = WeightServerConfig(
        auth=WeightsAuthConfig(read=READ, publish=PUBLISH),  # type: ignore[arg-type]
        merged_cache_entries=CACHE_ENTRIES,
    )
    with serve_in_thread(store_root, config=config) as url:
        yield url


def _raw_get(
    url: str, path: str, token: str | None = READ, method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    """Send ``path`` byte for byte (no client-side normalisation of '..' or escapes)."""
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname or "", parsed.port, timeout=30)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        conn.request(method, path, headers=headers)
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


ROUTES = [
    "/v1/weights/p/latest",
    "/v1/weights/p/versions",
    "/v1/weights/p/merged/1/3",
    "/v1/weights/files/p/v00000001/manifest.json",
]


@pytest.mark.parametrize("path", ROUTES)
def test_every_route_but_health_needs_a_valid_token(server: str, path: str) -> None:
    assert _raw_get(server, path, token=None)[0] == 401
    status, _, body = _raw_get(server, path, token="not-a-token")
    assert status == 401 and json.loads(body)["error"]["code"] == "unauthorized"
    assert _raw_get(server, path, token=READ)[0] == 200
    assert _raw_get(server, path, token=PUBLISH)[0] == 200  # publish opens every route
    assert _raw_get(server, "/v1/weights/health", token=None)[0] == 200
    assert _raw_get(server, "/openapi.json", token=None)[0] == 200


def test_client_pulls_with_the_read_token_and_is_refused_without(
    server: str, store_root: Path
) -> None:
    with WeightClient(server, retries=1) as anonymous, pytest.raises(AuthError, match="401"):
        anonymous.latest("p")
    with WeightClient(server, options=TransferOptions(token=READ)) as client:
        assert client.latest("p") == VERSIONS - 1
        tensors = client.load("p", 2)
        node = {"w": tensors["w"].clone()}
        stats = client.pull("p", node, have=2)
    assert stats.want == VERSIONS - 1 and stats.path in ("merged", "chain", "full")


def test_gets_grow_the_store_by_at_most_the_bounded_cache(server: str, store_root: Path) -> None:
    before = _snapshot(store_root)
    base_bytes = sum(before.values())
    largest_merge = 0
    for _ in range(3):  # every pair, three times over
        for have in range(VERSIONS):
            for want in range(have + 1, VERSIONS):
                status, _, body = _raw_get(server, f"/v1/weights/p/merged/{have}/{want}")
                assert status == 200, body
                largest_merge = max(largest_merge, json.loads(body)["files"][0]["size"])
    after = _snapshot(store_root)
    added = {k: v for k, v in after.items() if k not in before}
    assert all(k.startswith("p/merged/") for k in added)
    merged_dirs = {k.rsplit("/", 1)[0] for k in after if k.startswith("p/merged/")}
    assert len(merged_dirs) <= CACHE_ENTRIES  # 28 distinct pairs asked for, 2 kept
    assert sum(after.values()) - base_bytes <= CACHE_ENTRIES * (largest_merge + 4096)
    published = {k: v for k, v in before.items() if not k.startswith("p/merged/")}
    assert {k: after.get(k) for k in published} == published  # nothing published was touched


@pytest.mark.parametrize(
    "path",
    [
        "/v1/weights/files/p/v00000001/ma%00nifest.json",
        "/v1/weights/p%00/latest",
        "/v1/weights/p%00x/merged/1/2",
        "/v1/weights/files/p%00/v00000001/manifest.json",
        "/v1/weights/files/p/%2e%2e/%2e%2e/etc/passwd",
        "/v1/weights/files/p/v00000001/.hidden",
        "/v1/weights/files/p/v00000001/bad%5Cname",
        "/v1/weights/p/merged/1/99999999999999999999999999",
        "/v1/weights/p/merged/" + "9" * 5000 + "/1",
        "/v1/weights/p/merged/-1/2",
        "/v1/weights/p/merged/3/3",
        "/v1/weights/" + "a" * 300 + "/latest",
    ],
)
def test_bad_paths_get_400_and_change_nothing(server: str, store_root: Path, path: str) -> None:
    before = _snapshot(store_root)
    status, _, body = _raw_get(server, path)
    assert status == 400, (path, body)
    error = json.loads(body)["error"]
    assert error["code"] == "invalid" and error["message"]
    assert _snapshot(store_root) == before


def test_control_characters_in_a_path_are_refused(server: str, store_root: Path) -> None:
    before = _snapshot(store_root)
    for path in ("/v1/weights/p%0A/latest", "/v1/weights/files/p/v00000001/%0Amanifest.json"):
        status, _, body = _raw_get(server, path)
        assert status in (400, 404) and "error" in json.loads(body), (path, body)
    assert _snapshot(store_root) == before


def test_method_not_allowed_names_the_allowed_ones(server: str) -> None:
    status, headers, body = _raw_get(server, "/v1/weights/p/latest", method="POST")
    assert status == 405
    assert "GET" in headers["allow"].split(", ")
    assert json.loads(body)["error"]["code"] == "method_not_allowed"
    status, _, body = _raw_get(server, "/v1/weights/p/nothing/here")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"


def _document(server: str) -> dict[str, object]:
    return dict(httpx.get(f"{server}/openapi.json", timeout=10).json())


def test_openapi_document_is_valid_and_covers_every_route(server: str) -> None:
    doc = _document(server)
    validate(doc)  # a valid OpenAPI 3.1 document
    paths = doc["paths"]
    assert isinstance(paths, dict)
    assert set(paths) == {
        "/v1/weights/health", "/v1/weights/openapi.json", "/v1/weights/files/{path}",
        "/v1/weights/{policy}/latest", "/v1/weights/{policy}/versions",
        "/v1/weights/{policy}/merged/{have}/{want}",
    }  # fmt: skip
    merged = paths["/v1/weights/{policy}/merged/{have}/{want}"]["get"]
    params = {p["name"]: p["schema"] for p in merged["parameters"]}
    assert params["have"]["minimum"] == 0 and "pattern" in params["policy"]
    assert merged["security"] == [{"bearer": []}] and "401" in merged["responses"]
    assert paths["/v1/weights/health"]["get"]["security"] == []
    schemas = doc["components"]["schemas"]  # type: ignore[index]
    assert {"WeightManifest", "LatestReply", "ErrorReply"} <= set(schemas)


def _requests(
    doc: dict[str, object], files: list[str]
) -> st.SearchStrategy[tuple[str, str, str | None]]:
    """(method, raw path, token) drawn from the document: valid and invalid parameters."""
    paths: dict[str, dict[str, object]] = doc["paths"]  # type: ignore[assignment]
    tokens = st.sampled_from([None, "wrong", READ, PUBLISH])
    real = {  # values that exist in the store, so that some requests succeed
        "policy": st.just("p"),
        "have": st.integers(0, VERSIONS),
        "want": st.integers(0, VERSIONS),
        "path": st.sampled_from(files),
    }

    def route(
        template: str, op: dict[str, object]
    ) -> st.SearchStrategy[tuple[str, str, str | None]]:
        params = [p for p in op["parameters"] if p["in"] == "path"]  # type: ignore[attr-defined]
        values = {
            p["name"]: st.one_of(
                from_schema(p["schema"]),
                st.text(max_size=40),
                st.integers(-(2**70), 2**70),
                real[p["name"]],
            )
            for p in params
        }

        def build(
            vals: dict[str, object], method: str, token: str | None
        ) -> tuple[str, str, str | None]:
            path = template
            for name, value in vals.items():
                safe = "/" if name == "path" else ""
                path = path.replace("{" + name + "}", urllib.parse.quote(str(value), safe=safe))
            return method, path, token

        methods = st.sampled_from(["GET", "GET", "HEAD", "POST", "PUT", "DELETE"])
        return st.builds(build, st.fixed_dictionaries(values), methods, tokens)

    return st.one_of(*(route(t, ops["get"]) for t, ops in paths.items()))  # type: ignore[index]


def test_requests_generated_from_the_document_never_fail_the_server(
    server: str, store_root: Path
) -> None:
    doc = _document(server)
    files = sorted(k for k in _snapshot(store_root) if not k.startswith("p/merged/"))
    seen: set[int] = set()

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_requests(doc, files))
    def check(request: tuple[str, str, str | None]) -> None:
        method, path, token = request
        before = _snapshot(store_root)
        status, _, body = _raw_get(server, path, token=token, method=method)
        seen.add(status)
        assert status < 500, (method, path, status, body)
        if status >= 400:  # refused: the store is exactly as it was
            assert _snapshot(store_root) == before, (method, path, status)
            if method != "HEAD":
                assert "error" in json.loads(body)
        elif token not in (READ, PUBLISH) and not path.endswith(("/health", "/openapi.json")):
            raise AssertionError(f"{method} {path} answered {status} without a valid token")

    check()
    assert {200, 400, 401, 404, 405} <= seen, seen  # the generator reached every outcome
    merged = {p.parent for p in store_root.glob("p/merged/*/*")}
    assert len(merged) <= CACHE_ENTRIES


async def test_pair_locks_do_not_outlive_their_requests(tmp_path: Path) -> None:
    from astraflow.weights.files import StoreFiles
    from astraflow.weights.merged_cache import MergedCache

    _publish(tmp_path)
    cache = MergedCache(StoreFiles(tmp_path), entries=3, max_bytes=2**30)
    pairs = [(a, b) for a in range(VERSIONS) for b in range(a + 2, VERSIONS)]
    await asyncio.gather(*(cache.get("p", a, b) for a, b in pairs for _ in range(3)))
    assert cache.pending_locks() == 0
    # ties (file times are coarse) broken by name, as the server breaks them
    kept = sorted(
        tmp_path.glob("p/merged/*"), key=lambda d: ((d / "manifest.json").stat().st_mtime, d.name)
    )
    assert len(kept) == 3
    # a restarted server with a smaller cache trims what it finds, oldest first
    smaller = MergedCache(StoreFiles(tmp_path), entries=1, max_bytes=2**30)
    assert list(tmp_path.glob("p/merged/*")) == [kept[-1]]
    assert smaller.bytes > 0


async def test_a_merge_larger_than_the_cache_is_not_kept(tmp_path: Path) -> None:
    from astraflow.errors import NotFoundError
    from astraflow.weights.files import StoreFiles
    from astraflow.weights.merged_cache import MergedCache

    _publish(tmp_path)
    cache = MergedCache(StoreFiles(tmp_path), entries=4, max_bytes=64)
    with pytest.raises(NotFoundError, match="exceeds the cache"):
        await cache.get("p", 0, 5)
    assert list(tmp_path.glob("p/merged/*/*")) == []
