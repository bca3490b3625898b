"""Data algorithms study: held-out accuracy against generated rollouts (the paper's figure).

Arms, each a real ``astraflow run`` (LocalRun: dataflow service, weight store, trainer,
rollout node, evaluator as processes) on the same workload and recipe, differing only in the
dataflow plug-ins (the shipped ``examples/data_*.yaml`` settings):

  baseline          shuffled prompts, FIFO batches
  greso             GRESO selector: skips prompts whose recent groups had zero reward variance
                    (before rollout)
  dynamic_sampling  filter dropping zero-variance groups (after rollout)
  replay            replay sampler: up to a quarter of each batch re-served from acked groups
                    up to 4 versions old (``replay_max_staleness``; at batch serving)
  greso_replay      GRESO + replay (the plug-ins compose)

Workload: the quickstart's task and tiny Qwen3 (``examples/data_greso.yaml``: single-digit sums,
char tokenizer, GRPO, batches of 128 = 16 prompts x 8 samples) on 128 training rows cycled
over, so prompts recur every few versions (GRESO's streaks and replay act on repeats). The
SFT warm-up's labels are right 50% of the time (the quickstart: 30%), so held-out accuracy
climbs within the step budget, through a phase with all-wrong groups to one with many
all-correct ones: what these algorithms act on. The warm-up runs once per seed, with the
trainer's own code, and every arm of that seed starts from its weights (``model.name_or_path``),
so no run spends its time warming up again. Every arm trains the same number of versions; the
evaluator scores each version greedily on 200 held-out rows of the ``add1`` eval split (a
different seed stream over the same 100 sums: there are no unseen single-digit sums).

Rollouts come from the dataflow's report (``report.jsonl`` the launcher writes every tick):
generated rollouts = tasks completed (``tasks.done``) x group size, read at the time each
evaluated version was published (the trainer's step record). The algorithms' own counters
are read from the final report (``plugins``: prompts skipped by GRESO, groups dropped by
dynamic sampling, groups replayed) with the samples dropped as stale.

Table per arm (mean and spread over seeds): rollouts to reach the baseline's final accuracy,
final accuracy, training time (version 1 to the last) and wall time (start-up and shutdown of
the run's processes included). Writes ``data_algorithms_study.png`` and ``.json``.

    .venv/bin/python benchmarks/data_algorithms_study.py                  # 5 arms x 2 seeds
    .venv/bin/python benchmarks/data_algorithms_study.py --seeds 0 1 2 --steps 80
    .venv/bin/python benchmarks/data_algorithms_study.py --quick          # 1 run: GRESO + replay
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
from warm_start import sft_init

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "examples" / "data_greso.yaml"
GREW = {"type": "greso", "easy_floor": 0.1, "hard_floor": 0.2}
REPLAY = {"type": "replay", "ratio": 0.25}
#: Training prompts (the source cycles over them: ``epochs: null``).
PROMPTS = 128
WARMUP_CORRECT = 0.5
ARMS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "greso": {"selector": GREW},
    "dynamic_sampling": {"filters": ["dynamic_sampling"]},
    "replay": {"sampler": REPLAY},
    "greso_replay": {"selector": GREW, "sampler": REPLAY},
}


def arm_config(
    arm: str, seed: int, run_dir: Path, steps: int, quick: bool, init: Path | None = None
) -> RunConfig:
    """The shared recipe with ``arm``'s plug-ins (from the warmed-up model ``init`` if given)."""
    raw: dict[str, Any] = yaml.safe_load(BASE.read_text())
    policy = raw["policies"]["policy"]
    policy["trainer"]["max_steps"] = steps
    # warm-up labels right 50% of the time (the quickstart: 30%; examples/solver_verifier.yaml's
    # solver: 50%), so GRPO lifts held-out accuracy within the step budget, through a phase
    # with all-wrong groups to one with many all-correct ones
    policy["warmup"]["generator"]["correct_prob"] = WARMUP_CORRECT
    if quick:
        policy["warmup"]["steps"] = 60
        policy["trainer"]["batch"] = {"min_samples": 64, "max_samples": 64, "take_timeout_s": 60}
    if init is not None:  # the seed's warm-up, done once: every arm starts from the same weights
        policy["model"] = {"name_or_path": str(init)}
        del policy["warmup"]
    if "sampler" in ARMS[arm]:
        # acked groups kept for the replay sampler, served up to 4 versions after they were made
        policy.update(retain_acked=256, replay_max_staleness=4)
    raw.update(run_dir=str(run_dir), seed=seed)
    source = raw["sources"][0]
    # the quickstart's task (single-digit sums) from a small row set, revisited every few
    # versions: GRESO's streaks and replay act on repeats
    source.update(name="sums", generator={"type": "add1", "size": PROMPTS})
    raw["dataflow"] = dict(ARMS[arm])
    # every 5th version where the evaluator keeps up (an idle machine trains 60 versions in
    # ~10 s: a time-based cadence alone gave 3 points a curve there, 12 at load 30)
    raw["eval"] = [{"policy": "policy", "every_s": 2 if quick else 1, "every_versions": 5,
                    "generator": {"type": "add1", "split": "eval",
                                  "size": 100 if quick else 200}}]  # fmt: skip
    return RunConfig.model_validate(raw)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_one(
    arm: str, seed: int, scratch: Path, steps: int, quick: bool, init: Path | None = None
) -> dict[str, Any]:
    """One run; its accuracy-vs-rollouts curve and the plug-ins' counters."""
    run_dir = scratch / f"{arm}-s{seed}"
    config = arm_config(arm, seed, run_dir, steps, quick, init)
    LocalRun(config, base_dir=BASE.parent).run()
    return read_run(arm, seed, run_dir, config.sources[0].group_size)


