"""astraflow vs TRL's ``GRPOTrainer`` on the quickstart recipe, one after the other, one machine.

Both train the same 0.4M-parameter Qwen3 (examples/quickstart.yaml: char tokenizer, the same
noisy-label SFT warm-up, run by astraflow's own warm-up code with the same seed in both) on
single-digit addition with GRPO: 16 prompts x group 8 = 128 samples a step, lr 3e-4, AdamW
betas (0.9, 0.99), grad clip 1.0, temperature 1.0, up to 3 new tokens, no KL, no gradient
checkpointing, reward = exact answer.

  astraflow   ``astraflow run examples/quickstart.yaml`` (dataflow, weight store, one trainer,
              one rollout node, the evaluator: every component its own process)
  TRL         ``trl.GRPOTrainer`` in this process (generation then training, serially),
              ``use_cpu``, fp32; greedy held-out accuracy every ``--eval-every`` steps by a
              callback whose time is NOT counted in TRL's clock.

Figures for each (RL start = the first GRPO step; warm-up excluded):
  steps/s        GRPO steps per second of RL time
  +30 points     seconds from RL start until greedy held-out accuracy (the same 200 add1
                 eval prompts) first reached the version-0 accuracy + 0.30
  final          greedy accuracy of the last version
  stale dropped  (astraflow) samples dropped as stale / samples generated
  CPU s/step     CPU seconds (user + system, every thread) spent per GRPO step during RL
                 time: for astraflow the sum over all its processes (launcher, dataflow,
                 trainer, node, evaluator; sampled from /proc), split by component; for TRL
                 its process without the evaluations. Other jobs' load stretches wall time
                 far more than it changes this figure.
and the ratios astraflow / TRL. The machine is shared: the load average is printed before
each run; only the ratio of two runs measured one after the other means anything.

    .venv/bin/python benchmarks/vs_trl.py                  # 2,000 steps each (the recipe)
    .venv/bin/python benchmarks/vs_trl.py --steps 400      # shorter
    .venv/bin/python benchmarks/vs_trl.py --only trl       # one side
    .venv/bin/python benchmarks/vs_trl.py --only astraflow --set seed=1   # another seed

Needs TRL: ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
GAIN = 0.30


@dataclass
class Figures:
    """One system's figures."""

    name: str
    steps: int
    rl_s: float
    curve: list[tuple[float, float]]
    """(seconds since RL start, greedy accuracy)."""
    stale: str = "-"
    cpu_s: float | None = None
    """CPU seconds spent during RL time (all processes of the system)."""
    cpu_split: dict[str, float] = field(default_factory=dict)
    """``cpu_s`` by component."""

    @property
    def cpu_per_step(self) -> float | None:
        return None if self.cpu_s is None else self.cpu_s / self.steps

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.rl_s

    @property
    def to_gain(self) -> float | None:
        base = self.curve[0][1]
        return next((t for t, a in self.curve if a >= base + GAIN - 1e-9), None)

    @property
    def final(self) -> float:
        return self.curve[-1][1]


def _load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# --------------------------------------------------------------------------- CPU time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_KINDS = {"train": "trainer", "raas": "node", "dataflow": "dataflow", "eval": "eval",
          "weights": "weights"}  # fmt: skip


