"""``astraflow eval``: greedy held-out accuracy of each new version of a policy."""

from __future__ import annotations

import argparse

from astraflow.cli.options import add_common, init_logging, stop_on_signals


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``eval`` subcommand."""
    parser = sub.add_parser(
        "eval",
        help="evaluate each new weight version of a policy on a held-out task set",
        description="Watch the weight store; whenever a policy has a newer version, pull it, "
        "generate greedily for every held-out task, score with the workflow's reward and "
        "append {version, accuracy} to a JSONL file. SIGTERM evaluates the newest version "
        "once more, then exits.",
    )
    add_common(parser, config_required=True)
    parser.set_defaults(func=_eval)


def _eval(args: argparse.Namespace) -> int:
    init_logging(args, "eval")
    from astraflow.config import load_config
    from astraflow.evaluation.config import EvalConfig
    from astraflow.evaluation.runner import Evaluator

    config = load_config(EvalConfig, args.config, args.overrides)
    stop = stop_on_signals()
    Evaluator(config).run(stop)
    return 0
