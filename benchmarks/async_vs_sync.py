"""Async (dataflow) vs sync (trainer-centred) on the same work: the real system, real engines.

Two workloads, each run twice with the real launcher (``LocalRun``: every component a
process) on configs that differ ONLY in ``mode``:

  quickstart       examples/quickstart.yaml (add1, 0.4M Qwen3, one trainer, one node)
  solver_verifier  examples/solver_verifier.yaml (two trainers, two models on one node)

both given a LONG-TAILED RESPONSE-LENGTH DISTRIBUTION made of real generated tokens (the
policy's, the solver's: verdicts stay short): the
``long_tail`` workflow wraps the example's workflow and samples every generation with
``min_new_tokens = max_new_tokens = L``, ``L ~ lognormal(median, sigma)`` clipped to
``[2, max_tokens]`` and drawn per (task, call), so both modes get the same lengths for the
same task. The engine decodes all L tokens (EOS is not drawn before them; logprobs are of the
full distribution) and the trainer trains on all of them. The task stays verifiable: the answer
comes first, a space ends it, filler follows; rewards score the answer. The SFT warm-up pairs
get 0-8 trailing spaces so the warm-up model knows the format. Held-out evaluation is greedy
on the answer alone (3-4 tokens, trailing spaces stripped).

Figures, over the steady part of each run (from step ``skip`` to the last):
  s/step        wall seconds per trainer version (mean over trainers)
  trainer idle  sum of the trainers' time inside take_batch (metrics.jsonl ``wait_s``) over
                their wall time: waiting for data
  rollout idle  1 - (seconds the node's engines spent generating, summed over its engines:
                ``busy_s.<policy>`` reported in the node's stats) / wall time, floored at 0
  reward        mean sampled reward of the last 20% of steps
  accuracy      greedy held-out accuracy of the final version (evaluator, 200 prompts)
  cores         CPU seconds of all the run's processes / wall seconds (2 = this whole box)
  speed-up      sync s/step / async s/step

Placement (``--placement``, default ``trainer=0,node=1`` when two CPUs are usable): the
trainers and the rollout nodes are pinned to separate cores (``placement`` in the run config:
CPU affinity, one torch thread per placed CPU), so neither steals the other's core; the
dataflow service and the evaluator run anywhere. Each run also prints the trainer's phase
split (median ms per step on its critical path: waiting for a batch, computing, publishing):
the async/sync ratio is bounded by (rollout + train) / max(rollout, train) of the sync rounds.

The machine is shared (2 cores): the 1-minute load average before each run is printed. A
component's CPU use slows the others, so when the box is saturated the two modes converge;
re-run on a quiet machine for the design's figures.

    .venv/bin/python benchmarks/async_vs_sync.py                 # both workloads, 200 steps
    .venv/bin/python benchmarks/async_vs_sync.py --quick         # 60 steps each (~6 min)
    .venv/bin/python benchmarks/async_vs_sync.py --workloads quickstart --sigma 1.5 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow.config import read_yaml, validate
from astraflow.launch.config import RunConfig
from astraflow.launch.local import LocalRun
from astraflow.launch.status import RunStatus
from astraflow.workflows.length_tail import LengthDistribution
from astraflow.workflows.tasks import GENERATORS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


# --------------------------------------------------------------------------- workloads


def _pairs(path: Path, generator: dict[str, Any], seed: int) -> str:
    """SFT warm-up pairs of ``generator`` with 0-8 trailing spaces (the answer-then-filler
    format), written once."""
    if not path.exists():
        rng = random.Random(seed)
        rows = GENERATORS.build(generator).rows()
        path.write_text(
            "".join(
                json.dumps(
                    {"prompt": r["prompt"], "completion": r["completion"] + " " * rng.randint(0, 8)}
                )
                + "\n"
                for r in rows
            )
        )
    return str(path)


def _tailed_policy(policy: dict[str, Any], args: argparse.Namespace, pairs: Path) -> None:
    """Room for the longest response, a space (the filler) in the alphabet, and a warm-up on
    answer-then-filler pairs."""
    model = policy["model"]
    model["config"]["max_position_embeddings"] = args.max_tokens + 16
    model["tokenizer"]["alphabet"] += " "
    policy["warmup"] = {
        **{k: v for k, v in policy["warmup"].items() if k != "generator"},
        "pairs": _pairs(pairs, policy["warmup"]["generator"], 0),
    }


def quickstart(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """examples/quickstart.yaml with long-tailed lengths (mode and run_dir set later)."""
    data: dict[str, Any] = json.loads(json.dumps(read_yaml(EXAMPLES / "quickstart.yaml")))
    policy = data["policies"]["policy"]
    _tailed_policy(policy, args, work / "pairs-quickstart.jsonl")
    inner = {"type": "rlvr", **data["workflows"]["rlvr"]}
    data["workflows"] = {
        "rlvr": {"type": "long_tail", "workflow": inner, "lengths": _lengths(args)},
        "eval_rlvr": {**inner, "reward": {"type": "synthetic_exact", "strip": True}},
    }
    data["eval"][0]["workflow"] = "eval_rlvr"
    return data


def solver_verifier(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """examples/solver_verifier.yaml with long-tailed solver answers (verdicts stay short)."""
    data: dict[str, Any] = json.loads(json.dumps(read_yaml(EXAMPLES / "solver_verifier.yaml")))
    solver = data["policies"]["solver"]
    _tailed_policy(solver, args, work / "pairs-sv-solver.jsonl")
    inner = {"type": "solver_verifier", **data["workflows"]["solver_verifier"]}
    inner["max_answer_chars"] = 8  # the verifier reads the answer, not a runaway one
    data["workflows"]["solver_verifier"] = {
        "type": "long_tail",
        "workflow": inner,
        "lengths": _lengths(args),
        "policies": ["solver"],
    }
    data["workflows"]["solver_eval"]["reward"] = {"type": "synthetic_exact", "strip": True}
    data.pop("max_time_s", None)
    return data


def _lengths(args: argparse.Namespace) -> dict[str, Any]:
    return {"median": args.median, "sigma": args.sigma, "min_tokens": 2,
            "max_tokens": args.max_tokens}  # fmt: skip


WORKLOADS: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "quickstart": quickstart,
    "solver_verifier": solver_verifier,
}


# --------------------------------------------------------------------------- one run


@dataclass
class Result:
    """The figures of one run."""

    workload: str
    mode: str
    steps: dict[str, int]
    s_per_step: float
    trainer_idle: float
    rollout_idle: float
    reward: dict[str, float]
    accuracy: dict[str, float | None]
    cores: float
    load_before: float
    wall_s: float
    tokens_per_sample: float
    engine_busy: dict[str, float] = field(default_factory=dict)
    sync_split: tuple[float, float] | None = None
    phases: dict[str, float] = field(default_factory=dict)
    """Median ms per step of the trainers' critical-path phases."""


