"""SIMULATION: async vs sync at cluster scale, 64 simulated rollout nodes in 3 pools.

What is real and what is simulated:
  real       the dataflow service, the weight store, the trainers (``Trainer``: take batches,
             a real GRPO update of a 0.4M Qwen3, publish every version to the weight store,
             announce, ack), the rollout nodes (``RolloutNode``: leases, heartbeats, HTTP to
             the dataflow, weight refresh, the ``rlvr`` workflow)
  SIMULATED  trainer hardware (``--trainer-compute simulated``, the default): in the paper
             every trainer has its own accelerators; here they would share 2 cores with 64
             nodes, the dataflow and each other. Each trainer's step runs
             ``benchmarks/simulated_trainer.py``: the real update on one group of the batch
             (so the published weights really change), then it waits out the step time of
             the WHOLE batch, CALIBRATED in this run on real updates of the same model, loss
             and batch size alone on the machine (fixed_s + padded_token_s x padded tokens).
             ``--trainer-compute real`` trains every sample on the shared CPU instead. The
             default is simulated because the question is the system's async/sync ratio when
             each component has its own hardware, as the nodes here do; with real compute
             the two trainers compete with 64 nodes for 2 cores, and that measures the machine.
  SIMULATED  generation: each node's engine is ``benchmarks/simulated_engine.py``, which runs no
             model. A response of L tokens (L ~ lognormal(median, sigma), clipped) takes
             L * step_s(b) / speed seconds, b = sequences running on that node (continuous
             batching, up to 64 at once), and returns L random valid token ids. step_s(b) is
             CALIBRATED in this run on the real transformers engine (the same tiny model,
             decoding b sequences of 32 tokens), unless ``--calibration FILE`` loads a
             recorded one. Weight updates after the first (real) load wait the real delta
             pull time measured in the calibration. Pools: fast (speed 1.0), medium (0.6),
             slow (0.3) of the calibrated engine. Rewards: ``simulated_engine:AnswerShare``
             (graded, so group advantages are not all zero and each version moves).

The nodes run as asyncio tasks inside a few host processes (``--hosts``), not as 64 torch
processes. Each (sigma, mode) run trains ``--steps`` versions; sync and async differ only in
``mode``. Figures, over the steady part (after ``--skip`` steps):
  s/step        wall seconds per trainer version
  trainer idle  the trainer's time inside take_batch (``wait_s``) / wall time
  batch         mean samples a trainer step trained on (a sync round holds one per trainer)
  step s        mean seconds of a trainer step (``compute_s``: calibrated wait included)
  publish s     mean seconds of the new version on the trainer's critical path
  rollout idle  1 - simulated-engine busy time (a sequence running) / (wall time x nodes)
  speed-up      sync s/step / async s/step
Rewards are meaningless here (random tokens): this measures time, not learning.

    .venv/bin/python benchmarks/cluster_sim.py                 # sigma 0.5/1.0/1.5, 20 steps
    .venv/bin/python benchmarks/cluster_sim.py --quick         # ~3 minutes
    .venv/bin/python benchmarks/cluster_sim.py --save-calibration cal.json
    .venv/bin/python benchmarks/cluster_sim.py --calibration cal.json --sigmas 1.0
    .venv/bin/python benchmarks/cluster_sim.py --policies 2 --sigmas 1.5 --steps 12 --skip 3 \
        --trainer-compute simulated,real      # the paper's setting, both trainer models
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
POOLS = (("fast", 1.0), ("medium", 0.6), ("slow", 0.3))
#: The engine of every simulated node, by path (benchmarks/ is on the import path here).
SIMULATED = "simulated_engine:SimulatedEngine"
#: The reward of the simulated responses, and the trainers' simulated-hardware step.
REWARD = "simulated_engine:AnswerShare"
UPDATE = "simulated_trainer:CalibratedUpdate"
#: Trainer settings of every policy (batch size and max_steps come from the arguments).
TRAINER: dict[str, Any] = {
    "loss": {"type": "grpo", "tis_cap": 2.0}, "optimizer": {"lr": 3e-4, "grad_clip": 1.0},
    "publish_dtype": "float32",
}  # fmt: skip
#: Length distributions the trainer step is calibrated on (sigma; the run's median and max).
CAL_SIGMAS = (0.5, 1.0, 1.5)
MODEL: dict[str, Any] = {
    "model_type": "qwen3",
    "config": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
               "max_position_embeddings": 320, "tie_word_embeddings": True},
    "tokenizer": {"type": "char", "alphabet": "0123456789+="},
}  # fmt: skip


# --------------------------------------------------------------------------- calibration


def calibrate(batches: tuple[int, ...] = (1, 8, 32, 64), tokens: int = 32) -> dict[str, Any]:
    """Decode-step time of the real transformers engine at each batch size, and the time of a
    real one-version delta pull of the same model from a weight store (1 thread)."""
    import torch

    from astraflow.models import ModelSpec, build_model, build_tokenizer
    from astraflow.raas.engines.base import EngineContext, GenerationRequest, build_engine
    from astraflow.weights import WeightClient, WeightStore

    torch.set_num_threads(1)
    spec = ModelSpec.model_validate(MODEL)
    tok = build_tokenizer(spec)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = EngineContext(policy="cal", tokenizer=tok, work_dir=Path(tmp), model=spec)
        engine = build_engine({"type": "transformers", "device": "cpu"}, ctx)
        prompt = tuple(tok.encode("3+4="))
        points = []

        async def decode(b: int) -> float:
            reqs = [GenerationRequest(prompt, max_new_tokens=tokens, min_new_tokens=tokens)] * b
            started = time.perf_counter()
            await engine.generate(reqs)
            return (time.perf_counter() - started) / tokens

        async def measure() -> None:
            await decode(4)  # warm-up
            for b in batches:
                points.append((b, statistics.median([await decode(b) for _ in range(3)])))
            await engine.close()

        asyncio.run(measure())
        model = build_model(spec, tok)
        store = WeightStore(Path(tmp) / "store")
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        store.publish("cal", 0, state).result()
        moved = {k: v + 1e-3 * torch.randn_like(v) for k, v in state.items()}
        store.publish("cal", 1, moved).result()
        store.close()
        client = WeightClient(str(Path(tmp) / "store"))
        held = client.load("cal", 0)
        started = time.perf_counter()
        client.pull("cal", held, 0, 1)
        pull_s = time.perf_counter() - started
    return {"step_s": points, "sync_s": pull_s, "tokens": tokens, "measured": time.ctime()}


def calibrate_trainer(args: argparse.Namespace) -> dict[str, Any]:
    """Real GRPO updates of the run's model, loss and batch size, one thread (a trainer's
    share here), alone on the machine: the fit of the simulated trainer step."""
    import torch

    from simulated_trainer import calibrate as fit

    torch.set_num_threads(1)
    lengths = [{"median": args.median, "sigma": s, "min_tokens": 1, "max_tokens": args.max_tokens}
               for s in CAL_SIGMAS]  # fmt: skip
    trainer = TRAINER | {"batch": {"min_samples": args.batch, "max_samples": args.batch}}
    return fit(model_spec(args), trainer, lengths, batch=args.batch) | {"measured": time.ctime()}


def model_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The policy model, with positions for the longest prompt + response."""
    model = json.loads(json.dumps(MODEL))
    model["config"]["max_position_embeddings"] = args.max_tokens + 64
    return model


