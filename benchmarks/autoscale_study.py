"""Autoscaling study: the built-in autoscaler vs an MCP client as the pool's maintainer.

The paper had an agent read the dataflow's report and resize the rollout pool. Here the same
load profile runs twice, once per arm:

  (a) autoscaler  the launcher's ``PoolManager`` with ``autoscale.enabled`` (what
                  ``astraflow run`` does with ``autoscale: {enabled: true}``)
  (b) mcp         the autoscaler off; a scripted maintainer that acts ONLY through the
                  ``astraflow mcp`` tools (a real MCP client over stdio to a real
                  ``astraflow mcp`` subprocess): every ``interval_s`` it calls ``report``,
                  follows the dead band (target above observed: +1 node once every started
                  node is seen; below: -1 after the scale-down delay) with ``set_pool_size``,
                  as an agent reading the report would.

What is real and what is simulated:
  real       the dataflow service (HTTP, SQLite, leases, buffers, backpressure, the report and
             its dead-band rule), the launcher's PoolManager (starts/retires nodes to match the
             desired size), the MCP server and client
  SIMULATED  the work: a rollout node is a thread that leases one task at a time and submits
             a group of 4 tiny samples after ``--task-s`` seconds (fixed rate per node); the
             trainer is a thread that takes batches of 16 samples and "trains" for ``step_s``
             seconds per batch. Demand changes with the trainer's speed: step_s is the base
             for the first third of the run, half of it (trainer twice as fast: rollout is the
             bottleneck, waiting spikes) for the second, twice it (trainer slow: rollout has
             surplus, waiting drops) for the last.

Figures (per arm): the timeline of observed, desired and dead-band target nodes and of the
trainer's waiting fraction (the paper's figure), and per phase the mean node count, mean
waiting fraction and the resizes made. Writes ``autoscale_study.png`` and ``.json``.

    .venv/bin/python benchmarks/autoscale_study.py                 # 3 x 50 s phases per arm
    .venv/bin/python benchmarks/autoscale_study.py --quick         # 3 x 4 s, MCP arm only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from astraflow.dataflow.client import DataflowClient
from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.server import ThreadedServer, build_app
from astraflow.launch.config import AutoscaleConfig, PoolSection
from astraflow.launch.pools import PoolManager
from astraflow.records import (
    AckRequest,
    LeaseRequest,
    ReleaseRequest,
    Sample,
    SubmitRequest,
    TakeBatchRequest,
)

TOKEN = "autoscale-study-admin"
POLICY = "solver"
GROUP = 4
BATCH = 16
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Study:
    """The load profile and the control settings shared by both arms."""

    phase_s: float
    task_s: float
    step_s: float
    window_s: float
    interval_s: float
    up_delay_s: float
    down_delay_s: float
    max_nodes: int = 6

    def step_at(self, t: float) -> float:
        """The trainer's seconds per batch at ``t`` seconds into the run."""
        return self.step_s * (1.0, 0.5, 2.0)[min(2, int(t // self.phase_s))]


def dataflow_config(run_dir: Path, s: Study) -> DataflowConfig:
    rows = run_dir.parent / "prompts.jsonl"
    rows.parent.mkdir(parents=True, exist_ok=True)
    rows.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "1+1="}) + "\n"
                            for i in range(2000)))  # fmt: skip
    return DataflowConfig.model_validate({
        "run_dir": str(run_dir),
        "policies": {POLICY: {"vocab_size": 64, "max_staleness": 1000, "max_buffered": 64}},
        "sources": [{"name": "p", "type": "jsonl", "path": str(rows), "id_field": "id",
                     "workflow": "rlvr", "policies": [POLICY], "group_size": GROUP,
                     "epochs": None}],
        "lease": {"ttl_s": 10.0},
        "auth": {"admin": TOKEN},
        "report": {"window_s": s.window_s, "band": [0.1, 0.3],
                   "scale_down_after_s": s.down_delay_s, "min_nodes": 1,
                   "max_nodes": s.max_nodes},
    })  # fmt: skip


