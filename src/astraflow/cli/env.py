"""``astraflow env``: serve a registered environment over HTTP, list the registered ones."""

from __future__ import annotations

import argparse

from astraflow.cli.options import add_common, init_logging


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``env`` subcommand (``serve``, ``ls``)."""
    parser = sub.add_parser("env", help="agent environments (serve one over HTTP, list them)")
    actions = parser.add_subparsers(dest="action", metavar="<action>", required=True)
    serve = actions.add_parser(
        "serve",
        help="serve an environment on the OpenEnv wire (POST /reset, /step; GET /state, /health)",
        description="Serve any registered environment over HTTP, one session per episode. "
        "Environment arguments go in --config (a YAML file of EnvServerConfig: env, host, "
        "port, max_sessions, idle_timeout_s ...) or --set env.KEY=VALUE. The bearer token "
        "comes from $ASTRAFLOW_ENV_TOKEN (unset: no auth). Example: astraflow env serve "
        "--env gridnav --set env.width=7 --port 8300",
    )
    add_common(serve)
    serve.add_argument("--env", help="environment: registry name or package.module:Class")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to bind (default 8300)")
    serve.set_defaults(func=_serve)
    ls = actions.add_parser("ls", help="list the registered environments")
    ls.set_defaults(func=_ls)


def _serve(args: argparse.Namespace) -> int:
    from astraflow.config import apply_overrides, read_yaml, validate
    from astraflow.envs.server import EnvServerConfig, serve
    from astraflow.errors import ConfigError

    init_logging(args, "env")
    data = read_yaml(args.config) if args.config else {}
    if args.env:
        env = data.get("env")
        data["env"] = {**(env if isinstance(env, dict) else {}), "type": args.env}
    for key in ("host", "port"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    data = apply_overrides(data, args.overrides)
    if "env" not in data:
        raise ConfigError("astraflow env serve needs --env NAME (or env: in --config)")
    serve(validate(EnvServerConfig, data, source="env server"))
    return 0


def _ls(args: argparse.Namespace) -> int:
    from astraflow.envs import ENVS

    for name in ENVS.names():
        print(name)
    return 0
