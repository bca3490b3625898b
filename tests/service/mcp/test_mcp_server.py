"""``astraflow mcp`` driven by the real ``mcp`` client, over stdio and over streamable HTTP.

The MCP server runs as a real subprocess (``python -m astraflow.cli.main mcp``) against a real
dataflow service with an admin token; the launcher side is the real ``PoolManager`` (what
``astraflow run`` uses to start and retire nodes), here starting ids rather than processes.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from astraflow.dataflow.client import DataflowClient
from astraflow.launch.config import PoolSection
from astraflow.launch.pools import PoolManager
from fixtures.dataflow import make_config
from fixtures.envs import subprocess_env
from fixtures.net import free_port

TOKEN = "mcp-test-admin-token"
TOOLS = {"report", "pool_sizes", "set_pool_size", "recent_decisions"}


class Nodes:
    """What the pool manager started and stopped (a node's work is not under test here)."""

    def __init__(self) -> None:
        self.alive: set[str] = set()
        self.started = 0

    def start(self, pool: PoolSection) -> str:
        self.started += 1
        node_id = f"{pool.name}-{self.started}"
        self.alive.add(node_id)
        return node_id

    def stop(self, node_id: str) -> None:
        self.alive.discard(node_id)


@pytest.fixture
def dataflow(tmp_path: Path, dataflow_factory: Callable[..., str]) -> str:
    return dataflow_factory(make_config(tmp_path / "df", auth={"admin": TOKEN}))


@pytest.fixture
def launcher(dataflow: str) -> Iterator[tuple[PoolManager, Nodes]]:
    nodes = Nodes()
    with DataflowClient(dataflow, token=TOKEN) as client:
        manager = PoolManager(client, [PoolSection(name="local", nodes=1, max_nodes=8)],
                              nodes.start, nodes.stop, lambda n: n in nodes.alive)  # fmt: skip
        manager.start()
        yield manager, nodes


def _stdio(url: str, token: str) -> Client:
    args = ["-m", "astraflow.cli.main", "mcp", "--dataflow", url, "--poll-s", "0"]
    env = {**subprocess_env(), "ASTRAFLOW_ADMIN_TOKEN": token}
    return Client(StdioServerParameters(command=sys.executable, args=args, env=env), cache=None)


def _text(result: Any) -> str:
    return " ".join(getattr(c, "text", "") for c in result.content)


async def _resize_and_check(client: Client, manager: PoolManager, nodes: Nodes, url: str) -> None:
    """A resize through the tool moves the desired size, and the launcher follows it."""
    assert {t.name for t in (await client.list_tools()).tools} == TOOLS
    before = await client.call_tool("pool_sizes", {})
    assert not before.is_error and before.structured_content["pools"]["local"]["desired"] == 1
    result = await client.call_tool(
        "set_pool_size", {"pool": "local", "nodes": 3, "reason": "trainers wait"}
    )
    assert not result.is_error, _text(result)
    assert result.structured_content["desired"] == 3
    with DataflowClient(url, token=TOKEN) as df:
        assert df.pool_sizes().pools["local"].desired == 3
    manager.tick()
    assert manager.count("local") == 3 and len(nodes.alive) == 3
    shrink = await client.call_tool("set_pool_size", {"pool": "local", "delta": -2})
    assert not shrink.is_error and shrink.structured_content["desired"] == 1
    manager.tick()
    assert manager.count("local") == 1 and len(nodes.alive) == 1


def test_stdio_tools_resize_the_pool_and_refuse_bad_arguments(
    dataflow: str, launcher: tuple[PoolManager, Nodes]
) -> None:
    manager, nodes = launcher

    async def scenario() -> None:
        async with _stdio(dataflow, TOKEN) as client:
            await _resize_and_check(client, manager, nodes, dataflow)
            bad: list[tuple[dict[str, Any], str]] = [
                ({"pool": "local"}, "exactly one of 'nodes'"),
                ({"pool": "local", "nodes": 2, "delta": 1}, "exactly one of 'nodes'"),
                ({"pool": "local", "nodes": -1}, "greater than or equal to 0"),
                ({"pool": "gpu-a", "nodes": 2}, "unknown pool 'gpu-a' (pools of this run: local)"),
                ({"nodes": 2}, "pool"),
            ]
            for args, message in bad:
                got = await client.call_tool("set_pool_size", args)
                assert got.is_error and message in _text(got), (args, _text(got))
            log = await client.call_tool("recent_decisions", {"limit": 50})
            entries = log.structured_content["decisions"]
            mine = [(e["desired"], e["reason"]) for e in entries if e["source"] == "mcp"]
            assert mine == [(3, "trainers wait"), (1, "set_pool_size")]
            assert any(e["source"] == "report" and e["desired"] == 1 for e in entries)
            uris = {str(r.uri) for r in (await client.list_resources()).resources}
            assert uris == {"astraflow://report", "astraflow://pools", "astraflow://decisions"}
            pools = await client.read_resource("astraflow://pools")
            assert '"desired":1' in pools.contents[0].text  # type: ignore[union-attr]

    asyncio.run(scenario())
    with DataflowClient(dataflow, token=TOKEN) as df:  # refused calls changed nothing
        assert set(df.pool_sizes().pools) == {"local"}
        assert df.pool_sizes().pools["local"].desired == 1


def test_stdio_with_a_wrong_token_is_refused_by_the_dataflow(
    dataflow: str, launcher: tuple[PoolManager, Nodes]
) -> None:
    async def scenario() -> None:
        async with _stdio(dataflow, "not-the-admin-token") as client:
            for tool, args in (("report", {}), ("pool_sizes", {}),
                               ("set_pool_size", {"pool": "local", "nodes": 5})):  # fmt: skip
                got = await client.call_tool(tool, args)
                assert got.is_error and "AuthError" in _text(got), _text(got)

    asyncio.run(scenario())
    with DataflowClient(dataflow, token=TOKEN) as df:
        assert df.pool_sizes().pools["local"].desired == 1


@pytest.fixture
def http_mcp(dataflow: str, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "astraflow.cli.main", "mcp", "--dataflow", dataflow,
           "--transport", "http", "--port", str(port)]  # fmt: skip
    log = (tmp_path / "mcp.log").open("wb")
    env = {**subprocess_env(), "ASTRAFLOW_ADMIN_TOKEN": TOKEN}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "mcp.log").read_text()
            try:
                httpx.get(url, timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "astraflow mcp --transport http never served"
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_http_tools_need_the_admin_token_and_resize_the_pool(
    dataflow: str, launcher: tuple[PoolManager, Nodes], http_mcp: str
) -> None:
    manager, nodes = launcher
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        refused = httpx.post(http_mcp, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                             headers=headers, timeout=10)  # fmt: skip
        assert refused.status_code == 401, refused.text
        assert "bearer token" in refused.json()["error"]["message"]

    def client(http: httpx2.AsyncClient) -> Client:
        return Client(streamable_http_client(http_mcp, http_client=http), cache=None)

    def bearer(token: str) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"})

    async def scenario() -> None:
        async with bearer(TOKEN) as http, client(http) as c:
            await _resize_and_check(c, manager, nodes, dataflow)
            got = await c.call_tool("set_pool_size", {"pool": "local", "delta": "two"})
            assert got.is_error and "delta" in _text(got)
        refused = False
        async with bearer("wrong") as http:
            try:
                async with client(http) as c:
                    await c.list_tools()
            except* MCPError:  # the 401 answer to the first request
                refused = True
        assert refused

    asyncio.run(scenario())
