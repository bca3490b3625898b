"""``astraflow export``: a published version of a policy as a Hugging Face model folder."""

from __future__ import annotations

import argparse

from astraflow.cli.options import init_logging
from astraflow.observability import LOG_LEVELS


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``export`` subcommand."""
    parser = sub.add_parser(
        "export",
        help="write a trained version of a policy as a Hugging Face model folder",
        description="Export a version of a policy from a run's weight store as a folder that "
        "transformers (AutoModelForCausalLM / AutoTokenizer.from_pretrained) and vLLM load: "
        "model.safetensors in the published dtype, config.json, generation_config.json and "
        "the tokenizer files. Example: astraflow export --run-dir runs/quickstart --out "
        "exported/quickstart",
    )
    parser.add_argument("--run-dir", metavar="DIR", required=True, help="the run's directory")
    parser.add_argument("--policy", help="policy to export (default: the run's only policy)")
    parser.add_argument(
        "--version", type=int, metavar="N", help="version to export (default: the newest kept)"
    )
    parser.add_argument("--out", metavar="DIR", required=True, help="folder to write")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out folder")
    parser.add_argument(
        "--push-to-hub",
        metavar="REPO",
        help="also upload the folder to this Hugging Face Hub repo (needs the network and "
        "HF_TOKEN; created private if it does not exist)",
    )
    parser.add_argument(
        "--log-level", default="WARNING", choices=LOG_LEVELS, help="logging level (default WARNING)"
    )
    parser.add_argument(
        "--log-format", default="text", choices=("text", "json"), help="log line format"
    )
    parser.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    init_logging(args, "export")
    from astraflow.cli.bars import show_progress
    from astraflow.export import export_version, push_to_hub
    from astraflow.launch.rundir import RunDir

    run = RunDir(args.run_dir)
    policy = run.policy(args.policy)
    version = run.version(policy, args.version)
    with show_progress():
        done = export_version(run.weights, policy, version, args.out, overwrite=args.force)
    print(f"exported {policy} v{version} ({done.dtype}) to {done.out}: {', '.join(done.files)}")
    if args.push_to_hub:
        url = push_to_hub(done.out, args.push_to_hub)
        print(f"pushed to {url}")
    return 0
