"""``astraflow raas serve``: a rollout node (lease tasks, run workflows, push trajectories).

Flags are shorthands for config keys; precedence: --config file < flags < --set.
SIGTERM / SIGINT stop the node gracefully (exit 0); a second one stops it at once.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from astraflow.cli.options import add_common, init_logging

ENGINE_TYPES = ("transformers", "vllm", "sglang", "openai")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``raas`` subcommand."""
    parser = sub.add_parser(
        "raas", help="a rollout node (lease tasks, run workflows, push trajectories)"
    )
    commands = parser.add_subparsers(dest="raas_command", metavar="<raas command>")
    serve = commands.add_parser(
        "serve",
        help="run a rollout node until SIGTERM",
        description="Lease tasks from the dataflow service, run their workflows with the "
        "hosted policies, push the trajectories, refresh weights from the weight store.",
    )
    serve.add_argument("--dataflow", metavar="URL", help="dataflow service URL (dataflow_url)")
    serve.add_argument("--weights", metavar="URL", help="weight store: server URL or path")
    serve.add_argument(
        "--policy",
        metavar="NAME[=MODEL]",
        action="append",
        default=[],
        help="host a policy (repeatable); MODEL: a local directory, a .gguf file or a hub "
        "name; without it the model is built from the weight store's assets",
    )
    serve.add_argument("--engine", choices=ENGINE_TYPES, help="engine of the --policy policies")
    serve.add_argument(
        "--workflow",
        metavar="NAME",
        action="append",
        default=[],
        help="run this registered workflow (repeatable; default from config, else rlvr)",
    )
    serve.add_argument("--pool", metavar="LABEL", help="pool label (region, hardware ...)")
    serve.add_argument("--capacity", metavar="N", type=int, help="tasks run at once")
    serve.add_argument("--node-id", metavar="ID", help="node id (default host-pid)")
    add_common(serve)
    serve.set_defaults(func=_serve)
    parser.set_defaults(func=lambda args: _usage(parser))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _model_spec(model: str) -> dict[str, Any]:
    path = Path(model)
    if path.suffix == ".gguf":
        return {"name_or_path": str(path.parent), "gguf_file": path.name}
    return {"name_or_path": model}


def config_data(args: argparse.Namespace) -> dict[str, Any]:
    """The node config as a mapping: file, then flags, then ``--set``."""
    from astraflow.config import apply_overrides, read_yaml

    data: dict[str, Any] = read_yaml(args.config) if args.config else {}
    simple = {
        "dataflow_url": args.dataflow,
        "weights": args.weights,
        "pool": args.pool,
        "capacity": args.capacity,
        "node_id": args.node_id,
        "work_dir": args.run_dir,
    }
    data.update({k: v for k, v in simple.items() if v is not None})
    policies = dict(data.get("policies") or {})
    for item in args.policy:
        name, _, model = item.partition("=")
        entry = dict(policies.get(name) or {})
        if model:
            entry["model"] = _model_spec(model)
        if args.engine:
            entry["engine"] = {**dict(entry.get("engine") or {}), "type": args.engine}
        policies[name] = entry
    if policies:
        data["policies"] = policies
    if args.workflow:
        known = dict(data.get("workflows") or {})
        data["workflows"] = {name: known.get(name, {}) for name in args.workflow}
    return apply_overrides(data, args.overrides)


def _serve(args: argparse.Namespace) -> int:
    init_logging(args, "raas")
    from astraflow.config import validate
    from astraflow.raas.config import NodeConfig

    config = validate(NodeConfig, config_data(args), source=args.config or "astraflow raas serve")
    return _run(config)


def _run(config: Any) -> int:
    import asyncio
    import signal
    import threading

    from astraflow.raas.node import run_node

    async def main() -> None:
        stop = threading.Event()
        loop = asyncio.get_running_loop()
        current = asyncio.current_task()
        signals = {"count": 0}

        def on_signal() -> None:
            signals["count"] += 1
            if signals["count"] == 1:
                stop.set()
            elif current is not None:
                current.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        await run_node(config, stop)

    try:
        asyncio.run(main())
    except asyncio.CancelledError:
        return 130
    return 0
