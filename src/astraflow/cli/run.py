"""``astraflow run CONFIG``: start a whole run (dataflow, weight store, trainers, nodes).

One live view shows versions, reward, held-out accuracy, samples/s, trainer waiting and pool
sizes. Ctrl-C stops every component in order (a second Ctrl-C kills them); running the same
command again resumes the run from its run directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from astraflow.cli.options import add_common, init_logging, stop_on_signals


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``run`` subcommand."""
    parser = sub.add_parser(
        "run",
        help="run a whole training job (dataflow, weight store, trainers, rollout nodes)",
        description="Start every component of a run described by one YAML file, show live "
        "progress, and stop everything cleanly on Ctrl-C. Re-running the same command "
        "resumes the run from its run directory. Example: astraflow run "
        "examples/quickstart.yaml",
    )
    parser.add_argument("run_config", nargs="?", metavar="CONFIG", help="run config (YAML)")
    parser.add_argument(
        "--cluster",
        choices=("local", "ray"),
        default="local",
        help="'local': components as processes on this machine (default); 'ray': as Ray "
        "actors on the cluster at $RAY_ADDRESS (or a local Ray)",
    )
    parser.add_argument(
        "--mode",
        choices=("async", "sync"),
        help="override the config's mode: 'sync' runs the same work trainer-centred, in "
        "lock-step rounds, for comparison",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a few trainer steps only (3 per trained policy, short warm-up, small held-out "
        "sets): check that a config runs end to end before paying for the real run",
    )
    add_common(parser)
    parser.set_defaults(func=_run)


def _load(args: argparse.Namespace) -> tuple[Any, Path]:
    from astraflow.config import load_config
    from astraflow.errors import ConfigError
    from astraflow.launch.config import RunConfig

    path = args.run_config or args.config
    if path is None:
        raise ConfigError("give the run config: astraflow run CONFIG")
    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"run_dir={args.run_dir}")
    if args.mode:
        overrides.append(f"mode={args.mode}")
    config = load_config(RunConfig, path, overrides)
    if args.smoke:
        from astraflow.launch.smoke import smoke_config

        config = smoke_config(config)
    return config, Path(path).resolve().parent


def _run(args: argparse.Namespace) -> int:
    init_logging(args, "run")
    config, base_dir = _load(args)
    stop = stop_on_signals()  # a second Ctrl-C ends the launcher at once
    from astraflow.cli.bars import show_progress
    from astraflow.cli.progress import RunView

    view = RunView(config)
    with show_progress():  # planning generates warm-up data: a bar, before the live view
        launcher: Any
        if args.cluster == "ray":
            from astraflow.launch.ray import RayRun

            launcher = RayRun(config, base_dir=base_dir, on_tick=view.update)
        else:
            from astraflow.launch.local import LocalRun

            launcher = LocalRun(config, base_dir=base_dir, on_tick=view.update)
    with view:
        view.dashboard(launcher.dashboard_link())
        result = launcher.run(stop)
    view.final(result)
    return 0 if result.ok else 1
