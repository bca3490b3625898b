"""Code workflows study: solver alone vs solver+selector vs solver+test-case generator.

Arms, each a real ``astraflow run`` (LocalRun: dataflow service, weight store, trainers,
rollout node, evaluator as processes) of a shipped recipe, shortened to ``--steps`` versions
per policy and capped at ``--max-time-s``:

  solver           examples/code_solver.yaml: the solver trained alone (``rlvr``)
  solver_selector  examples/code_solver_selector.yaml: ``solver_selector``; a selector picks
                   one of the solver's 8 candidates, both trained
  solver_testgen   examples/code_solver_testgen.yaml: ``solver_testgen``; a test writer
                   writes asserts that the sandbox checks, both trained

Task: the ``pyfunc`` generator (one-line Python functions from a spec such as
``# times 3 plus 5``, hidden asserts run in the code sandbox), a tiny char-level Qwen3 per
policy, warmed up by SFT on noisy labels, then GRPO. Same solver (model, warm-up, sampling,
group of 8, 64 samples a version) in every arm; all arms stop at the same number of solver
versions.

After each run, from the final weights in its store, on the 38 held-out specs (never trained
on), every program judged by the hidden tests in the sandbox:
  greedy         the solver's greedy program (pass@1; the run's evaluator curve is the same
                 number at every version, on a sample of the held-out specs)
  sampled        the mean pass rate of k programs sampled at temperature 1, and pass@k
  majority@k     the most frequent of the k programs (a selection rule without a second model)
  selected@k     (solver_selector) the selector's greedy pick among the same k programs
  tested@k       (solver_testgen) m test sets sampled from the test writer; the program that
                 passes most of them wins (ties: the most frequent); the share of the test sets
                 that assert something and hold on the reference is reported as ``valid_tests``
Writes ``code_workflows_study.json`` and ``.png`` (learning curves and held-out pass rates).

    .venv/bin/python benchmarks/code_workflows_study.py              # 3 arms x 2 seeds
    .venv/bin/python benchmarks/code_workflows_study.py --quick      # 3 arms, 1 seed, 2 versions
    .venv/bin/python benchmarks/code_workflows_study.py --merge a.json b.json   # seeds run apart
"""

from __future__ import annotations

import argparse
import asyncio
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
from warm_start import sft_init

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "solver": ROOT / "examples" / "code_solver.yaml",
    "solver_selector": ROOT / "examples" / "code_solver_selector.yaml",
    "solver_testgen": ROOT / "examples" / "code_solver_testgen.yaml",
}
ARMS = tuple(RECIPES)
SECOND = {"solver_selector": "selector", "solver_testgen": "testgen"}


def arm_config(
    arm: str, seed: int, run_dir: Path, args: argparse.Namespace, init: Path | None = None
) -> RunConfig:
    """The arm's shipped recipe, shortened to ``args.steps`` versions per policy (the solver
    starting from the warmed-up model ``init`` if given)."""
    raw: dict[str, Any] = yaml.safe_load(RECIPES[arm].read_text())
    raw.update(run_dir=str(run_dir), seed=seed, max_time_s=args.max_time_s)
    for policy in raw["policies"].values():
        policy["trainer"]["max_steps"] = args.steps
        if args.warmup_steps is not None:
            policy["warmup"]["steps"] = args.warmup_steps
    if init is not None:  # the seed's solver warm-up, done once: every arm starts from it
        solver = raw["policies"]["solver"]
        solver["model"] = {"name_or_path": str(init)}
        del solver["warmup"]
    for ev in raw["eval"]:
        ev["every_s"] = args.eval_every_s
    return RunConfig.model_validate(raw)


def held_out() -> list[dict[str, Any]]:
    """Every held-out spec once (the eval split of ``pyfunc``, deduplicated)."""
    from astraflow.workflows.tasks import GENERATORS

    rows = GENERATORS.build({"type": "pyfunc", "split": "eval", "size": 3000}, seed=0).rows()
    return sorted({r["prompt"]: r for r in rows}.values(), key=lambda r: r["prompt"])


