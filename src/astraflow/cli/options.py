"""The options every subcommand shares: ``--config``, ``--set``, ``--run-dir``, ``--log-level``."""

from __future__ import annotations

import argparse
import signal
import threading
from types import FrameType

from astraflow.observability import LOG_LEVELS, setup_logging


def add_common(parser: argparse.ArgumentParser, *, config_required: bool = False) -> None:
    """Add the shared options to a subcommand parser."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        required=config_required,
        help="YAML config file for this component",
    )
    parser.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="overrides",
        help="override one config value by dotted key, e.g. --set seed=3 or --set pools.0.nodes=2 "
        "(repeatable; values are parsed as YAML)",
    )
    parser.add_argument(
        "--run-dir",
        metavar="DIR",
        help="directory for this run's state, logs and outputs (overrides the config's)",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=LOG_LEVELS, help="logging level (default INFO)"
    )
    parser.add_argument(
        "--log-format", default="text", choices=("text", "json"), help="log line format"
    )


def init_logging(args: argparse.Namespace, component: str) -> None:
    """Set up logging from the shared options (once per process)."""
    setup_logging(args.log_level, args.log_format, component=component)


def stop_on_signals() -> threading.Event:
    """An event SIGTERM or SIGINT sets (a graceful stop); a second signal ends the process."""
    stop = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()
        signal.signal(signum, signal.SIG_DFL)  # a second signal ends the process at once

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return stop
