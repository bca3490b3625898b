"""``astraflow weights``: serve a weight store over HTTP (or relay one to a region), list and
verify its versions."""

from __future__ import annotations

import argparse

from astraflow.cli.options import add_common, init_logging


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``weights`` subcommand (``serve``, ``relay``, ``ls``, ``verify``)."""
    parser = sub.add_parser(
        "weights", help="the weight store (versioned full and delta weights over HTTP)"
    )
    actions = parser.add_subparsers(dest="action", metavar="<action>", required=True)
    serve = actions.add_parser(
        "serve",
        help="serve a store directory over HTTP (range requests; bearer tokens from "
        "ASTRAFLOW_WEIGHTS_READ_TOKEN / ASTRAFLOW_WEIGHTS_PUBLISH_TOKEN)",
    )
    add_common(serve)
    serve.add_argument("--root", required=True, help="store directory to serve")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8020, help="port to bind (default 8020)")
    serve.set_defaults(func=_serve)
    relay = actions.add_parser(
        "relay",
        help="a regional mirror: pull each version once from an upstream weight server, "
        "verify it, serve it with the same API (upstream token: ASTRAFLOW_RELAY_UPSTREAM_TOKEN, "
        "else ASTRAFLOW_WEIGHTS_READ_TOKEN)",
    )
    add_common(relay)
    relay.add_argument("--upstream", required=True, help="URL of the upstream weight server")
    relay.add_argument("--root", required=True, help="local store directory of the mirror")
    relay.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    relay.add_argument("--port", type=int, default=8021, help="port to bind (default 8021)")
    relay.add_argument(
        "--policy", action="append", default=[], help="policy to mirror ahead of requests"
    )
    relay.add_argument("--poll-s", type=float, default=1.0, help="upstream poll period (s)")
    relay.add_argument(
        "--wait-s", type=float, default=60.0, help="give up at start if upstream stays down"
    )
    relay.set_defaults(func=_relay)
    ls = actions.add_parser("ls", help="list the versions of a policy")
    add_common(ls)
    ls.add_argument("--source", required=True, help="store directory, fsspec URL or server URL")
    ls.add_argument("policy", help="policy id")
    ls.set_defaults(func=_ls)
    verify = actions.add_parser("verify", help="download a version and check every checksum")
    add_common(verify)
    verify.add_argument("--source", required=True, help="store directory, fsspec URL or server URL")
    verify.add_argument("policy", help="policy id")
    verify.add_argument("--version", type=int, help="version to verify (default: latest)")
    verify.set_defaults(func=_verify)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from astraflow.weights.server import WeightServerConfig, standalone_app

    init_logging(args, "weights")
    app = standalone_app(args.root, WeightServerConfig())  # tokens: ASTRAFLOW_WEIGHTS_*_TOKEN
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", ws="none", lifespan="off")
    return 0


def _relay(args: argparse.Namespace) -> int:
    import os
    import threading

    import uvicorn

    from astraflow.weights.access import client_token
    from astraflow.weights.relay import WeightRelay, relay_app, wait_for_upstream
    from astraflow.weights.server import WeightServerConfig
    from astraflow.weights.transfer import TransferOptions

    init_logging(args, "weights-relay")
    token = os.environ.get("ASTRAFLOW_RELAY_UPSTREAM_TOKEN") or client_token()
    relay = WeightRelay(
        args.upstream, args.root, policies=args.policy, options=TransferOptions(token=token)
    )
    try:
        wait_for_upstream(relay, args.wait_s)  # a wrong URL or a dead WAN: fail loud, early
        stop = threading.Event()
        poller = threading.Thread(target=relay.poll, args=(stop, args.poll_s), daemon=True)
        poller.start()
        app = relay_app(relay, WeightServerConfig())  # tokens: ASTRAFLOW_WEIGHTS_*_TOKEN
        uvicorn.run(
            app, host=args.host, port=args.port, log_level="warning", ws="none", lifespan="off"
        )
        stop.set()
        poller.join(timeout=30)
    finally:
        relay.close()
    return 0


def _ls(args: argparse.Namespace) -> int:
    from astraflow.weights import WeightClient
    from astraflow.weights.access import client_token
    from astraflow.weights.transfer import TransferOptions

    init_logging(args, "weights")
    options = TransferOptions(token=client_token())
    with WeightClient(args.source, options=options) as client:
        client.check()  # a wrong path or URL is named, not listed as "no versions"
        latest = client.latest(args.policy)
        if latest is None:
            print(f"policy {args.policy}: no versions")
            return 1
        version: int | None = latest
        while version is not None:
            m = client.manifest(args.policy, version)
            size = sum(f.size for f in m.files)
            kind = "full+delta" if m.full and m.base is not None else "full" if m.full else "delta"
            print(f"v{m.version}\t{kind}\tbase={m.base}\tbytes={size}\ttensors={len(m.tensors)}")
            version = m.base
    return 0


def _verify(args: argparse.Namespace) -> int:
    from astraflow.weights import WeightClient
    from astraflow.weights.access import client_token
    from astraflow.weights.transfer import TransferOptions

    init_logging(args, "weights")
    options = TransferOptions(token=client_token())
    with WeightClient(args.source, options=options) as client:
        client.check()
        version = args.version if args.version is not None else client.latest(args.policy)
        tensors = client.load(args.policy, version)
    print(f"policy {args.policy} v{version}: {len(tensors)} tensors verified")
    return 0
