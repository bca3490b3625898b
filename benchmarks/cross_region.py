"""Heterogeneous, cross-region rollout vs a homogeneous local baseline: the paper's three panels.

One invocation runs, per seed, with the real launcher (every component a process):

  baseline  three local pools, each node at 63% of a CPU (cgroup quota): 1.9 CPUs of rollout
  cross     pool 'local' at 100%, pools 'remote60' at 60% and 'remote30' at 30% (1.9 CPUs),
            the two remote ones behind their own emulated WAN link (dataflow + weights) with
            a regional weight relay each

Both settings: the same model, task (single-digit addition, SFT warm-up then GRPO), seed,
trainer and held-out evaluation; nodes pull weights over HTTP in both.

``--cpus C`` scales every pool's speed by C (a pool at 100% gets C CPUs). On a 2-core machine the
trainer needs a core of its own: at C = 1 the baseline's pools (3 x 0.63) are bound by the
machine, not by their quotas, and get more CPU than the cross setting's, whose 30% pool is
quota-bound; at C = 0.5 (0.95 CPUs of rollout) every quota binds and both settings get the
rollout CPU they are given. ``--batch`` sets the samples per trainer iteration: a longer
iteration keeps a node's fixed cost per version (hearing of it, the relay's pull, applying the
delta: ~0.1 s here) a small part of it, as in the paper.

Link scaling (printed): the paper's link is 4 Gbit/s and 300 ms RTT, with a full-weight transfer
taking about 0.7 of a training iteration. Here the iteration time T is measured in the first
baseline run, then rate = full snapshot bytes / (0.7 T), and the RTT keeps the paper's ratio of
RTT to full-transfer time for a 7B bf16 model (14 GB at 4 Gbit/s: 28 s vs 0.3 s RTT, 1.07%):
RTT = 0.0107 x 0.7 T. Time on the link is therefore scaled by 0.7 T / 28 s.

Afterwards the cross run's published versions are replayed over the same link shape: full vs
delta pulls straight across the link, and through a fresh relay with 1 and 4 nodes (seconds and
WAN bytes per version). Outputs in --out: panels.png (a: samples per pool per iteration,
b: weight-transfer time per link and version, c: trainer and rollout downtime per iteration),
accuracy.png, summary.json; the figures are printed.

    .venv/bin/python benchmarks/cross_region.py --quick        # smoke: 1 seed, tiny model
    nice -n 5 .venv/bin/python benchmarks/cross_region.py --seeds 2
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import multiprocessing
import re
import shutil
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from astraflow.config import validate
from astraflow.launch.config import RunConfig
from astraflow.launch.local import LocalRun
from astraflow.launch.status import RunStatus
from astraflow.link import LinkConfig, measure

ROOT = Path(__file__).resolve().parents[1]
PAPER_RTT_SHARE = 0.3 / 28.0  # RTT / full-transfer time of a 7B bf16 model at 4 Gbit/s
POOLS = {
    "baseline": [("local-a", 0.633, False), ("local-b", 0.633, False), ("local-c", 0.633, False)],
    "cross": [("local", 1.0, False), ("remote60", 0.6, True), ("remote30", 0.3, True)],
}
_REFRESH = re.compile(r"refreshed policy=\S+ from=(-?\d+) to=(\d+) seconds=([\d.]+)")
_DROPPED = re.compile(r"stale groups dropped policy=\S+ groups=\d+ samples=(\d+)")


def model_section(args: argparse.Namespace) -> dict[str, Any]:
    hidden = args.hidden
    return {
        "model_type": "qwen3",
        "config": {"hidden_size": hidden, "intermediate_size": 3 * hidden,
                   "num_hidden_layers": args.layers, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": hidden // 4,
                   "max_position_embeddings": 32, "tie_word_embeddings": True},
        "tokenizer": {"type": "char", "alphabet": "0123456789+="},
    }  # fmt: skip


def run_config(
    setting: str, seed: int, args: argparse.Namespace, run_dir: Path, link: LinkConfig | None
) -> RunConfig:
    pools = []
    for name, speed, remote in POOLS[setting]:
        # capacity 2: a node submits 2 groups at a time, so even the 30% pool delivers some
        # in (nearly) every iteration rather than a whole batch every few iterations
        pool: dict[str, Any] = {"name": name, "nodes": 1, "capacity": args.capacity,
                                "speed": round(speed * args.cpus, 4)}  # fmt: skip
        if remote:
            assert link is not None
            pool |= {"link": json.loads(link.model_dump_json()), "relay": True,
                     "policies": {"policy": {"refresh": args.remote_refresh}}}  # fmt: skip
        pools.append(pool)
    data = {
        "run_dir": str(run_dir), "seed": seed, "serve_weights": True,
        "max_time_s": args.steps * 30.0 + 600,
        "policies": {"policy": {
            "model": model_section(args),
            "warmup": {"generator": {"type": "noisy_sft", "task": {"type": "add1", "size": 5000},
                                     "correct_prob": 0.3},
                       "steps": args.warmup, "lr": 3.0e-3, "batch_size": 64},
            "trainer": {"loss": {"type": "grpo", "tis_cap": 2.0},
                        "optimizer": {"lr": args.lr, "betas": [0.9, 0.99], "grad_clip": 1.0},
                        "batch": {"min_samples": args.batch, "max_samples": args.batch,
                                  "take_timeout_s": 60},
                        "publish_dtype": "bfloat16", "checkpoint": {"every": 0},
                        "max_steps": args.steps},
            "max_staleness": 2, "max_buffered": max(512, 4 * args.batch),
            "rollout": {"engine": {"type": "transformers", "process": args.engine_process}}}},
        "sources": [{"name": "add1", "type": "generator",
                     "generator": {"type": "add1", "size": 100000}, "workflow": "rlvr",
                     "policies": ["policy"], "group_size": 8, "epochs": None}],
        "workflows": {"rlvr": {"policy": "policy", "reward": "synthetic_exact",
                               "sampling": {"max_new_tokens": 3, "temperature": 1.0}}},
        "weights": {"full_every": 10},
        "pools": pools,
        "eval": [{"policy": "policy", "generator": {"type": "add1", "split": "eval",
                                                    "size": args.eval_size}, "every_s": 5}],
        "threads": {"trainer": 1, "node": 1, "eval": 1},
    }  # fmt: skip
    return validate(RunConfig, data, source=f"cross_region {setting} seed {seed}")


def launch(config: RunConfig, steps: int) -> None:
    stop = threading.Event()

    def on_tick(status: RunStatus) -> None:
        if any(p.version >= steps for p in status.policies.values()):
            stop.set()

    result = LocalRun(config, base_dir=ROOT, on_tick=on_tick).run(stop)
    if not result.ok:
        raise SystemExit(f"run failed: {result.failed} (see {config.run_dir}/logs)")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pool_samples(steps: list[dict[str, Any]]) -> dict[int, dict[str, int]]:
    """Samples each pool contributed to the batch of each trainer iteration (the trainer's
    ``pool/<name>`` metrics, counted from the samples' ``meta.pool``)."""
    return {int(r["version"]): {k.removeprefix("pool/"): int(v) for k, v in r.items()
                                if k.startswith("pool/")} for r in steps}  # fmt: skip


def pool_tokens_per_s(run_dir: Path) -> dict[str, float]:
    """Mean generated tokens/s per pool as the nodes reported them (report.jsonl)."""
    sums: dict[str, list[float]] = defaultdict(list)
    for report in _jsonl(run_dir / "report.jsonl"):
        per_pool: dict[str, float] = defaultdict(float)
        for node in report.get("nodes", {}).values():
            per_pool[node["pool"]] += node.get("stats", {}).get("tokens_per_s", 0.0)
        for pool, rate in per_pool.items():
            if rate > 0:
                sums[pool].append(rate)
    return {pool: statistics.mean(v) for pool, v in sums.items()}


def refreshes(run_dir: Path) -> dict[str, list[tuple[int, int, float]]]:
    """(from, to, seconds) of every weight refresh, per pool (node logs)."""
    out: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    for log in (run_dir / "logs").glob("node-*.log"):
        pool = log.stem.removeprefix("node-").rsplit("-", 1)[0]
        for m in _REFRESH.finditer(log.read_text(errors="replace")):
            out[pool].append((int(m[1]), int(m[2]), float(m[3])))
    return dict(out)


def collect(run_dir: Path, setting: str) -> dict[str, Any]:
    steps = _jsonl(run_dir / "trainers" / "policy" / "metrics.jsonl")
    evals = _jsonl(run_dir / "eval" / "policy.jsonl")
    samples = pool_samples(steps)
    pools = [name for name, _, _ in POOLS[setting]]
    # steady state: from the first iteration every pool contributed to (nodes at 30% of a
    # CPU take a while to import torch); the iterations before it are reported, not judged
    every = [v for v in sorted(samples) if all(samples[v].get(p, 0) for p in pools)]
    first = every[0] if every else max(samples, default=0) + 1
    iters = sorted(v for v in samples if v >= first)
    share = {p: sum(1 for v in iters if samples[v].get(p, 0) > 0) / max(1, len(iters))
             for p in pools}  # fmt: skip
    steady = [r for r in steps if r["version"] >= first]
    waits = [r["wait_s"] for r in steady]
    times = [r["time"] for r in steady]
    step_s = [b - a for a, b in itertools.pairwise(times)]  # wall seconds per iteration
    refresh = refreshes(run_dir)
    downtime = {p: sum(s for _, _, s in refresh.get(p, [])) for p in pools}
    final = evals[-1] if evals else {}
    links, cgroups = run_dir / "links.json", run_dir / "cgroups.json"
    return {
        "setting": setting, "run_dir": str(run_dir),
        "iterations": len(steps), "steady_from": first,
        "samples_per_iteration": {str(v): samples[v] for v in sorted(samples)},
        "pools_in_every_iteration": share,
        "trainer_wait_s": [round(r["wait_s"], 3) for r in steps],
        "trainer_wait_mean_s": statistics.mean(waits) if waits else None,
        "iteration_s": statistics.median(step_s) if step_s else None,
        "rollout_refresh_s": {p: [(a, b, round(s, 3)) for a, b, s in refresh.get(p, [])]
                              for p in pools},
        "rollout_downtime_total_s": downtime,
        "tokens_per_s": pool_tokens_per_s(run_dir),
        "stale_dropped_samples": stale_dropped(run_dir),
        "accuracy": [(e.get("version"), e.get("accuracy")) for e in evals],
        "final_accuracy": final.get("accuracy"),
        "links": json.loads(links.read_text()) if links.exists() else {},
        "cgroups": json.loads(cgroups.read_text()) if cgroups.exists() else {},
    }  # fmt: skip


def stale_dropped(run_dir: Path) -> int:
    """Samples the dataflow service dropped as too stale for the trainer (its log)."""
    log = run_dir / "logs" / "dataflow.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return sum(int(m[1]) for m in _DROPPED.finditer(text))


def full_bytes(run_dir: Path) -> int:
    manifests = sorted((run_dir / "weights" / "policy").glob("v*/manifest.json"))
    for path in manifests:
        m = json.loads(path.read_text())
        for f in m["files"]:
            if f["name"] == "full.safetensors":
                return int(f["size"])
    raise SystemExit(f"no full snapshot under {run_dir}/weights")


def scaled_link(run: dict[str, Any], full: int) -> LinkConfig:
    t = float(run["iteration_s"])
    transfer_s = 0.7 * t
    rate_mbit = full * 8 / transfer_s / 1e6
    rtt_ms = PAPER_RTT_SHARE * transfer_s * 1000
    return LinkConfig(delay_ms=round(rtt_ms / 2, 2), rate_mbit=round(rate_mbit, 2))


def _wan_side(store: str, link_json: str, conn: Any) -> None:
    """Child process: the store's weight server behind the link; answers the link's byte
    count when asked, until told to stop."""
    from astraflow.link import Link
    from astraflow.weights.server import serve_in_thread

    link = LinkConfig.model_validate_json(link_json)
    with serve_in_thread(store) as url, Link.for_urls(link, {"weights": url}) as wan:
        conn.send(wan.url("weights"))
        while conn.recv() == "bytes":
            conn.send(sum(wan.stats.down.values()) + sum(wan.stats.up.values()))


@contextlib.contextmanager
def wan_store(store: Path, link: LinkConfig) -> Iterator[tuple[str, Callable[[], int]]]:
    """The store served behind the link from another process (as in a run, where neither
    shares the node's interpreter): its URL, and a function counting the link's bytes."""
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_wan_side, args=(str(store), link.model_dump_json(), theirs))
    proc.start()
    try:
        if not mine.poll(120):
            raise SystemExit("the weight server behind the link did not start")

        def wan_bytes() -> int:
            mine.send("bytes")
            return int(mine.recv())

        yield str(mine.recv()), wan_bytes
    finally:
        with contextlib.suppress(OSError):
            mine.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def replay(run_dir: Path, link: LinkConfig, count: int) -> dict[str, Any]:
    """Pull the run's last versions over the link: full vs delta direct, and via a relay."""
    import torch

    from astraflow.weights import WeightClient
    from astraflow.weights.relay import WeightRelay, serve_relay

    store = run_dir / "weights"
    local = WeightClient(store)
    warm_up_kernels()
    # this process holds torch, transformers and the model it trained: a full collection of
    # that heap (0.1-0.3 s, holding the GIL) would land in whichever pull triggers it
    gc.collect()
    gc.freeze()
    versions = [v for v in _versions(store) if v - 1 in _versions(store)][-count:]
    rows: list[dict[str, Any]] = []
    with wan_store(store, link) as (wan_url, wan_bytes):
        for v in versions:
            row: dict[str, Any] = {"version": v}
            for path, have in (("full", None), ("delta", v - 1)):
                tensors = local.load("policy", v - 1)
                if have is None:
                    tensors = {k: torch.zeros_like(t) for k, t in tensors.items()}
                before, started = wan_bytes(), time.perf_counter()
                with WeightClient(wan_url) as client:
                    stats = client.pull("policy", tensors, have, v)
                row[path] = {"s": time.perf_counter() - started, "wan_bytes": wan_bytes() - before,
                             "path": stats.path, "file_bytes": stats.bytes}  # fmt: skip
            rows.append(row)
        relayed = _relay_rows(local, wan_url, wan_bytes, versions, WeightRelay, serve_relay)
    local.close()
    full = [r["full"]["s"] for r in rows]
    delta = [r["delta"]["s"] for r in rows]
    return {"versions": rows, "relay": relayed,
            "full_s": statistics.mean(full), "delta_s": statistics.mean(delta),
            "delta_speedup": statistics.mean(full) / statistics.mean(delta),
            "delta_file_fraction": statistics.mean(
                r["delta"]["file_bytes"] / r["full"]["file_bytes"] for r in rows)}  # fmt: skip


