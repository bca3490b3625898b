"""``astraflow weights``: the weight store (versioned full and delta weights over HTTP)."""

from __future__ import annotations

import argparse

from astraflow.errors import AstraflowError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``weights`` subcommand."""
    parser = sub.add_parser(
        "weights", help="the weight store (versioned full and delta weights over HTTP)"
    )
    parser.set_defaults(func=_todo)


def _todo(args: argparse.Namespace) -> int:
    raise AstraflowError("'astraflow weights' is being built (issue 3)")
