"""``astraflow mcp``: serve a running job as MCP tools, so an agent can be its maintainer."""

from __future__ import annotations

import argparse
import os

from astraflow.cli.options import init_logging
from astraflow.observability import LOG_LEVELS

_HELP = """\
Serve a running job as a Model Context Protocol server: tools report, pool_sizes,
set_pool_size, recent_decisions and resources astraflow://report, astraflow://pools,
astraflow://decisions. It is a client of the dataflow service and uses the admin token
from ASTRAFLOW_ADMIN_TOKEN for every call; over HTTP, MCP clients must present the same
token (Authorization: Bearer ...).

  # stdio, e.g. in an MCP client's config:
  #   {"command": "astraflow", "args": ["mcp", "--run-dir", "runs/elastic_autoscale"],
  #    "env": {"ASTRAFLOW_ADMIN_TOKEN": "..."}}
  astraflow mcp --run-dir runs/elastic_autoscale
  # streamable HTTP at http://127.0.0.1:8765/mcp
  astraflow mcp --dataflow http://127.0.0.1:8600 --transport http --port 8765
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``mcp`` subcommand."""
    parser = sub.add_parser(
        "mcp",
        help="serve a running job as MCP tools (an agent as maintainer)",
        description=_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", metavar="DIR", help="run directory of a running job")
    where.add_argument("--dataflow", metavar="URL", help="dataflow service URL")
    parser.add_argument("--transport", choices=("stdio", "http"), default="stdio",
                        help="stdio (default) or streamable HTTP")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    parser.add_argument("--port", type=int, default=8765, help="HTTP port (default 8765)")
    parser.add_argument("--poll-s", type=float, default=2.0, metavar="S",
                        help="read the report every S seconds for recent_decisions (0: only "
                        "when a tool reads it)")  # fmt: skip
    parser.add_argument("--log-level", default="WARNING", choices=LOG_LEVELS)
    parser.add_argument("--log-format", default="text", choices=("text", "json"))
    parser.set_defaults(func=_mcp)


def _mcp(args: argparse.Namespace) -> int:
    from astraflow.cli.pool import dataflow_url
    from astraflow.dataflow.client import DataflowClient
    from astraflow.errors import ConfigError
    from astraflow.mcp.server import Maintainer, build_server
    from astraflow.mcp.transports import serve_http, serve_stdio

    init_logging(args, "mcp")  # logs go to stderr: stdout is the stdio transport
    if args.poll_s < 0:
        raise ConfigError(f"--poll-s must be >= 0, got {args.poll_s}")
    url = args.dataflow or dataflow_url(args.run_dir)
    token = os.environ.get("ASTRAFLOW_ADMIN_TOKEN") or None
    maintainer = Maintainer(DataflowClient(url, token=token, timeout_s=10.0), args.poll_s)
    server = build_server(maintainer)
    maintainer.start_polling()
    try:
        if args.transport == "http":
            serve_http(server, token, args.host, args.port)
        else:
            serve_stdio(server)
    finally:
        maintainer.close()
    return 0
