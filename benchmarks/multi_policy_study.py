"""Multi- vs single-policy study: solver+verifier against the solver alone, same budget.

Arms, each a real ``astraflow run`` of ``examples/solver_verifier.yaml`` (tiny Qwen3s, 1-digit
sums, GRPO), shortened to ``--steps`` solver versions and capped at the same ``--max-time-s``:

  solver_verifier  the example as shipped: the workflow calls the solver, then the verifier
                   judges the answer; both policies are trained
  solver_alone     the same solver (model, warm-up, recipe, sampling, group size), trained with
                   the single-policy ``rlvr`` workflow on the same task; no verifier

Same budget: the same number of solver versions (each one batch of 128 solver samples) and
the same wall-clock cap. The solver's generated rollouts are read from the dataflow report
(``tasks.done`` x group size) and printed, so the rollout budgets can be compared.

Inference, after each run, on 200 held-out sums, from the final weights in the run's store:
  greedy           the solver's greedy answer (what the run's evaluator scores)
  majority@k       k sampled answers (temperature 1), the most frequent one
  verified@k       (solver_verifier only) the same k answers, each judged greedily by the final
                   verifier ("{question}{answer}?" -> yes/no); majority over those judged
                   "yes", plain majority when none is
Writes ``multi_policy_study.json`` and ``.png`` (accuracy per arm and inference rule).

    .venv/bin/python benchmarks/multi_policy_study.py                    # 2 seeds, 150 versions
    .venv/bin/python benchmarks/multi_policy_study.py --quick            # smoke: 1 run, 3 versions
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from astraflow.launch.config import RunConfig
from astraflow.launch.local import LocalRun
from final_policy import FinalPolicy
from study_output import write_summary

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "examples" / "solver_verifier.yaml"
ARMS = ("solver_verifier", "solver_alone")


def arm_config(arm: str, seed: int, run_dir: Path, args: argparse.Namespace) -> RunConfig:
    raw: dict[str, Any] = yaml.safe_load(BASE.read_text())
    raw.update(run_dir=str(run_dir), seed=seed, max_time_s=args.max_time_s)
    for policy in raw["policies"].values():
        policy["trainer"]["max_steps"] = args.steps
        policy["trainer"].pop("checkpoint", None)
        if args.quick:
            policy["warmup"]["steps"] = 40
            policy["trainer"]["batch"] = {"min_samples": 64, "max_samples": 64,
                                          "take_timeout_s": 60}  # fmt: skip
    for ev in raw["eval"]:
        ev["every_s"] = 5
    if arm == "solver_alone":
        del raw["policies"]["verifier"]
        raw["sources"][0].update(workflow="solo", policies=["solver"])
        raw["workflows"] = {
            "solo": {"type": "rlvr", "policy": "solver", "reward": "synthetic_exact",
                     "sampling": raw["workflows"]["solver_verifier"]["solver_sampling"]},
            "solver_eval": raw["workflows"]["solver_eval"],
        }  # fmt: skip
        raw["eval"] = [e for e in raw["eval"] if e["policy"] == "solver"]
    return RunConfig.model_validate(raw)


def _complete(policy: FinalPolicy, prompts: list[str], max_new: int, samples: int = 1
              ) -> list[list[str]]:  # fmt: skip
    """The policy's completions of templated prompts, stripped."""
    completions = policy.complete(prompts, max_new, samples, templated=True)
    return [[text.strip() for text in texts] for texts in completions]


def inference(run_dir: Path, verifier: bool, k: int, n: int, seed: int) -> dict[str, float]:
    """Greedy, majority@k and (with a verifier) verifier-filtered majority@k accuracy."""
    import torch

    from astraflow.workflows.tasks import GENERATORS

    torch.manual_seed(seed)
    rows = list(GENERATORS.build({"type": "add1", "split": "eval", "size": n}, seed=0).rows())
    prompts = [r["prompt"] for r in rows]
    solver = FinalPolicy(run_dir / "weights", "solver")
    greedy = [c[0] for c in _complete(solver, prompts, 3)]
    sampled = _complete(solver, prompts, 3, samples=k)
    out = {
        "greedy": _acc(greedy, rows),
        f"majority@{k}": _acc([Counter(c).most_common(1)[0][0] for c in sampled], rows),
    }
    if verifier:
        judge = FinalPolicy(run_dir / "weights", "verifier")
        asks = [f"{p}{a}?" for p, cands in zip(prompts, sampled, strict=True) for a in cands]
        verdicts = [c[0].startswith("yes") for c in _complete(judge, asks, 4)]
        votes = []
        for i, cands in enumerate(sampled):
            kept = [a for j, a in enumerate(cands) if verdicts[i * k + j]]
            votes.append(Counter(kept or cands).most_common(1)[0][0])
        out[f"verified@{k}"] = _acc(votes, rows)
        out["judged_yes"] = sum(verdicts) / len(verdicts)
    return out