# --------------------------------------------------------------------------- configs


def run_config(
    args: argparse.Namespace,
    cal: dict[str, Any],
    sigma: float,
    mode: str,
    compute: str,
    run_dir: Path,
) -> Any:
    """The run: ``--policies`` trained policies, add1 tasks through ``rlvr``; pools start no
    process nodes (the simulated nodes are hosted here); with ``compute`` 'simulated' each
    trainer steps through the calibrated ``simulated_trainer`` plug-in."""
    from astraflow.config import validate
    from astraflow.launch.config import RunConfig

    trainer = TRAINER | {
        "batch": {"min_samples": args.batch, "max_samples": args.batch, "take_timeout_s": 60},
        "checkpoint": {"every": 0}, "max_steps": args.steps,
    }  # fmt: skip
    if compute == "simulated":
        fit = cal["trainer"]
        trainer["update"] = {"type": UPDATE, "fixed_s": fit["fixed_s"],
                             "padded_token_s": fit["padded_token_s"], "groups": 1}  # fmt: skip
    policy = {
        "model": model_spec(args),
        "trainer": trainer,
        "rollout": {"engine": {"type": SIMULATED}},
        "max_staleness": args.max_staleness, "max_buffered": args.max_buffered * args.batch,
    }  # fmt: skip
    names = policy_names(args)
    data = {
        "run_dir": str(run_dir), "seed": 0, "mode": mode,
        "policies": {name: json.loads(json.dumps(policy)) for name in names},
        "sources": [{"name": f"add1-{name}", "type": "generator",
                     "generator": {"type": "add1", "size": 100000, "seed": i},
                     "workflow": f"rlvr-{name}", "policies": [name], "group_size": 8,
                     "epochs": None} for i, name in enumerate(names)],
        "workflows": {f"rlvr-{name}": {"type": "rlvr", "policy": name, "reward": REWARD,
                                       "sampling": {"max_new_tokens": args.max_tokens}}
                      for name in names},
        "pools": [{"name": name, "nodes": 0, "capacity": args.capacity} for name, _ in POOLS],
        "threads": {"trainer": 1},
        "max_time_s": args.steps * 20.0 + 180,
    }  # fmt: skip
    return validate(RunConfig, data, source=f"cluster sim ({mode}, sigma {sigma}, {compute})")