def inference(run_dir: Path, arm: str, config: RunConfig, args: argparse.Namespace,
              seed: int) -> dict[str, float]:  # fmt: skip
    """Held-out pass rates of the final solver, alone and with the arm's second policy."""
    import torch

    from astraflow.workflows.code import (
        count_asserts,
        extract_code,
        reference_program,
        solution_program,
        with_reference_tests,
    )
    from astraflow.workflows.prompts import fill
    from astraflow.workflows.sandbox import Sandbox, SandboxConfig

    torch.manual_seed(seed)
    rows = held_out()
    prompts = [r["prompt"] for r in rows]
    solver = FinalPolicy(run_dir / "weights", "solver")
    greedy = [c[0] for c in solver.complete(prompts, 12)]
    sampled = solver.complete(prompts, 12, samples=args.k)
    sandbox = Sandbox(SandboxConfig(time_limit_s=5, cache_size=1 << 16))

    async def passes(programs: list[str]) -> list[bool]:
        return [r.passed for r in await asyncio.gather(*(sandbox.run(p) for p in programs))]

    def judged(answers: list[str]) -> list[bool]:
        programs = [with_reference_tests(r, solution_program(r, a))
                    for r, a in zip(rows, answers, strict=True)]  # fmt: skip
        return asyncio.run(passes(programs))

    per_sample = [judged([c[j] for c in sampled]) for j in range(args.k)]
    out = {
        "greedy": _mean(judged(greedy)),
        "sampled": _mean([ok for col in per_sample for ok in col]),
        f"pass@{args.k}": _mean([any(col[i] for col in per_sample) for i in range(len(rows))]),
        f"majority@{args.k}": _mean(judged([Counter(c).most_common(1)[0][0] for c in sampled])),
    }
    workflow = config.workflows[arm].kwargs if arm in SECOND else {}
    if arm == "solver_selector":
        selector = FinalPolicy(run_dir / "weights", "selector")
        template = workflow["selector_template"]
        asks = [fill(template, {"question": r["prompt"], "candidates": "\n".join(
                    f"({i + 1}) {a.strip()}" for i, a in enumerate(cands))})
                for r, cands in zip(rows, sampled, strict=True)]  # fmt: skip
        picks = [_choice(c[0], args.k) for c in selector.complete(asks, 2)]
        out["parsed_picks"] = _mean([p is not None for p in picks])
        out[f"selected@{args.k}"] = _mean([
            p is not None and per_sample[p][i] for i, p in enumerate(picks)])  # fmt: skip
    if arm == "solver_testgen":
        writer = FinalPolicy(run_dir / "weights", "testgen")
        template = workflow["testgen_template"]
        tests = writer.complete([fill(template, r) for r in rows], 32, samples=args.m)
        valid = asyncio.run(passes([f"{reference_program(r)}\n\n{extract_code(t)}\n"
                                    for r, ts in zip(rows, tests, strict=True)
                                    for t in ts]))  # fmt: skip
        asserts = [count_asserts(extract_code(t)) > 0 for ts in tests for t in ts]
        out["valid_tests"] = _mean([a and v for a, v in zip(asserts, valid, strict=True)])
        chosen = []
        for i, (row, cands, ts) in enumerate(zip(rows, sampled, tests, strict=True)):
            unique = list(dict.fromkeys(cands))
            progs = [f"{solution_program(row, a)}\n\n{extract_code(t)}\n"
                     for a in unique for t in ts]  # fmt: skip
            ok = asyncio.run(passes(progs))
            score = {a: sum(ok[j * len(ts) : (j + 1) * len(ts)]) for j, a in enumerate(unique)}
            count = Counter(cands)
            best = max(unique, key=lambda a: (score[a], count[a]))
            chosen.append(per_sample[cands.index(best)][i])
        out[f"tested@{args.k}"] = _mean(chosen)
    return out


