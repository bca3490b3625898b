"""``astraflow link``: run an emulated WAN link in front of services, or measure one.

    astraflow link serve --forward df=9701:127.0.0.1:8700 --delay-ms 150 --rate-mbit 100
    astraflow link measure --delay-ms 150 --rate-mbit 100     (RTT and rate vs configured)

The link's shape comes from ``--config`` (a ``LinkConfig`` YAML), ``--set key=value`` and
the shortcuts ``--delay-ms``, ``--rate-mbit``, ``--jitter-ms``, ``--loss``.
"""

from __future__ import annotations

import argparse
from typing import Any

from astraflow.cli.options import add_common, init_logging, stop_on_signals

_SHORTCUTS = ("delay_ms", "rate_mbit", "jitter_ms", "loss")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``link`` subcommand (``serve``, ``measure``)."""
    parser = sub.add_parser(
        "link", help="an emulated WAN link (delay, bandwidth, jitter, loss) as a TCP relay"
    )
    actions = parser.add_subparsers(dest="action", metavar="<action>", required=True)
    serve = actions.add_parser("serve", help="relay TCP forwards through the shaped link")
    _shape_options(serve)
    serve.add_argument(
        "--forward",
        action="append",
        required=True,
        metavar="[NAME=][HOST:]PORT:UPSTREAM_HOST:UPSTREAM_PORT",
        help="listen on PORT and relay to UPSTREAM (repeatable; forwards share the link)",
    )
    serve.set_defaults(func=_serve)
    measure = actions.add_parser(
        "measure", help="measure RTT and throughput of a link of this shape on loopback"
    )
    _shape_options(measure)
    measure.add_argument("--bulk-mb", type=float, help="bytes per throughput test, in MB")
    measure.add_argument(
        "--tolerance", type=float, default=0.1, help="exit 1 beyond this relative error"
    )
    measure.set_defaults(func=_measure)


def _shape_options(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    parser.add_argument("--delay-ms", type=float, help="one-way delay in ms")
    parser.add_argument("--rate-mbit", type=float, help="bandwidth per direction in Mbit/s")
    parser.add_argument("--jitter-ms", type=float, help="delay variation in ms (order kept)")
    parser.add_argument("--loss", type=float, help="segment loss probability (a stall each)")


def _config(args: argparse.Namespace) -> Any:
    from astraflow.config import load_config
    from astraflow.link import LinkConfig

    flags = {k: getattr(args, k) for k in _SHORTCUTS if getattr(args, k) is not None}
    overrides = [*args.overrides, *(f"{k}={v}" for k, v in flags.items())]
    return load_config(LinkConfig, args.config, overrides)


def _serve(args: argparse.Namespace) -> int:
    from astraflow.link import Forward, Link

    init_logging(args, "link")
    config = _config(args)
    link = Link(config, [Forward.parse(text) for text in args.forward])
    stop = stop_on_signals()
    with link:
        for fw, (host, port) in zip(link.forwards, link.addresses, strict=True):
            print(
                f"link {fw.name or '-'}: {host}:{port} -> {fw.upstream[0]}:{fw.upstream[1]}",
                flush=True,
            )
        stop.wait()
    return 0


def _measure(args: argparse.Namespace) -> int:
    from astraflow.link import measure

    init_logging(args, "link")
    config = _config(args)
    bulk = int(args.bulk_mb * 1e6) if args.bulk_mb else None
    fidelity = measure(config, bulk_bytes=bulk)
    print(fidelity.table())
    ok = fidelity.within(args.tolerance)
    print(f"within {args.tolerance:.0%}: {'yes' if ok else 'no'}")
    return 0 if ok else 1