def policy_names(args: argparse.Namespace) -> list[str]:
    """The trained policies: ``policy`` (and ``policy2`` ... with ``--policies``), each with
    its own trainer, source and workflow, all served by every node."""
    return ["policy"] + [f"policy{i}" for i in range(2, args.policies + 1)]


def node_configs(
    plan: Any, config: Any, args: argparse.Namespace, cal: dict[str, Any], sigma: float
) -> list[dict[str, Any]]:
    """``args.nodes`` node configs spread over the three pools, each with its pool's speed."""
    from astraflow.launch.plan import node_config

    out = []
    for i in range(args.nodes):
        name, speed = POOLS[i % len(POOLS)]
        pool = next(p for p in config.pools if p.name == name)
        engine = {
            "type": SIMULATED, "speed": speed, "step_s": cal["step_s"],
            "sync_s": cal["sync_s"], "max_batch_size": 64,
            "lengths": {"median": args.median, "sigma": sigma, "min_tokens": 1,
                        "max_tokens": args.max_tokens},
        }  # fmt: skip
        engines = {name: {"engine": engine} for name in policy_names(args)}
        pool = type(pool).model_validate({**pool.model_dump(), "policies": engines})
        cfg = node_config(plan, pool, node_id=f"sim-{name}-{i:02d}")
        extra = {"idle_wait_s": 0.2, "lease_wait_s": 0.01, "grace_s": 5.0}
        out.append(cfg.model_dump(mode="json") | extra)
    return out


# --------------------------------------------------------------------------- node hosts


def host_main(path: str) -> int:
    """A host process: every node config in ``path`` as a RolloutNode in one event loop."""
    from astraflow.raas.config import NodeConfig
    from astraflow.raas.node import RolloutNode

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    configs = json.loads(Path(path).read_text())
    # resolve before the nodes start: their threads would race transformers' lazy imports
    # and the registries' first loads (plugins.Registry is not thread-safe on first use)
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401

    from astraflow.raas.engines.base import ENGINES
    from astraflow.workflows.registry import WORKFLOWS
    from astraflow.workflows.rewards import REWARDS

    ENGINES.resolve(SIMULATED), WORKFLOWS.resolve("rlvr"), REWARDS.resolve(REWARD)

    async def main() -> None:
        nodes = [RolloutNode(NodeConfig.model_validate(c)) for c in configs]
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: [n.request_stop() for n in nodes])
        await asyncio.gather(*(n.run() for n in nodes))

    asyncio.run(main())
    return 0