def warm_up_kernels() -> None:
    """Make (or load) the compiled delta loops before timing: a node does it once, in the
    background, at its first pull (its first delta pull takes numpy's path if they are not
    ready yet)."""
    try:
        from astraflow.weights import kernels
    except ImportError:  # a checkout without them (a baseline)
        return
    started = time.perf_counter()
    ready = kernels.warm(wait=True)
    print(f"delta kernels {'ready' if ready else 'unavailable: numpy path'} in "
          f"{time.perf_counter() - started:.2f} s (once per process)", flush=True)  # fmt: skip


def _versions(store: Path) -> list[int]:
    return sorted(int(p.parent.name[1:]) for p in (store / "policy").glob("v*/manifest.json"))


def _relay_rows(
    local: Any, wan_url: str, wan_bytes: Any, versions: list[int], relay_cls: Any, serve: Any
) -> list[dict[str, Any]]:
    """Through a fresh relay: 1 node pulls one version, then 4 nodes pull the next ones."""
    import tempfile

    out = []
    with tempfile.TemporaryDirectory(prefix="relay-replay-") as root:
        relay = relay_cls(wan_url, root)
        relay.sync("policy", want=versions[0] - 1)  # bootstrap (a full pull), not measured
        with serve(relay) as server:
            for i, v in enumerate(versions):
                nodes = 1 if i % 2 == 0 else 4
                fleet = [local.load("policy", v - 1) for _ in range(nodes)]
                before, started = wan_bytes(), time.perf_counter()
                relay.sync("policy", want=v)
                wan_s = time.perf_counter() - started
                threads = [threading.Thread(target=_pull, args=(server.url, t, v)) for t in fleet]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                out.append({"version": v, "nodes": nodes, "wan_s": wan_s,
                            "total_s": time.perf_counter() - started,
                            "wan_bytes": wan_bytes() - before})  # fmt: skip
        relay.close()
    return out


