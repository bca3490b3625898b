"""``astraflow eval``: held-out figures of a policy's versions, while it trains or afterwards."""

from __future__ import annotations

import argparse
import math

from astraflow.cli.options import add_common, init_logging, stop_on_signals


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``eval`` subcommand."""
    parser = sub.add_parser(
        "eval",
        help="evaluate versions of a policy on held-out task sets (accuracy, avg@k, pass@k)",
        description="With --config: watch the weight store; at each milestone version pull "
        "it, score every held-out set (greedy accuracy; with k: avg@k and pass@k of k "
        "samples per task) and append the figures to a JSONL file; SIGTERM evaluates the "
        "newest version once more, then exits. With --run-dir alone: evaluate one version "
        "of a finished run with the run's own evaluator config (--set k=8 ... to change it), "
        "append to <run-dir>/eval/<policy>.jsonl and print the figures. Example: astraflow "
        "eval --run-dir runs/quickstart --version 250 --set k=8",
    )
    add_common(parser)
    parser.add_argument("--policy", help="finished run: policy to evaluate (default: all)")
    parser.add_argument(
        "--version", type=int, metavar="N", help="finished run: version (default: the newest)"
    )
    parser.set_defaults(func=_eval)


def _eval(args: argparse.Namespace) -> int:
    from astraflow.errors import ConfigError

    if args.config is None and args.run_dir is None:
        raise ConfigError("astraflow eval needs --config FILE (watch) or --run-dir DIR")
    if args.config is None:
        return _finished(args)
    init_logging(args, "eval")
    from astraflow.config import load_config
    from astraflow.evaluation.config import EvalConfig
    from astraflow.evaluation.runner import Evaluator

    config = load_config(EvalConfig, args.config, args.overrides)
    stop = stop_on_signals()
    Evaluator(config).run(stop)
    return 0


def _finished(args: argparse.Namespace) -> int:
    """One version of a finished run, every evaluated policy unless --policy."""
    init_logging(args, "eval")
    from astraflow.cli.bars import show_progress
    from astraflow.errors import NotFoundError
    from astraflow.evaluation.runner import Evaluator
    from astraflow.launch.rundir import RunDir

    run = RunDir(args.run_dir)
    policies = [run.policy(args.policy)] if args.policy else run.evaluated()
    if not policies:
        raise NotFoundError(f"run {run.path} evaluated no policy (no 'eval' entries)")
    # check every argument before anything is evaluated or written
    jobs = [(run.eval_config(p, args.overrides), run.version(p, args.version)) for p in policies]
    with show_progress():
        for config, version in jobs:
            record = Evaluator(config).evaluate_version(version)
            figures = "  ".join(
                f"{k} {v:.3f}"
                for k, v in record.items()
                if isinstance(v, float) and math.isfinite(v) and k not in ("time", "created_at")
            )
            print(f"{config.policy} v{version}: {figures}  -> {config.out}")
    return 0
