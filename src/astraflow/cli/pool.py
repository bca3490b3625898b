"""``astraflow pool``: add or retire rollout nodes of a running job."""

from __future__ import annotations

import argparse

from astraflow.errors import AstraflowError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``pool`` subcommand."""
    parser = sub.add_parser("pool", help="add or retire rollout nodes of a running job")
    parser.set_defaults(func=_todo)


def _todo(args: argparse.Namespace) -> int:
    raise AstraflowError("'astraflow pool' is being built (issue 6)")
