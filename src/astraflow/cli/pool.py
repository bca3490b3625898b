"""``astraflow pool add|remove|ls``: resize rollout pools of a running job.

The dataflow service holds each pool's desired node count; the launcher of the run (or any
provisioner) starts or retires nodes to match it within a second or two. Removing a node
is graceful: it hands its leases back before it exits, so no task is lost.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from astraflow.errors import ConfigError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``pool`` subcommand."""
    parser = sub.add_parser(
        "pool",
        help="add or retire rollout nodes of a running job",
        description="Change or show the desired node count of rollout pools. Point it at a "
        "run with --run-dir (as given to 'astraflow run') or at a dataflow service with "
        "--dataflow URL. The admin token, if the service uses one, comes from "
        "ASTRAFLOW_ADMIN_TOKEN.",
    )
    verbs = parser.add_subparsers(dest="verb", metavar="<verb>", required=True)
    for verb, text in (
        ("add", "add N nodes to a pool"),
        ("remove", "retire N nodes of a pool (they hand back their leases)"),
        ("ls", "show desired, observed and autoscaler-target node counts per pool"),
    ):
        p = verbs.add_parser(verb, help=text)
        where = p.add_mutually_exclusive_group(required=True)
        where.add_argument("--run-dir", metavar="DIR", help="run directory of a running job")
        where.add_argument("--dataflow", metavar="URL", help="dataflow service URL")
        if verb != "ls":
            p.add_argument("count", nargs="?", type=int, default=1, help="nodes (default 1)")
            p.add_argument("--pool", default="local", help="pool label (default 'local')")
        p.set_defaults(func=_pool)


def dataflow_url(run_dir: str) -> str:
    """The dataflow URL of the run in ``run_dir`` (from its component config)."""
    path = Path(run_dir) / "components" / "dataflow.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no {path.name} under components/)")
    data = json.loads(path.read_text())
    return f"http://{data['host']}:{data['port']}"


def _pool(args: argparse.Namespace) -> int:
    from astraflow.dataflow.client import DataflowClient

    url = args.dataflow or dataflow_url(args.run_dir)
    with DataflowClient(url, token=os.environ.get("ASTRAFLOW_ADMIN_TOKEN")) as client:
        if args.verb != "ls":
            if args.count < 1:
                raise ConfigError(f"count must be at least 1, got {args.count}")
            delta = args.count if args.verb == "add" else -args.count
            size = client.set_pool_size(args.pool, delta=delta)
            print(f"pool {size.pool}: desired {size.desired} nodes (observed {size.observed})")
            return 0
        sizes = client.pool_sizes()
    print(f"{'pool':<16}{'desired':>8}{'observed':>10}{'target':>8}")
    for name, s in sorted(sizes.pools.items()):
        desired = "-" if s.desired is None else str(s.desired)
        print(f"{name:<16}{desired:>8}{s.observed:>10}{s.target:>8}")
    return 0