def read_run(arm: str, seed: int, run_dir: Path, group: int) -> dict[str, Any]:
    """A finished run's curve, counters and times, from its run directory."""
    summary = json.loads((run_dir / "summary.json").read_text())
    reports = _jsonl(run_dir / "report.jsonl")
    times = [r["time"] for r in reports]

    def rollouts_at(t: float) -> int:
        # the first report at or after ``t`` (reports come every tick, ~1 s: the one before
        # could miss the samples this version was trained on)
        i = min(bisect.bisect_left(times, t), len(reports) - 1)
        return 0 if i < 0 else int(reports[i]["tasks"]["done"]) * group

    # when each version was published (the trainer's step record), and the rollouts generated
    # by then according to the dataflow's report (to within one report tick)
    steps_done = _jsonl(run_dir / "trainers" / "policy" / "metrics.jsonl")
    published = {int(m["version"]): float(m["time"]) for m in steps_done}
    evals = sorted(_jsonl(run_dir / "eval" / "policy.jsonl"), key=lambda e: e["version"])
    curve = [{"version": e["version"], "accuracy": e["accuracy"],
              "rollouts": rollouts_at(published[e["version"]]) if e["version"] else 0}
             for e in evals if not e["version"] or e["version"] in published]  # fmt: skip
    final = reports[-1] if reports else {}
    return {
        "arm": arm, "seed": seed, "reason": summary["reason"],
        "wall_s": round(float(summary["elapsed_s"]), 1),
        # training time: version 1 to the last version (no start-up, warm-up or shutdown)
        "train_s": round(max(published.values()) - min(published.values()), 1)
        if published else 0.0,
        "curve": curve, "rollouts_total": int(final.get("tasks", {}).get("done", 0)) * group,
        "plugins": final.get("plugins", {}),
        "policy": final.get("policies", {}).get("policy", {}),
    }  # fmt: skip


def warm_start(seed: int, scratch: Path, quick: bool) -> Path:
    """The recipe's SFT warm-up for ``seed``, done once (``warm_start.sft_init``): every arm of
    the seed starts from these weights."""
    config = arm_config("baseline", seed, scratch / "warmup", 1, quick)
    policy = config.policies["policy"]
    return sft_init(policy.model, policy.warmup, seed, scratch / f"init-s{seed}")


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
    """Per arm: rollouts to reach the baseline's final accuracy (the baseline of the same seed:
    every arm of a seed starts from the same warm-up), start and final accuracy, times."""
    goal = {r["seed"]: _final(r["curve"]) for r in runs if r["arm"] == "baseline"}
    rows = []
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        reach = [rollouts_to_reach(r["curve"], goal[r["seed"]]) for r in mine if r["seed"] in goal]
        reached = [float(x) for x in reach if x is not None]
        rows.append({
            "arm": arm, "seeds": len(mine),
            "rollouts_to_baseline_final": _spread(reached),
            "reached": f"{len(reached)}/{len(reach)}",
            "start_accuracy": _spread([r["curve"][0]["accuracy"] for r in mine if r["curve"]]),
            "final_accuracy": _spread([_final(r["curve"]) for r in mine]),
            "rollouts_total": _spread([float(r["rollouts_total"]) for r in mine]),
            "train_s": _spread([r["train_s"] for r in mine]),
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
    stale = [float(r["policy"].get("stale_dropped_samples", 0)) for r in runs]
    if any(stale):
        parts.append(f"{statistics.fmean(stale):.0f} samples dropped stale")
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
    p.add_argument("--quick", action="store_true", help="one run (GRESO + replay), 1 seed, 6 steps")
    p.add_argument("--arms", default=None, help=f"comma list of {','.join(ARMS)}")
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--steps", type=int, default=None, help="trainer versions per run")
    p.add_argument("--out", default="data_algorithms_study", help="output stem (.png, .json)")
    p.add_argument(
        "--scratch",
        default=None,
        help="keep run directories here (finished ones there are read, not rerun)",
    )
    args = p.parse_args(argv)
    arms = (args.arms or ("greso_replay" if args.quick else ",".join(ARMS))).split(",")
    if unknown := set(arms) - set(ARMS):
        p.error(f"unknown arms {sorted(unknown)}; choose from {list(ARMS)}")
    seeds = args.seeds or ([0] if args.quick else [0, 1])
    steps = args.steps or (6 if args.quick else 60)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(args.scratch or tmp)
        for seed in seeds:
            init = scratch / f"init-s{seed}"
            for arm in arms:
                if (scratch / f"{arm}-s{seed}" / "summary.json").is_file():  # kept: read it
                    group = arm_config(arm, seed, scratch, steps, args.quick).sources[0].group_size
                    runs.append(read_run(arm, seed, scratch / f"{arm}-s{seed}", group))
                    continue
                if not (init / "config.json").is_file():
                    started = time.monotonic()
                    warm_start(seed, scratch, args.quick)
                    print(f"seed {seed}: warm-up {time.monotonic() - started:.0f} s", flush=True)
                run = run_one(arm, seed, scratch, steps, args.quick, init)
                runs.append(run)
                last = run["curve"][-1] if run["curve"] else {}
                print(
                    f"{arm:<17} seed {seed}: {run['reason']}, {run['wall_s']:.0f} s "
                    f"({run['train_s']:.0f} s training), "
                    f"{run['rollouts_total']} rollouts, last eval {last}",
                    flush=True,
                )
    rows = table(runs, arms)
    cols = ("arm", "seeds", "rollouts_to_baseline_final", "reached", "start_accuracy",
            "final_accuracy",
            "rollouts_total", "train_s", "wall_s", "effect")  # fmt: skip
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
