"""``astraflow dataflow``: the dataflow service (task queue, buffers, plug-ins, report)."""

from __future__ import annotations

import argparse

from astraflow.cli.options import add_common, init_logging

_SERVE_HELP = """\
Start the dataflow service: rollout nodes lease tasks from it and submit samples, trainers
take batches of whole groups and ack them, and everything is kept in SQLite under the run
directory, so a restart (even after kill -9) loses nothing that was acknowledged.

A minimal config (YAML):

  run_dir: runs/demo/dataflow
  port: 8600
  policies:
    solver: {vocab_size: 32000, max_staleness: 1, max_buffered: 4096}
  sources:
    - {name: arith, type: jsonl, path: data/arith.jsonl, workflow: rlvr,
       policies: [solver], group_size: 8, epochs: 3}
  selector: shuffled            # sequential | shuffled | curriculum | greso | pkg.mod:Class
  filters: [dynamic_sampling]   # dynamic_sampling | length | pkg.mod:Class
  sampler: fifo                 # fifo | freshest | edf | replay | mixing | pkg.mod:Class

Bearer tokens per role come from auth.{node,trainer,admin} or the environment
(ASTRAFLOW_NODE_TOKEN, ASTRAFLOW_TRAINER_TOKEN, ASTRAFLOW_ADMIN_TOKEN).
Endpoints: /v1/health, /v1/lease, /v1/submit, /v1/batches/take, /v1/report, /metrics, ...
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``dataflow`` subcommand."""
    parser = sub.add_parser(
        "dataflow", help="the dataflow service (task queue, buffers, plug-ins, report)"
    )
    actions = parser.add_subparsers(dest="action", metavar="<action>", required=True)
    serve = actions.add_parser(
        "serve",
        help="run the dataflow service until stopped",
        description=_SERVE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common(serve, config_required=True)
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from astraflow.config import load_config
    from astraflow.dataflow.config import DataflowConfig
    from astraflow.dataflow.server import serve

    init_logging(args, "dataflow")
    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"run_dir={args.run_dir}")
    config = load_config(DataflowConfig, args.config, overrides)
    serve(config)
    return 0