def _kind(pid: int) -> str:
    """The component a process runs (``python -m astraflow <command>``), else ``launcher``."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "launcher"
    words = [a.decode(errors="replace") for a in args]
    for i, word in enumerate(words[:-1]):
        if word == "-m" and words[i + 1] == "astraflow.raas.engines.process_child":
            return "engine"  # a node's engine in its own process (engine option process: true)
        if word == "astraflow" and i > 0 and words[i - 1] == "-m":
            return _KINDS.get(words[i + 1], "launcher")
    return "launcher"


class TreeCpu:
    """Samples the cumulative CPU seconds of a process and its descendants from /proc (Linux),
    so the CPU spent between two wall-clock instants can be read off afterwards."""

    def __init__(self, root: int, every_s: float = 0.25) -> None:
        self.root, self.every_s = root, every_s
        self.seen: dict[int, tuple[str, float]] = {}
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> TreeCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        parents: dict[int, int] = {}
        cpu: dict[int, float] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            pid = int(entry.name)
            parents[pid] = int(fields[1])
            cpu[pid] = (int(fields[11]) + int(fields[12])) / _TICK
        mine, frontier = {self.root}, [self.root]
        children: dict[int, list[int]] = {}
        for pid, ppid in parents.items():
            children.setdefault(ppid, []).append(pid)
        while frontier:
            for child in children.get(frontier.pop(), []):
                if child not in mine:
                    mine.add(child)
                    frontier.append(child)
        for pid in mine & cpu.keys():
            known = self.seen.get(pid, ("launcher", 0.0))[0]
            # a child reads as the launcher between fork and exec: look again until it is not
            kind = known if known != "launcher" else _kind(pid)
            self.seen[pid] = (kind, max(cpu[pid], self.seen.get(pid, ("", 0.0))[1]))
        totals: dict[str, float] = {}
        for kind, seconds in self.seen.values():
            totals[kind] = totals.get(kind, 0.0) + seconds
        self.samples.append((time.time(), totals))

    def at(self, when: float) -> dict[str, float]:
        """Cumulative CPU seconds by kind at the last sample at or before ``when``."""
        best = self.samples[0][1] if self.samples else {}
        for t, totals in self.samples:
            if t > when:
                break
            best = totals
        return best

    def between(self, start: float, end: float) -> dict[str, float]:
        a, b = self.at(start), self.at(end)
        return {k: b[k] - a.get(k, 0.0) for k in sorted(b)}


# --------------------------------------------------------------------------- astraflow


def run_astraflow(
    steps: int, work: Path, *, reuse: bool = False, overrides: Sequence[str] = ()
) -> Figures:
    """``astraflow run examples/quickstart.yaml`` for ``steps`` GRPO steps, with ``overrides``
    (``KEY=VALUE``, as ``--set``) on the recipe (``reuse``: the figures of the run already in
    ``work``)."""
    run_dir = work / "astraflow"
    cmd = [sys.executable, "-m", "astraflow", "run", str(QUICKSTART), "--run-dir", str(run_dir),
           "--set", f"policies.policy.trainer.max_steps={steps}"]  # fmt: skip
    for override in overrides:
        cmd += ["--set", override]
    cpu: TreeCpu | None = None
    if not reuse:
        print(f"astraflow: load {_load()}; {' '.join(cmd[1:])}", flush=True)
        with (work / "astraflow.out").open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
            with TreeCpu(proc.pid) as cpu:
                code = proc.wait()
        if code:
            raise subprocess.CalledProcessError(code, cmd)
    metrics = _jsonl(run_dir / "trainers" / "policy" / "metrics.jsonl")
    evals = _jsonl(run_dir / "eval" / "policy.jsonl")
    first = metrics[0]  # RL start: the first step's take began (version 0 just published)
    start = first["time"] - first["wait_s"] - first["compute_s"] - first["publish_s"]
    rl_s = metrics[-1]["time"] - start
    curve = [(max(0.0, e["created_at"] - start), e["accuracy"]) for e in evals]
    if evals[0]["version"] != 0:  # the evaluator skipped version 0 (a newer one was out)
        print(f"astraflow: first evaluated version is {evals[0]['version']}", flush=True)
    report = _jsonl(run_dir / "report.jsonl")[-1]["policies"]["policy"]
    kinds = ("acked_samples", "stale_dropped_samples", "filtered_samples", "buffered_samples",
             "served_samples")  # fmt: skip
    made = sum(report[k] for k in kinds)
    stale = f"{100 * report['stale_dropped_samples'] / max(1, made):.1f}% of {made}"
    figures = Figures("astraflow", len(metrics), rl_s, curve, stale)
    if cpu is not None and cpu.samples:
        figures.cpu_split = cpu.between(start, metrics[-1]["time"])
        figures.cpu_s = sum(figures.cpu_split.values())
    return figures


# --------------------------------------------------------------------------- TRL


def _recipe(work: Path) -> tuple[Any, Any, Any]:
    """The quickstart trainer's config, and its warmed-up model and tokenizer (astraflow's
    own build + SFT warm-up, the same seed: the same starting weights)."""
    from astraflow.config import read_yaml, validate
    from astraflow.launch.config import RunConfig
    from astraflow.launch.plan import make_plan
    from astraflow.trainer.backends.local import LocalBackend
    from astraflow.trainer.runtime import build_runtime

    data = read_yaml(QUICKSTART)
    data["run_dir"] = str(work / "trl-plan")
    plan = make_plan(validate(RunConfig, data, source="quickstart"), port=1)
    config = plan.trainers["policy"]
    rt = build_runtime(config, LocalBackend("cpu"))
    return config, rt.model, rt.tokenizer


def _rows(spec: dict[str, Any]) -> list[dict[str, Any]]:
    from astraflow.workflows.tasks import GENERATORS

    return list(GENERATORS.build(spec).rows())


def run_trl(steps: int, work: Path, eval_every: int, threads: int) -> Figures:
    """TRL's GRPOTrainer on the same recipe, timed without its evaluations."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    began = time.perf_counter()
    config, model, tokenizer = _recipe(work)
    print(f"TRL: warm-up done in {time.perf_counter() - began:.0f} s", flush=True)
    tokenizer.padding_side = "left"
    data = read_quickstart()
    train = _rows(data["sources"][0]["generator"])
    held = _rows({**data["eval"][0]["generator"]})
    group = data["sources"][0]["group_size"]
    sampling = data["workflows"]["rlvr"]["sampling"]
    prompts_per_step = config.batch.max_samples // group
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in train]
    need = steps * prompts_per_step
    rows = (rows * (need // len(rows) + 1))[:need]

    def exact(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    @torch.inference_mode()
    def greedy_accuracy() -> float:
        was = model.training
        model.eval()
        enc = tokenizer([r["prompt"] for r in held], return_tensors="pt", padding=True)
        out = model.generate(**enc, do_sample=False, max_new_tokens=sampling["max_new_tokens"],
                             pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)  # fmt: skip
        width = enc["input_ids"].shape[1]
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        model.train(was)
        return sum(t.strip() == r["answer"] for t, r in zip(texts, held, strict=True)) / len(held)

    class Clock(TrainerCallback):  # type: ignore[misc]
        """RL time without the evaluations; the accuracy curve."""

        def __init__(self) -> None:
            self.start = 0.0
            self.excluded = 0.0
            self.cpu_start = 0.0
            self.cpu_excluded = 0.0
            self.curve: list[tuple[float, float]] = []

        def now(self) -> float:
            return time.perf_counter() - self.start - self.excluded

        def cpu(self) -> float:
            return time.process_time() - self.cpu_start - self.cpu_excluded

        def measure(self, at: float) -> None:
            began, cpu_began = time.perf_counter(), time.process_time()
            self.curve.append((at, greedy_accuracy()))
            self.excluded += time.perf_counter() - began
            self.cpu_excluded += time.process_time() - cpu_began

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()
            self.measure(0.0)

        def on_step_end(self, args: Any, state: Any, *a: Any, **k: Any) -> None:
            if state.global_step % eval_every == 0 or state.global_step == steps:
                self.measure(self.now())

    opt = config.optimizer
    args = GRPOConfig(
        output_dir=str(work / "trl"), max_steps=steps, learning_rate=opt.lr,
        adam_beta1=opt.betas[0], adam_beta2=opt.betas[1], weight_decay=opt.weight_decay,
        max_grad_norm=opt.grad_clip, lr_scheduler_type="constant", warmup_steps=0,
        per_device_train_batch_size=config.batch.max_samples, gradient_accumulation_steps=1,
        num_generations=group, max_completion_length=sampling["max_new_tokens"],
        temperature=sampling["temperature"], beta=0.0, num_iterations=1,
        gradient_checkpointing=False, use_cpu=True, bf16=False, report_to="none",
        logging_steps=10**9, save_strategy="no", seed=0, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    clock = Clock()
    trainer = GRPOTrainer(
        model=model, reward_funcs=exact, args=args, train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer, callbacks=[clock],
    )  # fmt: skip
    print(f"TRL: load {_load()}; GRPOTrainer, {steps} steps, {threads} torch threads", flush=True)
    trainer.train()
    cpu_s = clock.cpu()
    return Figures("TRL", steps, clock.curve[-1][0], clock.curve, cpu_s=cpu_s,
                   cpu_split={"trl": cpu_s})  # fmt: skip


def read_quickstart() -> dict[str, Any]:
    from astraflow.config import read_yaml

    return read_yaml(QUICKSTART)


# --------------------------------------------------------------------------- report


def report(results: list[Figures]) -> None:
    def fmt(v: float | None, spec: str = ".1f") -> str:
        return "never" if v is None else format(v, spec)

    print(f"\n{'':10} {'steps':>6} {'RL s':>7} {'steps/s':>8} {'+30 pts s':>10} "
          f"{'v0 acc':>7} {'final':>6} {'CPU s/step':>10}  stale dropped")  # fmt: skip
    for r in results:
        print(f"{r.name:10} {r.steps:6d} {r.rl_s:7.1f} {r.steps_per_s:8.2f} "
              f"{fmt(r.to_gain):>10} {r.curve[0][1]:7.3f} {r.final:6.3f} "
              f"{fmt(r.cpu_per_step, '.4f'):>10}  {r.stale}")  # fmt: skip
    for r in results:
        if r.cpu_split:
            split = ", ".join(f"{k} {1000 * v / r.steps:.1f}" for k, v in r.cpu_split.items())
            print(f"{r.name}: CPU ms per step by component: {split}")
    by = {r.name: r for r in results}
    if {"astraflow", "TRL"} <= set(by):
        a, t = by["astraflow"], by["TRL"]
        print(f"\nastraflow / TRL steps/s: {a.steps_per_s / t.steps_per_s:.2f}x")
        if a.cpu_per_step and t.cpu_per_step:
            print(f"TRL / astraflow CPU s per step: {t.cpu_per_step / a.cpu_per_step:.2f}x "
                  "(above 1: astraflow spends less CPU per step)")  # fmt: skip
        if a.to_gain is not None and t.to_gain is not None:
            print(f"TRL / astraflow seconds to +30 points: {t.to_gain / a.to_gain:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="GRPO steps each")
    parser.add_argument("--eval-every", type=int, default=25, help="TRL: steps between evals")
    parser.add_argument("--only", choices=("astraflow", "trl"), default=None)
    parser.add_argument("--work", type=Path, default=None, help="keep outputs here")
    parser.add_argument("--trl-threads", type=int, default=1,
                        help="torch threads of the TRL process (astraflow's recipe: 1 per "
                        "process; more oversubscribes a loaded 2-core box)")  # fmt: skip
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="astraflow: override one value of the recipe, as `astraflow run --set` (e.g. "
        "seed=1; repeatable); TRL's side is not changed",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="astraflow: read the figures of the run already in --work",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = []
        if args.only in (None, "astraflow"):
            results.append(
                run_astraflow(args.steps, work, reuse=args.reuse, overrides=args.overrides)
            )
            report(results)
        if args.only in (None, "trl"):
            results.append(run_trl(args.steps, work, args.eval_every, args.trl_threads))
        report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
