"""``astraflow run``: run a whole training job (dataflow, weight store, trainers, rollout nodes)."""

from __future__ import annotations

import argparse

from astraflow.errors import AstraflowError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``run`` subcommand."""
    parser = sub.add_parser(
        "run", help="run a whole training job (dataflow, weight store, trainers, rollout nodes)"
    )
    parser.set_defaults(func=_todo)


def _todo(args: argparse.Namespace) -> int:
    raise AstraflowError("'astraflow run' is being built (issue 6)")
