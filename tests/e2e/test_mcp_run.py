"""``astraflow mcp`` on a live run: a resize through the MCP tool starts a real node process."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters

from astraflow.launch.local import LocalRun
from fixtures.envs import subprocess_env
from fixtures.launch import (
    node_processes,
    processes_mentioning,
    reduced_quickstart,
    running,
    wait_for,
)

pytestmark = pytest.mark.e2e

TOKEN = "mcp-e2e-admin-token"


@pytest.mark.timeout(240)
def test_set_pool_size_through_mcp_grows_a_live_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "mcp-run"
    config = reduced_quickstart(
        run_dir, "eval=[]", f"dataflow.auth.admin={TOKEN}",
        "policies.policy.warmup.steps=5", "pools.0.capacity=4", steps=100_000,
    )  # fmt: skip
    run = LocalRun(config, tick_s=0.5)
    with running(run) as results:
        wait_for(lambda: (run_dir / "components" / "dataflow.json").is_file(), 120, "the service")
        wait_for(lambda: len(node_processes(run_dir)) == 1, 120, "the first node process")
        args = ["-m", "astraflow.cli.main", "mcp", "--run-dir", str(run_dir), "--poll-s", "0"]
        env = {**subprocess_env(), "ASTRAFLOW_ADMIN_TOKEN": TOKEN}
        params = StdioServerParameters(command=sys.executable, args=args, env=env)

        async def resize() -> dict[str, int]:
            async with Client(params, cache=None) as client:
                got = await client.call_tool("set_pool_size", {"pool": "local", "nodes": 2})
                assert not got.is_error, got.content
                sizes = await client.call_tool("pool_sizes", {})
                return dict(sizes.structured_content["pools"]["local"])

        assert asyncio.run(resize())["desired"] == 2
        # the launcher follows the desired size the tool set: a second node process starts
        wait_for(lambda: len(node_processes(run_dir)) == 2, 120, "a second node process")
    assert results and results[0].reason == "stopped", results
    assert processes_mentioning(str(run_dir)) == []