def group(task_id: str) -> list[Sample]:
    mask = np.array([0, 0, 0, 1, 1, 1, 1, 1], dtype=np.uint8)
    return [
        Sample(policy=POLICY, task_id=task_id, group_id=task_id, token_ids=np.arange(8),
               loss_mask=mask, logprobs=-0.5 * mask, versions=np.where(mask > 0, 0, -1),
               reward=float(i % 2))
        for i in range(GROUP)
    ]  # fmt: skip


class SimNodes:
    """Rollout nodes as threads; the PoolManager starts and stops them."""

    def __init__(self, url: str, task_s: float) -> None:
        self.url, self.task_s = url, task_s
        self.stops: dict[str, threading.Event] = {}
        self.threads: dict[str, threading.Thread] = {}
        self.n = 0

    def start(self, pool: PoolSection) -> str:
        self.n += 1
        node_id = f"{pool.name}-{self.n}"
        self.stops[node_id] = threading.Event()
        self.threads[node_id] = threading.Thread(target=self._run, args=(node_id, pool.name),
                                                 daemon=True)  # fmt: skip
        self.threads[node_id].start()
        return node_id

    def stop(self, node_id: str) -> None:
        self.stops[node_id].set()

    def alive(self, node_id: str) -> bool:
        return self.threads[node_id].is_alive()

    def _run(self, node_id: str, pool: str) -> None:
        stop = self.stops[node_id]
        held: list[dict[str, Any]] = []
        with DataflowClient(self.url, token=TOKEN, timeout_s=30) as c:
            while not stop.is_set():
                reply = c.lease(LeaseRequest(node_id=node_id, pool=pool, capacity=1,
                                             workflows=["rlvr"]))  # fmt: skip
                if not reply.tasks:
                    stop.wait(min(0.5, max(0.05, reply.retry_after_s)))
                    continue
                task = reply.tasks[0]
                secret = reply.secrets[task.task_id]
                if stop.wait(self.task_s):  # retired mid-task: hand the lease back
                    held = [{"task_id": task.task_id, "attempt": task.attempt, "secret": secret}]
                    break
                c.submit(SubmitRequest(node_id=node_id, task_id=task.task_id,
                                       attempt=task.attempt, secret=secret,
                                       samples=group(task.task_id)))  # fmt: skip
            # a graceful stop: the node leaves the active count at once
            c.release(ReleaseRequest.model_validate({"node_id": node_id, "leases": held}))

    def close(self) -> None:
        for stop in self.stops.values():
            stop.set()
        for t in self.threads.values():
            t.join(timeout=30)


def trainer(url: str, s: Study, t0: float, stop: threading.Event) -> None:
    with DataflowClient(url, token=TOKEN, timeout_s=30) as c:
        while not stop.is_set():
            batch = c.take_batch(TakeBatchRequest(policy=POLICY, trainer_id="trainer",
                                                  trainer_version=0, min_samples=BATCH,
                                                  max_samples=BATCH, timeout_s=1.0))  # fmt: skip
            if batch is None:
                continue
            stop.wait(s.step_at(time.monotonic() - t0))
            c.ack(AckRequest(batch_id=batch.batch_id))


# --------------------------------------------------------------------------- the MCP maintainer


def dead_band_step(pool: dict[str, Any], since_s: float, s: Study) -> int:
    """What a maintainer following the report's dead band does: +1, 0 or -1 node."""
    observed, desired, target = pool["nodes"], pool["desired_nodes"], pool["target_nodes"]
    if desired is None or target is None:
        return 0
    if target > observed and desired <= observed and since_s >= s.up_delay_s:
        return +1 if desired < s.max_nodes else 0  # grow only once every started node is seen
    if target < observed and desired >= observed and since_s >= s.down_delay_s:
        return -1 if desired > 1 else 0
    return 0


