"""``astraflow train``: a trainer for one policy (take batches, step, publish weights).

FSDP2 runs one process per rank: ``torchrun --nproc-per-node N -m astraflow train --config
FILE`` (with ``backend: fsdp2``). SIGTERM / Ctrl-C finish the current step, checkpoint and
exit; a second Ctrl-C exits at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any

from astraflow.cli.options import add_common, init_logging, stop_on_signals


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``train`` subcommand."""
    parser = sub.add_parser(
        "train",
        help="a trainer for one policy (take batches, step, publish weights)",
        description="Train one policy: take batches from the dataflow service, step, publish "
        "each version to the weight store and announce it. For FSDP2 start it under "
        "'torchrun --nproc-per-node N -m astraflow train --config FILE' with backend: fsdp2.",
    )
    add_common(parser, config_required=True)
    parser.set_defaults(func=_train)


class _Progress:
    """Rich progress on a terminal, one plain line per version otherwise (rank 0 only)."""

    def __init__(self, total: int | None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console()
        self.live = self.console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]train[/] v{task.completed:.0f}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
            disable=not self.live,
        )
        self.task = self.progress.add_task("train", total=total, info="")

    def __enter__(self) -> _Progress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def update(self, record: dict[str, float]) -> None:
        info = (
            f"loss {record['loss']:.4f}  reward {record['reward_mean']:.3f}  "
            f"samples {record['samples']:.0f}  {record['tokens_per_s']:.0f} tok/s  "
            f"wait {record['wait_s']:.2f}s"
        )
        self.progress.update(self.task, completed=record["version"], info=info)
        if not self.live:
            self.console.print(f"version {record['version']:.0f}  {info}", highlight=False)


def _train(args: argparse.Namespace) -> int:
    rank = int(os.environ.get("RANK", "0"))
    init_logging(args, "trainer" if rank == 0 else f"trainer[{rank}]")
    from astraflow.cli.bars import show_progress
    from astraflow.config import load_config
    from astraflow.heap import freeze_heap
    from astraflow.trainer.config import TrainerConfig
    from astraflow.trainer.loop import Trainer

    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"run_dir={args.run_dir}")
    config = load_config(TrainerConfig, args.config, overrides)
    stop = stop_on_signals()
    progress = _Progress(config.max_steps)
    kwargs: dict[str, Any] = {"on_step": progress.update} if rank == 0 else {}
    trainer = Trainer(config, **kwargs)
    try:
        with show_progress() if rank == 0 else contextlib.nullcontext():
            trainer.start()  # a fresh run warms up here: a bar on a terminal
        freeze_heap(f"trainer {config.policy}")  # what start built lives until exit
        with progress if rank == 0 else contextlib.nullcontext():
            trainer.run(stop)
    finally:
        trainer.close()
    return 0
