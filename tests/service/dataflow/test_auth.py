"""Bearer tokens per role: 401 without a valid token, 403 for the wrong role."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from astraflow.dataflow.client import DataflowClient
from astraflow.errors import AuthError, ForbiddenError
from astraflow.records import LeaseRequest
from fixtures.dataflow import make_config

LEASE = json.dumps({"node_id": "n1", "capacity": 1, "workflows": ["rlvr"]})
TAKE = json.dumps({"policy": "solver", "trainer_version": 0, "timeout_s": 0})
WATCH = json.dumps({"known": {"solver": 0}, "timeout_s": 0})
POINTS = json.dumps(
    {"points": [{"policy": "solver", "source": "eval", "version": 1, "time": 1.0,
                 "values": {"accuracy": 0.5}}]}
)  # fmt: skip
TOKENS = {
    "node": "node-secret", "trainer": "trainer-secret", "admin": "admin-secret",
    "read": "read-secret",
}  # fmt: skip

# (method, path, body) -> status per token: none, wrong, node, trainer, admin, read
MATRIX = [
    ("GET", "/v1/health", None, [200, 200, 200, 200, 200, 200]),
    ("POST", "/v1/lease", LEASE, [401, 401, 200, 403, 200, 403]),
    ("POST", "/v1/batches/take", TAKE, [401, 401, 403, 204, 204, 403]),
    ("GET", "/v1/report", None, [401, 401, 200, 200, 200, 200]),
    ("GET", "/metrics", None, [401, 401, 200, 200, 200, 200]),
    ("GET", "/v1/versions", None, [401, 401, 200, 200, 200, 200]),
    ("POST", "/v1/versions/watch", WATCH, [401, 401, 200, 200, 200, 200]),
    ("POST", "/v1/admin/metrics", POINTS, [401, 401, 403, 403, 200, 403]),
]


@pytest.mark.parametrize("source", ["config", "env"])
def test_roles(
    tmp_path: Path,
    dataflow_factory: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
    source: str,
) -> None:
    if source == "env":
        for role, token in TOKENS.items():
            monkeypatch.setenv(f"ASTRAFLOW_{role.upper()}_TOKEN", token)
        config = make_config(tmp_path / "df")
    else:
        config = make_config(tmp_path / "df", auth=TOKENS)
    assert "secret" not in config.model_dump_json()  # tokens never leak into dumps
    url = dataflow_factory(config)
    tokens = [None, "wrong", *(TOKENS[r] for r in ("node", "trainer", "admin", "read"))]
    for method, path, body, statuses in MATRIX:
        for token, status in zip(tokens, statuses, strict=True):
            headers = {"content-type": "application/json"}
            if token:
                headers["authorization"] = f"Bearer {token}"
            r = httpx.request(method, url + path, headers=headers, content=body)
            assert r.status_code == status, (path, token, r.text)
            if status in (401, 403):
                code = r.json()["error"]["code"]
                assert code == ("unauthorized" if status == 401 else "forbidden")
    # refused leases changed nothing: only the node and admin calls leased a task each
    report = httpx.get(url + "/v1/report", headers={"authorization": "Bearer admin-secret"})
    assert report.json()["tasks"]["leased"] == 2
    trainer = DataflowClient(url, token=TOKENS["trainer"], retries=0)
    with trainer as c, pytest.raises(ForbiddenError, match="needs node"):
        c.lease(LeaseRequest(node_id="n1", capacity=1, workflows=["rlvr"]))
    with DataflowClient(url, retries=0) as c, pytest.raises(AuthError, match="Bearer"):
        c.report()