def _choice(text: str, n: int) -> int | None:
    from astraflow.workflows.prompts import parse_choice

    return parse_choice(text, n)


def _mean(xs: list[bool] | list[float]) -> float:
    return round(statistics.fmean(float(x) for x in xs), 4) if xs else 0.0


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def solver_init(seed: int, scratch: Path, args: argparse.Namespace) -> Path:
    """The solver's SFT warm-up for ``seed`` (the recipes share it), done once per seed."""
    solver = arm_config("solver", seed, scratch / "warmup", args).policies["solver"]
    assert solver.warmup is not None, "the solver recipe has no warm-up"
    out = scratch / f"init-solver-s{seed}-w{solver.warmup.steps}"
    if (out / "config.json").is_file():  # this seed's warm-up, done by an earlier invocation
        return out
    started = time.monotonic()
    sft_init(solver.model, solver.warmup, seed, out)
    print(f"seed {seed}: solver warm-up {time.monotonic() - started:.0f} s", flush=True)
    return out


def run_one(
    arm: str, seed: int, scratch: Path, args: argparse.Namespace, init: Path | None = None
) -> dict[str, Any]:
    """One run of ``arm``, then the held-out inference on its final weights."""
    run_dir = scratch / f"{arm}-s{seed}"
    config = arm_config(arm, seed, run_dir, args, init)
    done = run_dir / "study_run.json"
    if args.reuse and done.is_file():  # the run finished before: its inference only
        record = json.loads(done.read_text())
    else:
        started = time.monotonic()
        result = LocalRun(config, base_dir=RECIPES[arm].parent).run()
        wall = time.monotonic() - started
        reports = _jsonl(run_dir / "report.jsonl")
        evals = sorted(_jsonl(run_dir / "eval" / "solver.jsonl"), key=lambda e: e["version"])
        final = reports[-1] if reports else {}
        group = config.sources[0].group_size
        record = {
            "arm": arm, "seed": seed, "reason": result.reason, "wall_s": round(wall, 1),
            "solver_rollouts": int(final.get("tasks", {}).get("done", 0)) * group,
            "solver_versions": max((e["version"] for e in evals), default=0),
            "eval_curve": [(e["version"], e["accuracy"]) for e in evals],
        }  # fmt: skip
        done.write_text(json.dumps(record))
    record["inference"] = inference(run_dir, arm, config, args, seed)
    return record


def _spread(xs: list[float]) -> str:
    sd = statistics.pstdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):.3f} ± {sd:.3f}"


def _at(curve: list[list[float]], version: int) -> float | None:
    """The evaluator's accuracy at the last evaluated version <= ``version`` (None: the run
    did not get that far)."""
    if not curve or curve[-1][0] < version:
        return None
    return [a for v, a in curve if v <= version][-1]


