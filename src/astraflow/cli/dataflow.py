"""``astraflow dataflow``: the dataflow service (task queue, buffers, plug-ins, report)."""

from __future__ import annotations

import argparse

from astraflow.errors import AstraflowError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``dataflow`` subcommand."""
    parser = sub.add_parser(
        "dataflow", help="the dataflow service (task queue, buffers, plug-ins, report)"
    )
    parser.set_defaults(func=_todo)


def _todo(args: argparse.Namespace) -> int:
    raise AstraflowError("'astraflow dataflow' is being built (issue 2)")
