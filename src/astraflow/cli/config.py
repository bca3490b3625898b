"""``astraflow config show|check``: print a resolved run config, or check it before a run."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from astraflow.cli.options import add_common

if TYPE_CHECKING:
    from astraflow.launch.config import RunConfig


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``config`` subcommand."""
    parser = sub.add_parser("config", help="inspect and check run configs")
    verbs = parser.add_subparsers(dest="verb", metavar="<verb>", required=True)
    show = verbs.add_parser(
        "show", help="print the fully resolved run config (defaults filled in) as JSON"
    )
    add_common(show, config_required=True)
    show.set_defaults(func=_show)
    check = verbs.add_parser(
        "check",
        help="check a run config as a run would, before anything starts: every section and "
        "every plug-in spec (workflows, tools, rewards, engines, task generators, data "
        "algorithms) resolved and validated, nothing built or written; exit 1 naming the key "
        "path of each problem",
    )
    add_common(check, config_required=True)
    check.set_defaults(func=_check)


def _load(args: argparse.Namespace) -> RunConfig:
    from astraflow.config import load_config
    from astraflow.launch.config import RunConfig

    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"run_dir={args.run_dir}")
    return load_config(RunConfig, args.config, overrides)


def _show(args: argparse.Namespace) -> int:
    print(_load(args).model_dump_json(indent=2))
    return 0


def _check(args: argparse.Namespace) -> int:
    from astraflow.errors import ConfigError
    from astraflow.launch.checks import check_run

    try:
        config = _load(args)
    except ConfigError as exc:
        print(f"astraflow: config check: {exc}", file=sys.stderr)
        return 1
    problems = check_run(config)
    for problem in problems:
        print(f"astraflow: config check: {args.config}: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"{args.config}: ok")
    return 0
