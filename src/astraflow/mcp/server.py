"""``astraflow mcp``: a running job as Model Context Protocol tools and resources.

Any MCP client (Claude Code, an IDE agent, a script) can then be the run's maintainer: read
the dataflow's report and resize rollout pools, the way the paper's agent did. The server is
a client of the dataflow HTTP API (``DataflowClient``) holding the admin token; it imports
nothing else of the dataflow, so it runs anywhere the service is reachable::

    MCP client ──stdio / streamable HTTP (Bearer admin token)──► astraflow mcp
        tools:     report · pool_sizes · set_pool_size · recent_decisions
        resources: astraflow://report · astraflow://pools · astraflow://decisions
    astraflow mcp ──HTTP (Bearer admin token)──► dataflow /v1/report, /v1/admin/pools
    launcher (PoolManager) ──reads desired sizes──► starts / retires nodes

Errors a caller can act on (a wrong token, an unknown pool, bad arguments, the service down)
come back as tool errors naming the problem (``isError``), never as a crash.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import anyio.to_thread
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError
from pydantic import Field
from pydantic import ValidationError as PydanticValidationError

from astraflow import __version__
from astraflow.dataflow.client import DataflowClient
from astraflow.errors import AstraflowError
from astraflow.mcp.decisions import DecisionLog
from astraflow.records import MAX_POOL_NODES, DataflowReport, PoolSizeRequest

__all__ = ["Maintainer", "build_server"]

log = logging.getLogger(__name__)
T = TypeVar("T")

INSTRUCTIONS = (
    "Tools to maintain a running astraflow job. 'report' is the dataflow's report: per pool "
    "the active nodes, desired size and dead-band target; per trainer the fraction of time it "
    "waits for data. The dead-band rule: trainers wait above the band's high end -> one more "
    "node; below its low end for a while -> one fewer; inside -> hold. 'set_pool_size' sets a "
    "pool's desired node count (nodes) or changes it (delta); the launcher starts or retires "
    "nodes to match within seconds. 'recent_decisions' is the log of sizing changes seen."
)


class Maintainer:
    """The dataflow calls behind the tools, plus the decision log and its background poll."""

    def __init__(self, client: DataflowClient, poll_s: float = 2.0) -> None:
        self.client = client
        self.decisions = DecisionLog()
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    def report(self) -> DataflowReport:
        """The dataflow's report (recorded into the decision log)."""
        report = self.client.report()
        self.decisions.observe(report)
        return report

    def set_pool_size(
        self, pool: str, nodes: int | None, delta: int | None, reason: str
    ) -> dict[str, Any]:
        """Check the request and the pool, then set the desired size."""
        try:
            PoolSizeRequest(pool=pool, nodes=nodes, delta=delta)
        except PydanticValidationError as exc:
            problems = "; ".join(e["msg"] for e in exc.errors())
            raise ToolError(f"invalid set_pool_size arguments: {problems}") from None
        known = self.client.pool_sizes().pools
        if pool not in known:
            names = ", ".join(sorted(known)) or "none yet"
            raise ToolError(f"unknown pool {pool!r} (pools of this run: {names})")
        size = self.client.set_pool_size(pool, nodes=nodes, delta=delta)
        self.decisions.resized(size, reason)
        log.info("mcp set_pool_size pool=%s desired=%s (%s)", pool, size.desired, reason)
        return size.model_dump(mode="json")

    def start_polling(self) -> None:
        """Read the report every ``poll_s`` in a daemon thread (0: only on demand)."""
        if self.poll_s <= 0 or self._poller is not None:
            return
        self._poller = threading.Thread(target=self._poll, name="mcp-poll", daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.report()
            except AstraflowError as exc:  # down, restarting or refusing: the tools say so
                log.debug("report poll failed: %s", exc)

    def close(self) -> None:
        """Stop polling and close the dataflow connection."""
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5)
        self.client.close()


async def _call(fn: Callable[[], T], what: str, error: type[Exception] = ToolError) -> T:
    """Run a blocking dataflow call off the event loop; its errors become ``error``."""
    try:
        return await anyio.to_thread.run_sync(fn)
    except AstraflowError as exc:
        raise error(f"{what} failed: {type(exc).__name__}: {exc}") from None


def build_server(maintainer: Maintainer) -> MCPServer:
    """The MCP server: four tools and three resources over ``maintainer``."""
    server: MCPServer = MCPServer(
        "astraflow", instructions=INSTRUCTIONS, version=__version__, log_level="WARNING"
    )
    _add_tools(server, maintainer)
    _add_resources(server, maintainer)
    return server


def _add_tools(server: MCPServer, m: Maintainer) -> None:
    @server.tool()
    async def report() -> dict[str, Any]:
        """The dataflow report: tasks, pools (nodes, desired, target), trainers (waiting
        fraction), policies (buffers), plug-in counters and the dead-band decision."""
        got = await _call(m.report, "reading the report")
        return got.model_dump(mode="json")

    @server.tool()
    async def pool_sizes() -> dict[str, Any]:
        """Per pool: desired node count (None: never set), observed nodes, dead-band target."""
        got = await _call(m.client.pool_sizes, "reading pool sizes")
        return got.model_dump(mode="json")

    @server.tool()
    async def set_pool_size(
        pool: Annotated[str, Field(min_length=1, max_length=128, description="pool label")],
        nodes: Annotated[
            int | None, Field(ge=0, le=MAX_POOL_NODES, description="new desired node count")
        ] = None,
        delta: Annotated[
            int | None,
            Field(ge=-MAX_POOL_NODES, le=MAX_POOL_NODES, description="change of desired count"),
        ] = None,
        reason: Annotated[str, Field(max_length=500, description="why (kept in the log)")] = "",
    ) -> dict[str, Any]:
        """Set a pool's desired node count: exactly one of nodes (absolute) or delta
        (relative). The launcher starts or retires nodes to match."""
        return await _call(
            lambda: m.set_pool_size(pool, nodes, delta, reason), f"resizing pool {pool!r}"
        )

    @server.tool()
    async def recent_decisions(
        limit: Annotated[int, Field(ge=1, le=500, description="entries, newest last")] = 20,
        pool: Annotated[str | None, Field(description="only this pool")] = None,
    ) -> dict[str, Any]:
        """Recent sizing changes: desired/observed/target moves seen in the report (with the
        dead-band reason) and resizes made through set_pool_size."""
        await _call(m.report, "reading the report")
        return {"decisions": m.decisions.recent(limit, pool)}


def _add_resources(server: MCPServer, m: Maintainer) -> None:
    @server.resource("astraflow://report", mime_type="application/json")
    async def report_resource() -> str:
        """The dataflow report as JSON."""
        got = await _call(m.report, "reading the report", ResourceError)
        return got.model_dump_json()

    @server.resource("astraflow://pools", mime_type="application/json")
    async def pools_resource() -> str:
        """Desired, observed and target node counts per pool as JSON."""
        got = await _call(m.client.pool_sizes, "reading pool sizes", ResourceError)
        return got.model_dump_json()

    @server.resource("astraflow://decisions", mime_type="application/json")
    async def decisions_resource() -> str:
        """The latest 100 sizing decisions as JSON."""
        return json.dumps({"decisions": m.decisions.recent(100)})
