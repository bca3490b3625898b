"""``astraflow train``: a trainer for one policy (take batches, step, publish weights)."""

from __future__ import annotations

import argparse

from astraflow.errors import AstraflowError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``train`` subcommand."""
    parser = sub.add_parser(
        "train", help="a trainer for one policy (take batches, step, publish weights)"
    )
    parser.set_defaults(func=_todo)


def _todo(args: argparse.Namespace) -> int:
    raise AstraflowError("'astraflow train' is being built (issue 5)")