def summarize(runs: list[dict[str, Any]], match: int) -> list[dict[str, Any]]:
    """Per arm: mean ± sd over seeds of every held-out number, the in-run curve's ends, and
    the curve at solver version ``match`` (runs that reached it; their count in brackets)."""
    rows = []
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        if not mine:
            continue
        row: dict[str, Any] = {"arm": arm, "seeds": len(mine)}
        row["eval v0"] = _spread([r["eval_curve"][0][1] for r in mine if r["eval_curve"]] or [0])
        reached = [a for r in mine if (a := _at(r["eval_curve"], match)) is not None]
        row[f"eval v{match}"] = f"{_spread(reached)} ({len(reached)})" if reached else "-"
        row["eval last"] = _spread([r["eval_curve"][-1][1] for r in mine if r["eval_curve"]] or [0])
        for key in mine[0]["inference"]:
            row[key] = _spread([r["inference"][key] for r in mine])
        for key in ("solver_versions", "solver_rollouts", "wall_s"):
            row[key] = f"{statistics.fmean(float(r[key]) for r in mine):.0f}"
        rows.append(row)
    return rows


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors = dict(zip(ARMS, ("tab:blue", "tab:orange", "tab:green"), strict=True))
    for r in runs:
        xs = [v for v, _ in r["eval_curve"]]
        ys = [a for _, a in r["eval_curve"]]
        left.plot(xs, ys, color=colors[r["arm"]], alpha=0.8,
                  label=r["arm"] if r["seed"] == runs[0]["seed"] else None)  # fmt: skip
    left.set_xlabel("solver version")
    left.set_ylabel("held-out greedy pass@1 (evaluator)")
    left.set_title("learning curves (one line per seed)")
    left.legend(fontsize=8)
    keys = list(dict.fromkeys(k for r in runs for k in r["inference"]
                              if k not in ("valid_tests", "parsed_picks")))  # fmt: skip
    width = 0.8 / len(ARMS)
    for i, arm in enumerate(ARMS):
        mine = [r for r in runs if r["arm"] == arm]
        if not mine:
            continue
        xs = [j + i * width for j, k in enumerate(keys)]
        means = [statistics.fmean(r["inference"].get(k, float("nan")) for r in mine)
                 for k in keys]  # fmt: skip
        right.bar(xs, means, width, label=arm, color=colors[arm])
        for j, k in enumerate(keys):
            right.scatter([j + i * width] * len(mine),
                          [r["inference"].get(k, float("nan")) for r in mine],
                          color="black", s=8, zorder=3)  # fmt: skip
    right.set_xticks([j + width for j in range(len(keys))], keys, fontsize=8)
    right.set_ylabel("held-out pass rate (38 specs, sandbox)")
    right.set_title("final weights (bars: mean, dots: seeds)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 seed, 2 versions, short warm-ups")
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--steps", type=int, default=None, help="versions per policy and run")
    p.add_argument("--warmup-steps", type=int, default=None, help="SFT steps (default: recipe's)")
    p.add_argument("--max-time-s", type=float, default=None, help="wall cap per run")
    p.add_argument("--eval-every-s", type=float, default=None)
    p.add_argument("--k", type=int, default=8, help="programs sampled per held-out spec")
    p.add_argument("--m", type=int, default=4, help="test sets sampled per held-out spec")
    p.add_argument("--out", default="code_workflows_study", help="output stem (.png, .json)")
    p.add_argument("--scratch", default=None, help="keep run directories here")
    p.add_argument("--match-version", type=int, default=10,
                   help="also compare the evaluator's accuracy at this solver version")  # fmt: skip
    p.add_argument(
        "--reuse",
        action="store_true",
        help="runs already in --scratch are not run again (their inference is)",
    )
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="no runs: table and figure of these studies' runs together")  # fmt: skip
    args = p.parse_args(argv)
    args.steps = args.steps or (2 if args.quick else 20)
    if args.quick and args.warmup_steps is None:
        args.warmup_steps = 20
    args.max_time_s = args.max_time_s or 600.0  # a safety net: runs end at --steps versions
    args.eval_every_s = args.eval_every_s or (2.0 if args.quick else 10.0)
    if args.quick:
        args.k, args.m = min(args.k, 4), min(args.m, 2)
    seeds = args.seeds or ([0] if args.quick else [0, 1])
    runs: list[dict[str, Any]] = []
    for path in args.merge or []:
        runs += json.loads(Path(path).read_text())["runs"]
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(args.scratch or tmp)
        for seed in [] if args.merge else seeds:
            init = solver_init(seed, scratch, args)
            for arm in args.arms:
                runs.append(run_one(arm, seed, scratch, args, init))
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "eval_curve"}),
                      flush=True)  # fmt: skip
    rows = summarize(runs, args.match_version)
    out = Path(args.out)
    write_summary(out, args, rows, runs)
    plot(runs, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.png')} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
