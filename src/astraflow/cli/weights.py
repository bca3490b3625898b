"""``astraflow weights``: serve a weight store over HTTP, list and verify its versions."""

from __future__ import annotations

import argparse

from astraflow.cli.options import add_common, init_logging


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``weights`` subcommand (``serve``, ``ls``, ``verify``)."""
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


def _ls(args: argparse.Namespace) -> int:
    from astraflow.weights import WeightClient
    from astraflow.weights.access import client_token
    from astraflow.weights.transfer import TransferOptions

    init_logging(args, "weights")
    options = TransferOptions(token=client_token())
    with WeightClient(args.source, options=options) as client:
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
        version = args.version if args.version is not None else client.latest(args.policy)
        tensors = client.load(args.policy, version)
    print(f"policy {args.policy} v{version}: {len(tensors)} tensors verified")
    return 0
