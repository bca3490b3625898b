"""``astraflow`` entry point: parse arguments, set up logging, dispatch to a subcommand.

Each subcommand lives in its own module under ``astraflow.cli`` exposing ``register(sub)``;
a module imports its component only inside the handler, so ``astraflow --help`` stays fast
and never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from astraflow import __version__
from astraflow.errors import AstraflowError

#: Subcommand modules, in the order ``--help`` lists them.
SUBCOMMANDS = (
    "run",
    "dataflow",
    "weights",
    "raas",
    "train",
    "eval",
    "export",
    "pool",
    "mcp",
    "config",
    "env",
    "link",
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (every subcommand registered)."""
    parser = argparse.ArgumentParser(
        prog="astraflow",
        description=(
            "Dataflow-oriented RL for agentic LLMs. Rollout nodes, the dataflow service and "
            "trainers run as separate components that meet only at the dataflow service "
            "(data) and the weight store (weights). Start everything at once with "
            "'astraflow run CONFIG', or each component alone on any machine."
        ),
        epilog="Run 'astraflow <command> --help' for the options of one command.",
    )
    parser.add_argument("--version", action="version", version=f"astraflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name in SUBCOMMANDS:
        importlib.import_module(f"astraflow.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code: int = args.func(args)
    except AstraflowError as exc:
        print(f"astraflow: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
