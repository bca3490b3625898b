"""Data algorithms study: held-out accuracy against generated rollouts (the paper's figure).

Arms, each a real ``astraflow run`` (LocalRun: dataflow service, weight store, trainer,
rollout node, evaluator as processes) on the same workload and recipe, differing only in the
dataflow plug-ins (the shipped ``examples/data_*.yaml`` settings):

  baseline          shuffled prompts, FIFO batches
  greso             GRESO selector: skips prompts whose recent groups had zero reward variance
                    (before rollout)
  dynamic_sampling  filter dropping zero-variance groups (after rollout)
  replay            replay sampler: a quarter of each batch re-served from acked groups
                    (at batch serving)
  greso_replay      GRESO + replay (the plug-ins compose)

Workload: ``examples/data_greso.yaml``'s tiny Qwen3 (char tokenizer, warmed up to ~30% on
single-digit sums) trained with GRPO on 256 prompts of 1-2 digit sums (the ``arithmetic``
generator, as in ``examples/data_curriculum.yaml``, cycled over): single-digit sums get solved
(all-correct groups), two-digit ones mostly fail (all-wrong groups), which is what these
algorithms act on. Every arm trains the
same number of versions; the evaluator scores each version on 200 held-out sums (greedy).

Rollouts come from the dataflow's report (``report.jsonl`` the launcher writes every tick):
generated rollouts = tasks completed (``tasks.done``) x group size, read at the time each
evaluated version was published. The algorithms' own counters are read from the final report
(``plugins``: prompts skipped by GRESO, groups dropped by dynamic sampling, groups replayed).

Table per arm (mean and spread over seeds): rollouts to reach the baseline's final accuracy,
final accuracy, wall time. Writes ``data_algorithms_study.png`` and ``.json``.

    .venv/bin/python benchmarks/data_algorithms_study.py                  # 5 arms x 2 seeds
    .venv/bin/python benchmarks/data_algorithms_study.py --seeds 0 1 2 --steps 80
    .venv/bin/python benchmarks/data_algorithms_study.py --quick          # 2 arms, 1 seed
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from astraflow.launch.config import RunConfig
from astraflow.launch.local import LocalRun

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "examples" / "data_greso.yaml"
GREW = {"type": "greso", "easy_floor": 0.1, "hard_floor": 0.2}
REPLAY = {"type": "replay", "ratio": 0.25}
#: Training prompts (the source cycles over them: ``epochs: null``).
PROMPTS = 256
ARMS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "greso": {"selector": GREW},
    "dynamic_sampling": {"filters": ["dynamic_sampling"]},
    "replay": {"sampler": REPLAY},
    "greso_replay": {"selector": GREW, "sampler": REPLAY},
}


def arm_config(arm: str, seed: int, run_dir: Path, steps: int, quick: bool) -> RunConfig:
    """The shared recipe with ``arm``'s plug-ins."""
    raw: dict[str, Any] = yaml.safe_load(BASE.read_text())
    policy = raw["policies"]["policy"]
    policy["trainer"]["max_steps"] = steps
    if "sampler" in ARMS[arm]:
        policy["retain_acked"] = 256  # acked groups kept for the replay sampler
    raw.update(run_dir=str(run_dir), seed=seed)
    source = raw["sources"][0]
    # a small prompt set, revisited every few dozen versions: GRESO and replay act on repeats
    source.update(name="sums", generator={"type": "arithmetic", "min_digits": 1,
                                          "max_digits": 2, "size": PROMPTS})  # fmt: skip
    raw["workflows"]["rlvr"]["sampling"]["max_new_tokens"] = 4
    raw["dataflow"] = dict(ARMS[arm])
    raw["eval"] = [{"policy": "policy", "every_s": 2 if quick else 4,
                    "generator": {"type": "arithmetic", "min_digits": 1, "max_digits": 2,
                                  "split": "eval", "size": 100 if quick else 200}}]  # fmt: skip
    if quick:
        policy["warmup"]["steps"] = 60
        policy["trainer"]["batch"] = {"min_samples": 64, "max_samples": 64, "take_timeout_s": 60}
    return RunConfig.model_validate(raw)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_one(arm: str, seed: int, scratch: Path, steps: int, quick: bool) -> dict[str, Any]:
    """One run; its accuracy-vs-rollouts curve and the plug-ins' counters."""
    run_dir = scratch / f"{arm}-s{seed}"
    config = arm_config(arm, seed, run_dir, steps, quick)
    group = config.sources[0].group_size
    started = time.monotonic()
    result = LocalRun(config, base_dir=BASE.parent).run()
    wall = time.monotonic() - started
    reports = _jsonl(run_dir / "report.jsonl")
    times = [r["time"] for r in reports]

    def rollouts_at(t: float) -> int:
        i = bisect.bisect_right(times, t) - 1
        return 0 if i < 0 else int(reports[i]["tasks"]["done"]) * group

    evals = sorted(_jsonl(run_dir / "eval" / "policy.jsonl"), key=lambda e: e["version"])
    curve = [{"version": e["version"], "accuracy": e["accuracy"],
              "rollouts": rollouts_at(e["created_at"])} for e in evals]  # fmt: skip
    final = reports[-1] if reports else {}
    return {
        "arm": arm, "seed": seed, "reason": result.reason, "wall_s": round(wall, 1),
        "curve": curve, "rollouts_total": int(final.get("tasks", {}).get("done", 0)) * group,
        "plugins": final.get("plugins", {}),
        "policy": final.get("policies", {}).get("policy", {}),
    }  # fmt: skip


