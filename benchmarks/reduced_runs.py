"""Wall time of the reduced example runs the e2e tests make, against their CI budgets.

The e2e tests assert what the runs learn, not how long they take (a loaded CI machine is no
failure of the code). The time is measured here: the reduced quickstart (250 versions, CI
budget 3 minutes) and the shortened solver/verifier example (100 versions of each policy,
budget 4 minutes for the whole run). Printed: seconds, versions trained, versions per second
of run time (the in-run figure to compare between machines), and the budget.

    .venv/bin/python benchmarks/reduced_runs.py                 # both runs
    .venv/bin/python benchmarks/reduced_runs.py --only quickstart
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from astraflow.config import load_config
from astraflow.launch.config import RunConfig
from astraflow.launch.local import LocalRun

ROOT = Path(__file__).resolve().parents[1]
RUNS = {
    # name: (example, overrides, CI budget in seconds)
    "quickstart": (
        "quickstart.yaml",
        ["policies.policy.trainer.max_steps=250", "eval.0.every_s=3"],
        180.0,
    ),
    "solver_verifier": (
        "solver_verifier.yaml",
        [
            "policies.solver.trainer.max_steps=100",
            "policies.verifier.trainer.max_steps=100",
            "eval.0.every_s=3",
            "eval.1.every_s=3",
        ],
        240.0,
    ),
}


def measure(name: str, scratch: Path) -> dict[str, float | str]:
    """Run one reduced example; its wall time and trained versions."""
    example, overrides, budget = RUNS[name]
    path = ROOT / "examples" / example
    run_dir = scratch / name
    config = load_config(RunConfig, path, [f"run_dir={run_dir}", *overrides])
    started = time.monotonic()
    result = LocalRun(config, base_dir=path.parent).run()
    elapsed = time.monotonic() - started
    versions = 0
    for policy in config.trained:
        metrics = run_dir / "trainers" / policy / "metrics.jsonl"
        versions += sum(1 for line in metrics.read_text().splitlines() if line.strip())
    return {
        "run": name,
        "reason": result.reason,
        "seconds": round(elapsed, 1),
        "versions": versions,
        "versions_per_s": round(versions / elapsed, 2),
        "budget_s": budget,
        "within_budget": str(elapsed < budget),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(RUNS), help="run one example only")
    args = parser.parse_args()
    names = [args.only] if args.only else list(RUNS)
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            print(json.dumps(measure(name, Path(scratch))), flush=True)


if __name__ == "__main__":
    main()