class Hosts:
    """The host processes of one run."""

    def __init__(self, configs: list[dict[str, Any]], hosts: int, run_dir: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        for h in range(hosts):
            share = configs[h::hosts]
            path = run_dir / "components" / f"simhost-{h}.json"
            path.write_text(json.dumps(share))
            log = (run_dir / "logs" / f"simhost-{h}.log").open("wb")
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            argv = [sys.executable, __file__, "--host", str(path)]
            self.procs.append(subprocess.Popen(argv, stdout=log, stderr=log, env=env))

    def died(self) -> list[int]:
        """Exit codes of host processes that ended on their own."""
        return [code for p in self.procs if (code := p.poll()) is not None]

    def stop(self, timeout_s: float = 60) -> None:
        """SIGTERM (graceful stop: leases handed back), then kill what is left."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# --------------------------------------------------------------------------- one run


@dataclass
class Result:
    """The figures of one simulated run."""

    sigma: float
    mode: str
    compute: str
    steps: int
    s_per_step: float
    trainer_idle: float
    compute_s: float
    publish_s: float
    samples: float
    rollout_idle: float
    nodes_seen: int
    wall_s: float


def run_one(
    args: argparse.Namespace, cal: dict[str, Any], sigma: float, mode: str, compute: str
) -> Result:
    """One run: LocalRun (dataflow, trainers) + simulated nodes until ``steps`` versions."""
    from astraflow.launch.local import LocalRun
    from astraflow.launch.status import RunStatus

    run_dir = Path(args.out) / f"sigma{sigma}-{mode}-{compute}-{time.strftime('%H%M%S')}"
    config = run_config(args, cal, sigma, mode, compute, run_dir)
    stop = threading.Event()
    hosts: list[Hosts] = []
    failed: list[str] = []
    launcher = LocalRun(config, base_dir=ROOT)

    def on_tick(status: RunStatus) -> None:
        if not hosts:  # the dataflow answers by the first tick: bring the nodes up
            nodes = node_configs(launcher.plan, config, args, cal, sigma)
            hosts.append(Hosts(nodes, args.hosts, run_dir))
        if hosts[0].died():
            failed.append(f"a node host process exited: see {run_dir}/logs/simhost-*.log")
            stop.set()
        if status.policies["policy"].version >= args.steps:
            hosts[0].stop()  # nodes first, while the dataflow still answers
            stop.set()

    launcher.on_tick = on_tick
    started = time.monotonic()
    try:
        result = launcher.run(stop)
    finally:
        for h in hosts:
            h.stop()
    if failed or not result.ok:
        raise SystemExit(f"sigma {sigma} {mode}: the run failed: {failed or result.failed}")
    wall = time.monotonic() - started
    result = measure(run_dir, sigma, mode, args.skip, wall, policy_names(args))
    result.compute = compute
    return result


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def measure(
    run_dir: Path, sigma: float, mode: str, skip: int, wall: float, names: list[str]
) -> Result:
    """Figures of a finished run from metrics.jsonl and report.jsonl (mean over trainers)."""
    per_step, waits, window, steps = [], [], [float("inf"), 0.0], 0
    computes, publishes, samples = [], [], []
    for name in names:
        metrics = _jsonl(run_dir / "trainers" / name / "metrics.jsonl")
        steady = metrics[min(skip, len(metrics) // 4) :]
        if len(steady) < 2:
            raise SystemExit(f"sigma {sigma} {mode}: {name} {len(metrics)} steps in {run_dir}")
        t0, t1 = steady[0]["time"], steady[-1]["time"]
        per_step.append((t1 - t0) / (len(steady) - 1))
        waits.append(sum(m["wait_s"] for m in steady[1:]) / (t1 - t0))
        computes += [m["compute_s"] for m in steady[1:]]
        publishes += [m["publish_s"] for m in steady[1:]]
        samples += [m["samples"] for m in steady[1:]]
        window = [min(window[0], t0), max(window[1], t1)]
        steps = steps or len(metrics)
    reports = [r for r in _jsonl(run_dir / "report.jsonl")
               if window[0] <= r["time"] <= window[1] and r["nodes"]]  # fmt: skip
    idle, seen = float("nan"), 0
    if len(reports) >= 2:
        first, last = reports[0], reports[-1]
        seen = len(last["nodes"])

        def busy(r: dict[str, Any]) -> float:
            return sum(v for n in r["nodes"].values() for k, v in n["stats"]["extra"].items()
                       if k.startswith("busy_s."))  # fmt: skip

        span = (last["time"] - first["time"]) * max(1, seen) * len(names)
        idle = 1 - (busy(last) - busy(first)) / span
    return Result(
        sigma=sigma, mode=mode, compute="", steps=steps, s_per_step=statistics.mean(per_step),
        trainer_idle=statistics.mean(waits), compute_s=statistics.mean(computes),
        publish_s=statistics.mean(publishes), samples=statistics.mean(samples),
        rollout_idle=idle, nodes_seen=seen, wall_s=wall,
    )  # fmt: skip


# --------------------------------------------------------------------------- main


def print_table(results: list[Result], args: argparse.Namespace) -> None:
    """The table: per trainer compute and sigma, both modes and the speed-up."""
    print("\nSIMULATION (generation times drawn, calibrated on the real engine; dataflow, "
          "trainers and nodes real; trainer compute as in the 'compute' column)")  # fmt: skip
    print(f"{args.policies} trained policies, each its own trainer and source; "
          f"{args.nodes} nodes in pools fast/medium/slow (speed 1.0/0.6/0.3), capacity "
          f"{args.capacity} tasks x 8 samples; trainer batch {args.batch}; lengths lognormal "
          f"median {args.median}, clipped to {args.max_tokens}")  # fmt: skip
    print(f"{'compute':9} {'sigma':>5} {'mode':6} {'steps':>5} {'s/step':>7} "
          f"{'batch':>5} {'trainer idle':>12} {'step s':>6} {'publish s':>9} {'rollout idle':>12} "
          f"{'nodes':>5}  speed-up (sync/async)")  # fmt: skip
    for key in dict.fromkeys((r.compute, r.sigma) for r in results):
        rows = {r.mode: r for r in results if (r.compute, r.sigma) == key}
        for mode, r in rows.items():
            ratio = ""
            if mode == "async" and "sync" in rows:
                ratio = f"{rows['sync'].s_per_step / r.s_per_step:.2f}x"
            print(f"{r.compute:9} {r.sigma:5.1f} {mode:6} {r.steps:5d} {r.s_per_step:7.3f} "
                  f"{r.samples:5.0f} {r.trainer_idle:12.2f} {r.compute_s:6.2f} {r.publish_s:9.3f} "
                  f"{r.rollout_idle:12.2f} {r.nodes_seen:5d}  {ratio}")  # fmt: skip


def load_calibration(args: argparse.Namespace, computes: list[str]) -> dict[str, Any]:
    """``--calibration FILE``, else measure now; the trainer part is measured when a
    simulated trainer needs it and the file has none. Prints it; ``--save-calibration``."""
    if args.calibration:
        cal = json.loads(Path(args.calibration).read_text())
        print(f"calibration loaded from {args.calibration} (measured {cal.get('measured')})")
    else:
        cal = calibrate()
        print("calibration measured now, alone on the machine, 1 thread each:")
    points = ", ".join(f"b={b}: {t * 1e3:.2f} ms" for b, t in cal["step_s"])
    print(f"  engine decode step (real transformers engine): {points}; "
          f"one-version delta pull {cal['sync_s'] * 1e3:.1f} ms")  # fmt: skip
    if "simulated" in computes and "trainer" not in cal:
        if args.calibration:
            print(f"  ({args.calibration} has no trainer step: measuring it now)")
        cal["trainer"] = calibrate_trainer(args)
    if "trainer" in cal:
        fit = cal["trainer"]
        steps = ", ".join(f"{p:.0f} padded tokens ({t:.0f} tokens): {s:.2f} s"
                          for p, t, s in fit["points"])  # fmt: skip
        print(f"  trainer step (real GRPO update, batch {fit['batch']}, measured "
              f"{fit['measured']}): {steps}")  # fmt: skip
        print(f"    fit: {fit['fixed_s']:.3f} s + {fit['padded_token_s'] * 1e6:.1f} us x "
              "padded tokens (the simulated trainers' step time)")  # fmt: skip
    if args.save_calibration:
        Path(args.save_calibration).write_text(json.dumps(cal, indent=1) + "\n")
    return cal


def main(argv: list[str] | None = None) -> int:
    """Calibrate (or load a calibration), then run every sigma in both modes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", help=argparse.SUPPRESS)  # internal: a node host process
    parser.add_argument(
        "--quick", action="store_true", help="sigma 0.5 and 1.5, 10 steps, max 256 tokens"
    )
    parser.add_argument("--sigmas", default="0.5,1.0,1.5", help="lognormal sigmas to run")
    parser.add_argument("--steps", type=int, default=20, help="trainer versions per run")
    parser.add_argument("--skip", type=int, default=5, help="first steps left out")
    parser.add_argument("--nodes", type=int, default=64, help="simulated rollout nodes")
    parser.add_argument(
        "--policies", type=int, default=1, help="trained policies (the paper's setting: 2)"
    )
    parser.add_argument(
        "--trainer-compute", default="simulated",
        help="'simulated' (each trainer on its own hardware: a calibrated step time, the "
        "paper's setting), 'real' (every sample trained on this machine's shared CPU), or "
        "both, comma-separated",
    )  # fmt: skip
    parser.add_argument(
        "--max-buffered", type=int, default=4,
        help="async backpressure cap, in trainer batches: buffered + served-unacked + in-flight "
        "samples per policy. A pipelined trainer holds 2 (the one it trains, one prefetched), "
        "so 2 leaves the nodes no room while it trains; staleness stays bounded by "
        "--max-staleness whatever this is",
    )  # fmt: skip
    parser.add_argument(
        "--max-staleness", type=int, default=1,
        help="async: largest version lag of a trained sample (the staleness budget leases no "
        "more than the coming batches within it can use)",
    )  # fmt: skip
    parser.add_argument("--modes", default="sync,async", help="regulation modes to run")
    parser.add_argument("--hosts", type=int, default=4, help="processes hosting the nodes")
    parser.add_argument("--capacity", type=int, default=2, help="tasks per node at once")
    parser.add_argument("--batch", type=int, default=256, help="trainer batch (samples)")
    parser.add_argument("--median", type=float, default=24.0, help="median response tokens")
    parser.add_argument("--max-tokens", type=int, default=1024, help="longest response")
    parser.add_argument("--calibration", help="load the calibration from this JSON file")
    parser.add_argument("--save-calibration", help="write the calibration here")
    parser.add_argument("--out", default=None, help="run directories (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.host:
        return host_main(args.host)
    computes = args.trainer_compute.split(",")
    if not set(computes) <= {"simulated", "real"}:
        parser.error(f"--trainer-compute: 'simulated' and/or 'real', got {args.trainer_compute}")
    if args.quick:
        args.sigmas, args.steps, args.skip, args.max_tokens = "0.5,1.5", 10, 2, 256
    args.out = args.out or tempfile.mkdtemp(prefix="cluster-sim-")
    # the trainers import the simulated step by path, as the node hosts do the engine
    paths = [str(ROOT / "benchmarks"), *filter(None, [os.environ.get("PYTHONPATH")])]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    cal = load_calibration(args, computes)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; runs in {args.out}")
    results = []
    for compute in computes:
        for sigma in (float(s) for s in args.sigmas.split(",")):
            for mode in args.modes.split(","):
                r = run_one(args, cal, sigma, mode, compute)
                print(f"  {compute} sigma {sigma} {mode}: {r.s_per_step:.3f} s/step "
                      f"({r.wall_s:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
                results.append(r)
    print_table(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
