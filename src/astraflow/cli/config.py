"""``astraflow config show``: print a resolved run config as JSON."""

from __future__ import annotations

import argparse

from astraflow.cli.options import add_common


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``config`` subcommand."""
    parser = sub.add_parser("config", help="inspect run configs")
    verbs = parser.add_subparsers(dest="verb", metavar="<verb>", required=True)
    show = verbs.add_parser(
        "show", help="print the fully resolved run config (defaults filled in) as JSON"
    )
    add_common(show, config_required=True)
    show.set_defaults(func=_show)


def _show(args: argparse.Namespace) -> int:
    from astraflow.config import load_config
    from astraflow.launch.config import RunConfig

    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"run_dir={args.run_dir}")
    config = load_config(RunConfig, args.config, overrides)
    print(config.model_dump_json(indent=2))
    return 0