async def maintain(url: str, s: Study, ready: threading.Event, stop: threading.Event,
                   log: list[dict[str, Any]]) -> None:  # fmt: skip
    """An MCP client over stdio to ``astraflow mcp``: read the report, resize by the band."""
    from mcp import Client, StdioServerParameters

    env = {
        **os.environ,
        "ASTRAFLOW_ADMIN_TOKEN": TOKEN,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    params = StdioServerParameters(
        command=sys.executable, env=env,
        args=["-m", "astraflow.cli.main", "mcp", "--dataflow", url, "--poll-s", "0"],
    )  # fmt: skip
    async with Client(params, cache=None) as client:
        tools = {t.name for t in (await client.list_tools()).tools}
        assert {"report", "set_pool_size"} <= tools, tools
        ready.set()
        last = time.monotonic()
        while not stop.is_set():
            got = await client.call_tool("report", {})
            pool = (got.structured_content or {}).get("pools", {}).get("local")
            step = 0 if got.is_error or pool is None else dead_band_step(
                pool, time.monotonic() - last, s)  # fmt: skip
            if step:
                reason = f"dead band: target {pool['target_nodes']}, observed {pool['nodes']}"
                done = await client.call_tool("set_pool_size", {"pool": "local", "delta": step,
                                                                "reason": reason})  # fmt: skip
                log.append({"t": time.time(), "delta": step, "error": done.is_error,
                            "reply": done.structured_content, "reason": reason})  # fmt: skip
                last = time.monotonic()
            await asyncio.sleep(s.interval_s)


# --------------------------------------------------------------------------- one arm


def record(url: str, t0: float, stop: threading.Event, out: list[dict[str, Any]]) -> None:
    with DataflowClient(url, token=TOKEN, timeout_s=30) as c:
        while not stop.wait(1.0):
            r = c.report()
            pool = r.pools.get("local")
            out.append({
                "t": round(time.monotonic() - t0, 2),
                "observed": 0 if pool is None else pool.nodes,
                "desired": None if pool is None else pool.desired_nodes,
                "target": None if pool is None else pool.target_nodes,
                "waiting": r.target.waiting_fraction,
                "acked_samples": r.policies[POLICY].acked_samples,
            })  # fmt: skip


def run_arm(arm: str, s: Study, tmp: Path) -> dict[str, Any]:
    server = ThreadedServer(build_app(dataflow_config(tmp / arm / "df", s)))
    url = server.start()
    nodes = SimNodes(url, s.task_s)
    stop = threading.Event()
    resizes: list[dict[str, Any]] = []
    side: list[threading.Thread] = []
    if arm == "mcp":
        ready = threading.Event()
        side.append(
            threading.Thread(
                target=lambda: asyncio.run(maintain(url, s, ready, stop, resizes)), daemon=True
            )
        )
        side[-1].start()
        if not ready.wait(120):
            raise RuntimeError("astraflow mcp did not come up")
    autoscale = AutoscaleConfig(enabled=arm == "autoscaler", interval_s=s.interval_s,
                                scale_up_delay_s=s.up_delay_s,
                                scale_down_delay_s=s.down_delay_s)  # fmt: skip
    pool = PoolSection(name="local", nodes=1, min_nodes=1, max_nodes=s.max_nodes, capacity=1)
    timeline: list[dict[str, Any]] = []
    with DataflowClient(url, token=TOKEN, timeout_s=30) as client:
        manager = PoolManager(client, [pool], nodes.start, nodes.stop, nodes.alive, autoscale)
        manager.start()
        t0 = time.monotonic()
        for fn, args in ((trainer, (url, s, t0, stop)), (record, (url, t0, stop, timeline))):
            side.append(threading.Thread(target=fn, args=args, daemon=True))
            side[-1].start()
        while time.monotonic() - t0 < 3 * s.phase_s:
            manager.tick()
            time.sleep(0.5)
        stop.set()
        manager.closing = True
        for t in side:
            t.join(timeout=60)
        nodes.close()
    server.stop()
    if arm == "autoscaler":
        resizes = [{"reason": d} for d in manager.decisions]
    return {"arm": arm, "timeline": timeline, "resizes": resizes,
            "phases": phase_summary(timeline, s)}  # fmt: skip


def phase_summary(timeline: list[dict[str, Any]], s: Study) -> list[dict[str, Any]]:
    """Per phase: mean nodes, mean waiting, nodes at its end, samples trained per second."""
    out = []
    for i, name in enumerate(("base", "trainer 2x faster", "trainer 2x slower")):
        rows = [r for r in timeline if i * s.phase_s <= r["t"] < (i + 1) * s.phase_s]
        if not rows:
            continue
        waits = [r["waiting"] for r in rows if r["waiting"] is not None]
        span = max(rows[-1]["t"] - rows[0]["t"], 1e-9)
        out.append({
            "phase": name, "step_s": s.step_at(i * s.phase_s),
            "mean_nodes": round(float(np.mean([r["observed"] for r in rows])), 2),
            "end_nodes": rows[-1]["observed"],
            "mean_waiting": None if not waits else round(float(np.mean(waits)), 3),
            "samples_per_s": round((rows[-1]["acked_samples"] - rows[0]["acked_samples"]) / span,
                                   1),
        })  # fmt: skip
    return out


# --------------------------------------------------------------------------- output


def plot(results: list[dict[str, Any]], s: Study, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 6), squeeze=False,
                             sharex=True)  # fmt: skip
    for col, res in enumerate(results):
        tl = res["timeline"]
        t = [r["t"] for r in tl]
        top, bottom = axes[0][col], axes[1][col]
        top.step(t, [r["observed"] for r in tl], where="post", label="observed nodes")
        top.step(t, [r["desired"] for r in tl], where="post", ls="--", label="desired")
        top.plot(t, [r["target"] for r in tl], ".", ms=3, label="dead-band target")
        top.set_title(f"({'ab'[col] if len(results) > 1 else 'b'}) {res['arm']}")
        top.set_ylabel("nodes")
        bottom.plot(t, [r["waiting"] for r in tl], label="trainer waiting")
        bottom.axhspan(0.1, 0.3, color="green", alpha=0.15, label="band")
        bottom.set_ylabel("waiting fraction")
        bottom.set_xlabel("seconds")
        for ax in (top, bottom):
            for k in (1, 2):
                ax.axvline(k * s.phase_s, color="grey", lw=0.8)
            ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("trainer step x1 | x0.5 (faster: more demand) | x2 (slower: less demand)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 x 4 s phases, MCP arm only")
    p.add_argument("--arms", default=None, help="comma list of autoscaler,mcp")
    p.add_argument("--phase-s", type=float, default=None)
    p.add_argument("--out", default="autoscale_study", help="output stem (.png, .json)")
    args = p.parse_args(argv)
    if args.quick:
        s = Study(phase_s=4, task_s=0.3, step_s=0.4, window_s=3, interval_s=1, up_delay_s=1.5,
                  down_delay_s=3)  # fmt: skip
    else:
        s = Study(phase_s=50, task_s=0.5, step_s=0.8, window_s=8, interval_s=2, up_delay_s=4,
                  down_delay_s=10)  # fmt: skip
    if args.phase_s:
        s = Study(**{**s.__dict__, "phase_s": args.phase_s})
    arms = (args.arms or ("mcp" if args.quick else "autoscaler,mcp")).split(",")
    if not set(arms) <= {"autoscaler", "mcp"}:
        p.error(f"--arms takes autoscaler and/or mcp, got {args.arms!r}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for arm in arms:
            started = time.monotonic()
            res = run_arm(arm, s, Path(tmp))
            res["wall_s"] = round(time.monotonic() - started, 1)
            results.append(res)
            print(f"\n{arm}: {len(res['resizes'])} resizes, wall {res['wall_s']} s")
            print(f"  {'phase':<20}{'step_s':>7}{'mean nodes':>11}{'end':>5}"
                  f"{'mean waiting':>13}{'samples/s':>10}")  # fmt: skip
            for ph in res["phases"]:
                w = "-" if ph["mean_waiting"] is None else f"{ph['mean_waiting']:.2f}"
                print(f"  {ph['phase']:<20}{ph['step_s']:>7.2f}{ph['mean_nodes']:>11.2f}"
                      f"{ph['end_nodes']:>5}{w:>13}{ph['samples_per_s']:>10.1f}")  # fmt: skip
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(
        {"study": s.__dict__, "band": [0.1, 0.3], "arms": results}, indent=1))  # fmt: skip
    plot(results, s, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.png')} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