def rollouts_to_reach(curve: list[dict[str, Any]], accuracy: float) -> int | None:
    """Rollouts generated when a version first scored at least ``accuracy`` (None: never)."""
    for point in curve:
        if point["accuracy"] >= accuracy - 1e-9:
            return int(point["rollouts"])
    return None


def _final(curve: list[dict[str, Any]]) -> float:
    """Final accuracy: mean of the last two evaluated versions (one eval is noisy)."""
    tail = [p["accuracy"] for p in curve[-2:]]
    return statistics.fmean(tail) if tail else 0.0


def _spread(xs: list[float]) -> str:
    if not xs:
        return "-"
    m = statistics.fmean(xs)
    return f"{m:.3g}" if len(xs) == 1 else f"{m:.3g} ± {statistics.pstdev(xs):.2g}"


def table(runs: list[dict[str, Any]], arms: list[str]) -> list[dict[str, Any]]:
    """Per arm: rollouts to reach baseline's final accuracy, final accuracy, wall time."""
    base = [_final(r["curve"]) for r in runs if r["arm"] == "baseline"]
    goal = statistics.fmean(base) if base else None
    rows = []
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        reach = [rollouts_to_reach(r["curve"], goal) for r in mine] if goal is not None else []
        reached = [float(x) for x in reach if x is not None]
        rows.append({
            "arm": arm, "seeds": len(mine),
            "rollouts_to_baseline_final": _spread(reached),
            "reached": f"{len(reached)}/{len(mine)}",
            "final_accuracy": _spread([_final(r["curve"]) for r in mine]),
            "rollouts_total": _spread([float(r["rollouts_total"]) for r in mine]),
            "wall_s": _spread([r["wall_s"] for r in mine]),
            "effect": _effect(mine),
        })  # fmt: skip
    return rows


def _effect(runs: list[dict[str, Any]]) -> str:
    """What the arm's plug-ins did, from the report's counters (mean over seeds)."""
    keys = {"selector": ("skipped", "prompts skipped"), "filter.0": ("dropped", "groups dropped"),
            "sampler": ("replayed_groups", "groups replayed")}  # fmt: skip
    parts = []
    for place, (key, text) in keys.items():
        vals = [r["plugins"].get(place, {}).get(key) for r in runs]
        got = [float(v) for v in vals if v is not None]
        if got:
            parts.append(f"{statistics.fmean(got):.0f} {text}")
    return ", ".join(parts) or "-"


def plot(runs: list[dict[str, Any]], arms: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, arm in enumerate(arms):
        for j, run in enumerate(r for r in runs if r["arm"] == arm):
            xs = [p["rollouts"] for p in run["curve"]]
            ys = [p["accuracy"] for p in run["curve"]]
            ax.plot(xs, ys, color=colors[i % len(colors)], alpha=0.85, lw=1.2,
                    ls=("-", "--", ":")[j % 3], label=arm if j == 0 else None)  # fmt: skip
    ax.set_xlabel("generated rollouts (dataflow report: tasks done x group size)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title("accuracy vs generated rollouts (line style: seed)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="baseline and greso, 1 seed, 8 steps")
    p.add_argument("--arms", default=None, help=f"comma list of {','.join(ARMS)}")
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--steps", type=int, default=None, help="trainer versions per run")
    p.add_argument("--out", default="data_algorithms_study", help="output stem (.png, .json)")
    p.add_argument("--scratch", default=None, help="keep run directories here")
    args = p.parse_args(argv)
    arms = (args.arms or ("baseline,greso" if args.quick else ",".join(ARMS))).split(",")
    if unknown := set(arms) - set(ARMS):
        p.error(f"unknown arms {sorted(unknown)}; choose from {list(ARMS)}")
    seeds = args.seeds or ([0] if args.quick else [0, 1])
    steps = args.steps or (8 if args.quick else 80)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(args.scratch or tmp)
        for seed in seeds:
            for arm in arms:
                run = run_one(arm, seed, scratch, steps, args.quick)
                runs.append(run)
                last = run["curve"][-1] if run["curve"] else {}
                print(
                    f"{arm:<17} seed {seed}: {run['reason']}, {run['wall_s']:.0f} s, "
                    f"{run['rollouts_total']} rollouts, last eval {last}",
                    flush=True,
                )
    rows = table(runs, arms)
    cols = ("arm", "seeds", "rollouts_to_baseline_final", "reached", "final_accuracy",
            "rollouts_total", "wall_s", "effect")  # fmt: skip
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(
        {"steps": steps, "seeds": seeds, "table": rows, "runs": runs}, indent=1))  # fmt: skip
    plot(runs, arms, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.png')} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
