"""Elastic pools through the admin API: desired sizes per pool, over real HTTP."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from astraflow.dataflow.client import AsyncDataflowClient, DataflowClient
from astraflow.errors import ForbiddenError, ValidationError
from astraflow.records import DataflowReport, LeaseRequest, PoolSize, TakeBatchRequest
from fixtures.dataflow import DataflowProcess, make_config

TOKENS = {"node": "node-secret", "trainer": "trainer-secret", "admin": "admin-secret"}


def node_call(c: DataflowClient, node: str, pool: str) -> None:
    c.lease(LeaseRequest(node_id=node, pool=pool, capacity=0, workflows=["rlvr"]))


def after_a_sweep(c: DataflowClient, since: float) -> DataflowReport:
    """The first report whose targets the service's sweep decided after ``since`` (the
    sweeper runs every 0.5 s; reading the report decides nothing)."""
    for _ in range(200):
        report = c.report()
        if (report.target.decided_at or 0.0) >= since:
            return report
        time.sleep(0.05)
    raise AssertionError("the service's sweeper decided no target for 10 s")


def test_set_get_delta_and_clamp(tmp_path: Path, dataflow_factory: Callable[..., str]) -> None:
    url = dataflow_factory(make_config(tmp_path / "df", report={"min_nodes": 0}))
    with DataflowClient(url) as c:
        assert c.pool_sizes().pools == {}  # nothing asked for, nobody seen
        node_call(c, "g1", "gpu")
        assert c.pool_sizes().pools["gpu"] == PoolSize(
            pool="gpu", desired=None, observed=1, target=1
        )
        assert c.set_pool_size("local", nodes=3).desired == 3
        assert c.set_pool_size("local", delta=-1).desired == 2
        assert c.set_pool_size("local", delta=-5).desired == 0  # clamped at 0
        assert c.set_pool_size("local", delta=4).desired == 4
        assert c.set_pool_size("gpu", delta=2).desired == 3  # unset: from the 1 observed node
        sizes = c.pool_sizes().pools
        assert {p: (s.desired, s.observed) for p, s in sizes.items()} == {
            "local": (4, 0),
            "gpu": (3, 1),
        }
        report = after_a_sweep(c, time.time())  # one reply holds what an autoscaler needs
        assert report.pools["local"].desired_nodes == 4 and report.pools["local"].nodes == 0
        assert report.pools["gpu"].desired_nodes == 3 and report.pools["gpu"].nodes == 1
        assert report.pools["gpu"].target_nodes == 1  # no trainer activity: hold
        metrics = httpx.get(url + "/metrics").text
        assert 'astraflow_dataflow_pool_desired_nodes{pool="local"} 4.0' in metrics

    async def via_async() -> int | None:
        async with AsyncDataflowClient(url) as ac:
            await ac.set_pool_size("local", delta=1)
            return (await ac.pool_sizes()).pools["local"].desired

    assert asyncio.run(via_async()) == 5


def test_pool_target_follows_the_dead_band(
    tmp_path: Path, dataflow_factory: Callable[..., str]
) -> None:
    config = make_config(tmp_path / "df", report={"band": (0.0, 0.01), "window_s": 5.0})
    url = dataflow_factory(config)
    with DataflowClient(url) as c:
        node_call(c, "a1", "a")
        node_call(c, "a2", "a")
        node_call(c, "b1", "b")
        # a trainer that only waits: above the band, every pool's target grows by one step
        c.take_batch(TakeBatchRequest(policy="solver", trainer_version=0, timeout_s=1.0))
        report = after_a_sweep(c, time.time())
        assert report.target.target_nodes == 4 and "scale up" in report.target.reason
        assert {p: s.target for p, s in c.pool_sizes().pools.items()} == {"a": 3, "b": 2}
        a = report.pool_targets["a"]
        assert (a.current_nodes, a.target_nodes, a.reason) == (2, 3, report.target.reason)
        assert report.pools["b"].target_nodes == report.pool_targets["b"].target_nodes == 2


def test_desired_sizes_survive_kill_9(
    tmp_path: Path, dataflow_process: Callable[..., DataflowProcess]
) -> None:
    config = make_config(tmp_path / "df")
    proc = dataflow_process(config)
    with DataflowClient(proc.url) as c:
        c.set_pool_size("local", nodes=3)
        c.set_pool_size("remote", nodes=1)
        c.set_pool_size("local", delta=-1)
    proc.kill()
    proc = dataflow_process(config)
    with DataflowClient(proc.url) as c:
        sizes = c.pool_sizes().pools
        assert {p: s.desired for p, s in sizes.items()} == {"local": 2, "remote": 1}


def test_admin_routes_need_the_admin_token(
    tmp_path: Path, dataflow_factory: Callable[..., str]
) -> None:
    url = dataflow_factory(make_config(tmp_path / "df", auth=TOKENS))
    body = json.dumps({"pool": "local", "nodes": 2})
    for token, status in [
        (None, 401),
        ("wrong", 401),
        (TOKENS["node"], 403),
        (TOKENS["trainer"], 403),
        (TOKENS["admin"], 200),
    ]:
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        assert httpx.get(url + "/v1/admin/pools", headers=headers).status_code == status
        r = httpx.post(url + "/v1/admin/pools", headers=headers, content=body)
        assert r.status_code == status, r.text
    node = DataflowClient(url, token=TOKENS["node"], retries=0)
    with node as c, pytest.raises(ForbiddenError, match="needs admin"):
        c.set_pool_size("local", nodes=9)
    with DataflowClient(url, token=TOKENS["admin"]) as c:
        assert c.pool_sizes().pools["local"].desired == 2  # refused calls changed nothing


BAD: dict[str, tuple[Any, str]] = {
    "both": ({"pool": "local", "nodes": 1, "delta": 1}, "exactly one"),
    "neither": ({"pool": "local"}, "exactly one"),
    "negative nodes": ({"pool": "local", "nodes": -1}, "nodes"),
    "too many nodes": ({"pool": "local", "nodes": 10**9}, "nodes"),
    "huge delta": ({"pool": "local", "delta": -(10**9)}, "delta"),
    "not a number": ({"pool": "local", "nodes": "three"}, "nodes"),
    "fractional": ({"pool": "local", "nodes": 1.5}, "nodes"),
    "bad pool name": ({"pool": "no spaces!", "nodes": 1}, "pool"),
    "missing pool": ({"nodes": 1}, "pool"),
    "unknown field": ({"pool": "local", "nodes": 1, "colour": "red"}, "colour"),
    "not an object": ([1, 2], "PoolSizeRequest"),
    "malformed json": ("{nope", "Invalid JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_pool_requests_are_refused_and_change_nothing(
    tmp_path: Path, dataflow_factory: Callable[..., str], case: str
) -> None:
    config = make_config(tmp_path / "df")
    url = dataflow_factory(config)
    with DataflowClient(url) as c:
        c.set_pool_size("local", nodes=2)

    def meta() -> list[tuple[str, str]]:
        con = sqlite3.connect(f"file:{config.db_path}?mode=ro", uri=True)
        try:
            return sorted(con.execute("SELECT key, value FROM meta"))
        finally:
            con.close()

    before = meta()
    body, message = BAD[case]
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        url + "/v1/admin/pools", headers={"content-type": "application/json"}, content=content
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid"
    assert message in r.json()["error"]["message"]
    assert meta() == before
    with DataflowClient(url) as c:
        assert c.pool_sizes().pools["local"].desired == 2


def test_client_checks_a_pool_request_before_sending() -> None:
    with DataflowClient("http://127.0.0.1:9", retries=0) as c:  # nothing listens there
        with pytest.raises(ValidationError, match="exactly one"):
            c.set_pool_size("local", nodes=1, delta=1)
        with pytest.raises(ValidationError, match="nodes"):
            c.set_pool_size("local", nodes=-2)
