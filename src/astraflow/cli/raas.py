"""``astraflow raas``: a rollout node (lease tasks, run workflows, push trajectories)."""

from __future__ import annotations

import argparse

from astraflow.errors import AstraflowError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``raas`` subcommand."""
    parser = sub.add_parser(
        "raas", help="a rollout node (lease tasks, run workflows, push trajectories)"
    )
    parser.set_defaults(func=_todo)


def _todo(args: argparse.Namespace) -> int:
    raise AstraflowError("'astraflow raas' is being built (issue 4)")