def _acc(answers: list[str], rows: list[dict[str, Any]]) -> float:
    return sum(a == r["answer"] for a, r in zip(answers, rows, strict=True)) / len(rows)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_one(arm: str, seed: int, scratch: Path, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = scratch / f"{arm}-s{seed}"
    config = arm_config(arm, seed, run_dir, args)
    started = time.monotonic()
    result = LocalRun(config, base_dir=BASE.parent).run()
    wall = time.monotonic() - started
    reports = _jsonl(run_dir / "report.jsonl")
    group = config.sources[0].group_size
    evals = _jsonl(run_dir / "eval" / "solver.jsonl")
    return {
        "arm": arm, "seed": seed, "reason": result.reason, "wall_s": round(wall, 1),
        "solver_rollouts": int(reports[-1]["tasks"]["done"]) * group if reports else 0,
        "solver_versions": max((e["version"] for e in evals), default=0),
        "eval_curve": [(e["version"], e["accuracy"]) for e in evals],
        "inference": inference(run_dir, arm == "solver_verifier", args.k, args.n, seed),
    }  # fmt: skip


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        if not mine:
            continue
        row: dict[str, Any] = {"arm": arm, "seeds": len(mine)}
        for key in mine[0]["inference"]:
            xs = [r["inference"][key] for r in mine]
            sd = statistics.pstdev(xs) if len(xs) > 1 else 0.0
            row[key] = f"{statistics.fmean(xs):.3f} ± {sd:.3f}"
        for key in ("solver_rollouts", "solver_versions", "wall_s"):
            row[key] = f"{statistics.fmean(float(r[key]) for r in mine):.0f}"
        rows.append(row)
    return rows


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k for r in runs for k in r["inference"] if k != "judged_yes"})
    fig, ax = plt.subplots(figsize=(7, 4))
    arms = [a for a in ARMS if any(r["arm"] == a for r in runs)]
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        mine = [r for r in runs if r["arm"] == arm]
        means = [statistics.fmean(r["inference"].get(k, float("nan")) for r in mine)
                 for k in keys]  # fmt: skip
        ax.bar([j + i * width for j in range(len(keys))], means, width, label=arm)
        for j, k in enumerate(keys):
            ax.scatter([j + i * width] * len(mine), [r["inference"].get(k) for r in mine],
                       color="black", s=8, zorder=3)  # fmt: skip
    ax.set_xticks([j + width / 2 for j in range(len(keys))], keys)
    ax.set_ylabel("held-out solver accuracy")
    ax.set_title("solver+verifier vs solver alone (dots: seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="solver+verifier only, 1 seed, 3 versions, 30 prompts, k=4")  # fmt: skip
    p.add_argument("--arms", default=None, help=f"comma list of {','.join(ARMS)}")
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--steps", type=int, default=None, help="solver versions per run")
    p.add_argument("--max-time-s", type=float, default=None, help="wall cap per run")
    p.add_argument("--k", type=int, default=None, help="answers sampled per prompt (8)")
    p.add_argument("--n", type=int, default=None, help="held-out prompts")
    p.add_argument("--out", default="multi_policy_study", help="output stem (.png, .json)")
    p.add_argument("--scratch", default=None, help="keep run directories here")
    args = p.parse_args(argv)
    args.steps = args.steps or (3 if args.quick else 150)
    args.max_time_s = args.max_time_s or (240.0 if args.quick else 900.0)
    args.n = args.n or (30 if args.quick else 200)
    args.k = args.k or (4 if args.quick else 8)
    arms = (args.arms or ("solver_verifier" if args.quick else ",".join(ARMS))).split(",")
    if unknown := set(arms) - set(ARMS):
        p.error(f"unknown arms {sorted(unknown)}; choose from {list(ARMS)}")
    seeds = args.seeds or ([0] if args.quick else [0, 1])
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(args.scratch or tmp)
        for seed in seeds:
            for arm in arms:
                runs.append(run_one(arm, seed, scratch, args))
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "eval_curve"}),
                      flush=True)  # fmt: skip
    rows = summarize(runs)
    out = Path(args.out)
    write_summary(out, args, rows, runs)
    plot(runs, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.png')} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