def run_one(name: str, data: dict[str, Any], mode: str, args: argparse.Namespace) -> Result:
    """Run ``data`` in ``mode`` until a trainer reaches ``args.steps``; measure it."""
    run_dir = Path(args.out) / f"{name}-{mode}-{time.strftime('%H%M%S')}"
    data = json.loads(json.dumps(data))  # identical configs but for mode (and run_dir)
    data.update(mode=mode, run_dir=str(run_dir), max_time_s=args.steps * 10.0 + 180)
    if args.placement:
        data["placement"] = args.placement
        for policy in data["policies"].values():  # a node's engine process inherits the
            # node's one core, where it only adds a pipe: the engine stays in the node
            engine = (policy.get("rollout") or {}).get("engine")
            if isinstance(engine, dict) and engine.get("process"):
                engine["process"] = False
    for policy in data["policies"].values():
        policy["trainer"] = {**policy["trainer"], "max_steps": args.steps,
                             "checkpoint": {"every": 0}}  # fmt: skip
    config = validate(RunConfig, data, source=f"{name} ({mode})")
    stop = threading.Event()

    def on_tick(status: RunStatus) -> None:
        # tasks feed every policy: once one trainer is done, end the run (not a stall)
        if any(p.version >= args.steps for p in status.policies.values()):
            stop.set()

    load = os.getloadavg()[0]
    cpu0 = _children_cpu()
    started = time.monotonic()
    result = LocalRun(config, base_dir=EXAMPLES, on_tick=on_tick).run(stop)
    wall = time.monotonic() - started
    cores = (_children_cpu() - cpu0) / wall
    if not result.ok:
        raise SystemExit(f"{name} {mode}: the run failed: {result.failed} (see {run_dir}/logs)")
    return measure(name, mode, run_dir, list(config.trained), args, load, cores, wall)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def measure(
    name: str,
    mode: str,
    run_dir: Path,
    policies: list[str],
    args: argparse.Namespace,
    load: float,
    cores: float,
    wall: float,
) -> Result:
    """The figures of a finished run, from the files it wrote."""
    per_step, idle, rewards, acc, steps, tokens = [], [], {}, {}, {}, []
    window: list[float] = []
    phases: dict[str, list[float]] = {"wait": [], "compute": [], "publish": []}
    for policy in policies:
        metrics = _jsonl(run_dir / "trainers" / policy / "metrics.jsonl")
        steps[policy] = len(metrics)
        skip = min(args.skip, len(metrics) // 4)
        steady = metrics[skip:]
        if len(steady) < 2:
            raise SystemExit(f"{name} {mode}: {policy} trained only {len(metrics)} steps")
        span = steady[-1]["time"] - steady[0]["time"]
        per_step.append(span / (len(steady) - 1))
        idle.append(sum(m["wait_s"] for m in steady[1:]) / span)
        window = [min(window[0], steady[0]["time"]) if window else steady[0]["time"],
                  max(window[1], steady[-1]["time"]) if window else steady[-1]["time"]]  # fmt: skip
        tail = metrics[-max(1, len(metrics) // 5) :]
        rewards[policy] = statistics.mean(m["reward_mean"] for m in tail)
        tokens += [m["trained_tokens"] / m["samples"] for m in steady]
        for key, name_ in (("wait_s", "wait"), ("step_s", "compute"), ("publish_s", "publish")):
            phases[name_] += [1000 * m[key] for m in steady if m.get(key) is not None]
        evals = _jsonl(run_dir / "eval" / f"{policy}.jsonl")
        acc[policy] = evals[-1]["accuracy"] if evals else None
    reports = _jsonl(run_dir / "report.jsonl")
    busy = _engine_busy(reports, window)
    return Result(
        workload=name, mode=mode, steps=steps, s_per_step=statistics.mean(per_step),
        trainer_idle=statistics.mean(idle),
        rollout_idle=max(0.0, 1.0 - sum(busy.values())) if busy else float("nan"),
        reward=rewards, accuracy=acc, cores=cores, load_before=load, wall_s=wall,
        tokens_per_sample=statistics.mean(tokens), engine_busy=busy,
        sync_split=_sync_split(reports),
        phases={k: statistics.median(v) for k, v in phases.items() if v},
    )  # fmt: skip


def _engine_busy(reports: list[dict[str, Any]], window: list[float]) -> dict[str, float]:
    """Per policy: engine-seconds spent generating / (wall seconds x nodes) over the window."""
    inside = [r for r in reports if window[0] <= r["time"] <= window[1] and r["nodes"]]
    if len(inside) < 2:
        return {}
    first, last = inside[0], inside[-1]

    def busy(report: dict[str, Any]) -> dict[str, float]:
        out: dict[str, float] = {}
        for node in report["nodes"].values():
            for key, value in node["stats"]["extra"].items():
                if key.startswith("busy_s."):
                    policy = key.removeprefix("busy_s.")
                    out[policy] = out.get(policy, 0.0) + value
        return out

    span = (last["time"] - first["time"]) * max(1, len(last["nodes"]))
    before = busy(first)
    return {p: (v - before.get(p, 0.0)) / span for p, v in busy(last).items()}


def _sync_split(reports: list[dict[str, Any]]) -> tuple[float, float] | None:
    """Sync mode: share of closed-round time in the rollout phase and in the train phase."""
    sync = reports[-1].get("sync") if reports else None
    if not sync or not (sync["rollout_s"] + sync["train_s"]):
        return None
    total = sync["rollout_s"] + sync["train_s"]
    return sync["rollout_s"] / total, sync["train_s"] / total


# --------------------------------------------------------------------------- output


def _fmt(values: dict[str, Any], digits: int = 3) -> str:
    return " ".join(f"{k[:3]}={'-' if v is None else f'{v:.{digits}f}'}" for k, v in values.items())


def print_table(results: list[Result]) -> None:
    """One table per workload, then the speed-ups."""
    for name in dict.fromkeys(r.workload for r in results):
        rows = [r for r in results if r.workload == name]
        print(f"\n== {name} (real engine; lengths: {rows[0].tokens_per_sample:.1f} generated "
              "tokens per sample on average)")  # fmt: skip
        print(f"{'mode':6} {'steps':>10} {'s/step':>7} {'trainer idle':>12} "
              f"{'rollout idle':>12} {'cores':>5} {'load':>5}  reward (last 20%)"
              "          accuracy (final, greedy)")  # fmt: skip
        for r in rows:
            steps = "/".join(str(v) for v in r.steps.values())
            print(f"{r.mode:6} {steps:>10} {r.s_per_step:7.3f} {r.trainer_idle:12.2f} "
                  f"{r.rollout_idle:12.2f} {r.cores:5.2f} {r.load_before:5.1f}  "
                  f"{_fmt(r.reward):25} {_fmt(r.accuracy)}")  # fmt: skip
            split = " ".join(f"{k} {v:.0f}" for k, v in r.phases.items())
            print(f"{'':6} trainer step, median ms: {split}")
            if len(r.engine_busy) > 1:
                print(f"{'':6} engines busy: {_fmt(r.engine_busy, 2)}")
            if r.sync_split is not None:
                bound = 1 / max(r.sync_split)
                print(f"{'':6} sync rounds: {r.sync_split[0]:.0%} rollout phase (trainers "
                      f"wait), {r.sync_split[1]:.0%} train phase (rollout waits): overlapping "
                      f"them perfectly would give {bound:.2f}x")  # fmt: skip
        sync = [r.s_per_step for r in rows if r.mode == "sync"]
        asyn = [r.s_per_step for r in rows if r.mode == "async"]
        if sync and asyn:
            ratio = statistics.median(sync) / statistics.median(asyn)
            print(f"speed-up per trainer step, async over sync: {ratio:.2f}x "
                  f"(median sync {statistics.median(sync):.3f} s / median async "
                  f"{statistics.median(asyn):.3f} s)")  # fmt: skip


def _placement(text: str) -> dict[str, list[int]] | None:
    """``--placement``: 'auto', 'none' or 'kind=cpu[+cpu],...' as a run config section."""
    if text == "none":
        return None
    if text == "auto":
        cpus = sorted(os.sched_getaffinity(0))
        return {"trainer": [cpus[0]], "node": [cpus[1]]} if len(cpus) >= 2 else None
    out: dict[str, list[int]] = {}
    for item in text.split(","):
        kind, _, ids = item.partition("=")
        out[kind.strip()] = [int(c) for c in ids.split("+")]
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="60 steps per run")
    parser.add_argument("--steps", type=int, default=200, help="trainer steps per run")
    parser.add_argument("--skip", type=int, default=20, help="first steps left out (warm-up)")
    parser.add_argument("--workloads", default="quickstart,solver_verifier")
    parser.add_argument("--median", type=float, default=8.0, help="median response length")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma (the tail)")
    parser.add_argument("--max-tokens", type=int, default=128, help="longest response")
    parser.add_argument("--repeat", type=int, default=1, help="sync/async pairs per workload")
    parser.add_argument("--out", default=None, help="run directories (default: a temp dir)")
    parser.add_argument("--placement", default="auto",
                        help="'auto' (trainer and nodes on separate CPUs when 2 are usable), "
                        "'none', or e.g. 'trainer=0,node=1'")  # fmt: skip
    args = parser.parse_args(argv)
    args.placement = _placement(args.placement)
    if args.quick:
        args.steps, args.skip = 60, 10
    args.out = args.out or tempfile.mkdtemp(prefix="async-vs-sync-")
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    dist = LengthDistribution(median=args.median, sigma=args.sigma, min_tokens=2,
                              max_tokens=args.max_tokens)  # fmt: skip
    rng = random.Random(0)
    draws = sorted(dist.draw(rng) for _ in range(100_000))
    print(f"response lengths (real generated tokens): lognormal median {args.median} sigma "
          f"{args.sigma}, clipped to [2, {args.max_tokens}]: mean {statistics.mean(draws):.1f}, "
          f"p90 {draws[90_000]}, p99 {draws[99_000]}, max {draws[-1]}")  # fmt: skip
    print(f"{os.cpu_count()} CPUs; {args.steps} trainer steps per run; runs in {work}; "
          f"placement {args.placement or 'none'}")  # fmt: skip
    results = []
    for name in args.workloads.split(","):
        data = WORKLOADS[name](args, work)
        for i in range(args.repeat):
            for mode in ("sync", "async") if i % 2 == 0 else ("async", "sync"):
                r = run_one(name, data, mode, args)
                print(f"  {name} {mode}: {r.s_per_step:.3f} s/step, {r.wall_s:.0f} s", flush=True)
                results.append(r)
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