def _pull(url: str, tensors: dict[str, Any], v: int) -> None:
    from astraflow.weights import WeightClient

    with WeightClient(url) as client:
        client.pull("policy", tensors, v - 1, v)


def plot(out: Path, runs: dict[str, list[dict[str, Any]]], transfer: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cross, base = runs["cross"][0], runs["baseline"][0]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4.5))
    iters = sorted(int(v) for v in cross["samples_per_iteration"])
    bottom = [0] * len(iters)
    for pool, _, _ in POOLS["cross"]:
        ys = [cross["samples_per_iteration"][str(v)].get(pool, 0) for v in iters]
        a.bar(iters, ys, bottom=bottom, label=pool)
        bottom = [x + y for x, y in zip(bottom, ys, strict=True)]
    a.set(title="(a) samples per pool per iteration (cross-region)", xlabel="trainer iteration",
          ylabel="samples in the batch")  # fmt: skip
    a.legend()
    vs = [r["version"] for r in transfer["versions"]]
    b.plot(vs, [r["full"]["s"] for r in transfer["versions"]], "s-",
           label="no weights yet (full + chain), direct")  # fmt: skip
    b.plot(vs, [r["delta"]["s"] for r in transfer["versions"]], "o-", label="delta, direct")
    for nodes in (1, 4):
        rows = [r for r in transfer["relay"] if r["nodes"] == nodes]
        b.plot([r["version"] for r in rows], [r["total_s"] for r in rows], "^",
               label=f"delta via relay, {nodes} node(s)")  # fmt: skip
    for pool, rows in cross["rollout_refresh_s"].items():
        pts = [(to, s) for _, to, s in rows if to >= 1]
        if pts:
            b.plot(*zip(*pts, strict=True), ".", alpha=0.5, label=f"in run: {pool} refresh")
    b.set(title="(b) weight transfer per link and version", xlabel="version", ylabel="seconds",
          yscale="log")  # fmt: skip
    b.legend(fontsize=7)
    start = max(base["steady_from"], cross["steady_from"])  # after every node started
    for run, style in ((base, "--"), (cross, "-")):
        waits = run["trainer_wait_s"]
        xs = list(range(start, len(waits) + 1))
        c.plot(xs, [waits[x - 1] for x in xs], style, label=f"trainer wait, {run['setting']}")
        per_version: dict[int, float] = defaultdict(float)
        for rows in run["rollout_refresh_s"].values():
            for _, to, s in rows:
                per_version[to] += s / len(run["rollout_refresh_s"])
        xs = [x for x in sorted(per_version) if x >= start]
        c.plot(xs, [per_version[x] for x in xs], style, alpha=0.6,
               label=f"rollout refresh per node, {run['setting']}")  # fmt: skip
    c.set(title=f"(c) downtime per iteration (from {start}: every node up)",
          xlabel="trainer iteration", ylabel="seconds")  # fmt: skip
    c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "panels.png", dpi=110)
    fig, ax = plt.subplots(figsize=(6, 4))
    for setting, style in (("baseline", "--"), ("cross", "-")):
        for run in runs[setting]:
            pts = [(v, acc) for v, acc in run["accuracy"] if v is not None and acc is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=f"{setting} {run['seed']}")
    ax.set(title="held-out accuracy", xlabel="version", ylabel="accuracy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=110)


def _spread(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.mean(xs):.3f} ± {(max(xs) - min(xs)) / 2:.3f} (n={len(xs)})"


def report(runs: dict[str, list[dict[str, Any]]], transfer: dict[str, Any], link: LinkConfig,
           fidelity: Any) -> dict[str, Any]:  # fmt: skip
    waits = {s: [r["trainer_wait_mean_s"] for r in runs[s]] for s in runs}
    pairs = zip(waits["cross"], waits["baseline"], strict=False)
    ratios = [c / b for c, b in pairs if c is not None and b]
    one = [r for r in transfer["relay"] if r["nodes"] == 1]
    four = [r for r in transfer["relay"] if r["nodes"] == 4]
    summary = {
        "link": json.loads(link.model_dump_json()),
        "link_fidelity": {"rtt_s": fidelity.rtt_s, "link_rtt_s": fidelity.link_rtt_s,
                          "up_bytes_s": fidelity.up_bytes_s,
                          "down_bytes_s": fidelity.down_bytes_s, "errors": fidelity.errors()},
        "pools_in_every_iteration": [r["pools_in_every_iteration"] for r in runs["cross"]],
        "trainer_wait_mean_s": waits,
        "trainer_wait_ratio_cross_over_baseline": ratios,
        "final_accuracy": {s: [r["final_accuracy"] for r in runs[s]] for s in runs},
        "tokens_per_s": {s: [r["tokens_per_s"] for r in runs[s]] for s in runs},
        "transfer": transfer,
        "relay_wan_bytes_per_version": {
            "1_node": statistics.mean(r["wan_bytes"] for r in one) if one else None,
            "4_nodes": statistics.mean(r["wan_bytes"] for r in four) if four else None,
            "direct_delta_per_node": statistics.mean(
                r["delta"]["wan_bytes"] for r in transfer["versions"]),
        },
        "runs": runs,
    }  # fmt: skip
    print("\n== link (scaled) ==")
    print(fidelity.table())
    print("\n== pools: share of iterations each contributes to (cross) ==")
    for r in runs["cross"]:
        print(f"seed {r['seed']}: " + ", ".join(
            f"{p} {v:.0%}" for p, v in r["pools_in_every_iteration"].items()))  # fmt: skip
    print("\n== tokens/s per pool (measured, nodes' reports) ==")
    for s in runs:
        for r in runs[s]:
            print(f"{s} seed {r['seed']}: " + ", ".join(
                f"{p} {v:.1f}" for p, v in sorted(r["tokens_per_s"].items())))  # fmt: skip
    # the experiment's premise: both settings get the same rollout throughput (a trainer fed
    # by less waits longer, whatever the links do)
    print("\n== rollout in all: tokens/s (the premise: equal in both settings); samples "
          "dropped as stale ==")  # fmt: skip
    for s in runs:
        print(f"{s}: " + ", ".join(
            f"seed {r['seed']} {sum(r['tokens_per_s'].values()):.0f} tokens/s, "
            f"{r['stale_dropped_samples']} dropped" for r in runs[s]))  # fmt: skip
    print("\n== CPU quotas: share of 100 ms periods throttled per node ==")
    for s in runs:
        for r in runs[s]:
            print(f"{s} seed {r['seed']}: " + ", ".join(
                f"{n} {c['nr_throttled'] / max(1, c['nr_periods']):.0%}"
                for n, c in sorted(r["cgroups"].items())))  # fmt: skip
    print("\n== trainer wait per iteration (s) ==")
    print(f"baseline {_spread(waits['baseline'])}  cross {_spread(waits['cross'])}  "
          f"ratio {_spread(ratios)}")  # fmt: skip
    print("\n== final held-out accuracy ==")
    for s in runs:
        print(f"{s}: {_spread(summary['final_accuracy'][s])}")
    rb = summary["relay_wan_bytes_per_version"]
    print("\n== weight transfer over the link (replayed versions) ==")
    print(f"full {transfer['full_s']:.3f} s, delta {transfer['delta_s']:.3f} s: delta "
          f"{transfer['delta_speedup']:.1f}x faster (delta file = "
          f"{transfer['delta_file_fraction']:.1%} of full)")  # fmt: skip
    print(f"WAN bytes per version via relay: 1 node {rb['1_node']}, 4 nodes {rb['4_nodes']} "
          f"(direct: {rb['direct_delta_per_node']:.0f} per node)")  # fmt: skip
    return summary


def adam_store(root: Path, lr: float, versions: int = 4) -> tuple[float, int]:
    """Publish ``versions`` + 1 versions (full and delta each) of the 33.6M-parameter model
    (Llama 512 x 8 layers, vocab 8192; bf16) into the store ``root``: real Adam steps (fp32
    master, batch 128 x 8 tokens). Returns the median step time (s) and the parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from astraflow.weights import WeightStore, WeightStoreConfig

    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    ids = torch.randint(0, 8192, (128, 8), generator=torch.Generator().manual_seed(1))
    steps_s = []
    with WeightStore(root, WeightStoreConfig(full_every=1, keep=versions + 1)) as st:
        st.publish("policy", 0, model.state_dict(), dtype=torch.bfloat16).result()
        for v in range(1, versions + 1):
            started = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps_s.append(time.perf_counter() - started)
            st.publish("policy", v, model.state_dict(), dtype=torch.bfloat16).result()
    return statistics.median(steps_s), sum(p.numel() for p in model.parameters())


def large_transfer(
    out: Path, lr: float, versions: int = 4, iteration_s: float | None = None
) -> dict[str, Any]:
    """The transfer panel at the 33.6M-parameter scale (``adam_store``), each step timed as the
    iteration T (or T given: the link of another machine's speed), the link scaled from T as
    in the runs, then replayed."""
    root = out / "large"
    shutil.rmtree(root, ignore_errors=True)  # a store of an earlier run would refuse version 0
    t, params = adam_store(root / "weights", lr, versions)
    if iteration_s is not None:
        print(f"large: step measured {t:.2f} s; the link is scaled for T = {iteration_s} s")
        t = iteration_s
    full = full_bytes(root)
    link = scaled_link({"iteration_s": t}, full)
    print(f"large: {params / 1e6:.1f}M params, step {t:.2f} s, full {full / 1e6:.1f} MB -> "
          f"rate {link.rate_mbit} Mbit/s, RTT {2 * link.delay_ms} ms", flush=True)  # fmt: skip
    fidelity = measure(link)
    print(fidelity.table(), flush=True)
    result = replay(root, link, versions - 1)
    result |= {"params": params, "iteration_s": t, "link": json.loads(link.model_dump_json()),
               "link_errors": fidelity.errors(), "lr": lr}  # fmt: skip
    rb = [r["wan_bytes"] for r in result["relay"]]
    print(f"large: full {result['full_s']:.2f} s, delta {result['delta_s']:.2f} s: "
          f"{result['delta_speedup']:.1f}x (delta file {result['delta_file_fraction']:.1%} of "
          f"full); relay WAN bytes per version {rb}", flush=True)  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, tiny model, few steps")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--capacity", type=int, default=2, help="tasks per node at once")
    parser.add_argument("--batch", type=int, default=128, help="samples per trainer iteration")
    parser.add_argument(
        "--cpus", type=float, default=1.0,
        help="CPUs of a pool at 100%% (every pool's speed is scaled by it)")  # fmt: skip
    parser.add_argument(
        "--remote-refresh", choices=("lazy", "eager"), default="eager",
        help="remote pools refresh weights only when the staleness bound asks (lazy) or at "
        "every version (eager: a refresh per version can cost them more than an iteration)",
    )  # fmt: skip
    parser.add_argument(
        "--engine-process", action="store_true",
        help="nodes run their engine in a process of its own (`process: true`; the cgroup of "
        "a slowed node takes it too)",
    )  # fmt: skip
    parser.add_argument("--replay", type=int, default=6, help="versions replayed over the link")
    parser.add_argument("--out", default="runs/cross_region")
    parser.add_argument("--replot", metavar="SUMMARY", help="redraw the PNGs of a summary.json")
    parser.add_argument(
        "--large-only", type=float, metavar="LR",
        help="only the 33.6M-parameter transfer replay, after Adam steps at this lr",
    )  # fmt: skip
    parser.add_argument(
        "--iteration-s", type=float, metavar="T",
        help="with --large-only: scale the link for this iteration time instead of the one "
        "measured (e.g. an idle machine's, when this one is loaded)",
    )  # fmt: skip
    args = parser.parse_args()
    if not 0 < args.cpus <= 1:
        parser.error(f"--cpus must be in (0, 1] (CPUs of a pool at 100%), got {args.cpus}")
    if args.batch < 8:
        parser.error(f"--batch must be at least one group (8 samples), got {args.batch}")
    if args.replot:
        done = json.loads(Path(args.replot).read_text())
        plot(Path(args.replot).parent, done["runs"], done["transfer"])
        return
    if args.large_only:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        large = large_transfer(Path(args.out), args.large_only, iteration_s=args.iteration_s)
        (Path(args.out) / "large.json").write_text(json.dumps(large, indent=1) + "\n")
        return
    if args.quick:
        args.seeds, args.steps, args.warmup = 1, 20, 100
        args.hidden, args.layers, args.eval_size, args.replay = 64, 2, 50, 4
        args.lr = 3e-4
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "cross": []}
    link: LinkConfig | None = None
    fidelity = None
    for seed in range(args.seeds):
        for setting in ("baseline", "cross"):
            run_dir = out / f"{setting}-s{seed}-{time.strftime('%H%M%S')}"
            print(f"-- {setting} seed {seed}: {run_dir}", flush=True)
            launch(run_config(setting, seed, args, run_dir, link), args.steps)
            runs[setting].append({"seed": seed, **collect(run_dir, setting)})
            if link is None:
                base = runs["baseline"][0]
                full = full_bytes(run_dir)
                link = scaled_link(base, full)
                print(f"link scaling: iteration {base['iteration_s']:.2f} s, full snapshot "
                      f"{full / 1e6:.2f} MB -> rate {link.rate_mbit} Mbit/s (full in "
                      f"{0.7 * base['iteration_s']:.2f} s = 0.7 T), RTT {2 * link.delay_ms} ms "
                      f"(paper: 4000 Mbit/s, 300 ms; time x{0.7 * base['iteration_s'] / 28:.3f})",
                      flush=True)  # fmt: skip
                fidelity = measure(link)
                print(fidelity.table(), flush=True)
    assert link is not None
    transfer = replay(Path(runs["cross"][0]["run_dir"]), link, args.replay)
    summary = report(runs, transfer, link, fidelity)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(out, runs, transfer)
    print(f"\nwrote {out}/panels.png, {out}/accuracy.png, {out}/summary.json")


if __name__ == "__main__":
    main()
