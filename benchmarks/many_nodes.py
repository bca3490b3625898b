"""The many-nodes mode of ``dataflow_load.py``: P node processes x M asyncio node loops each.

Each loop is one node as ``raas/node.py`` runs it: its own async HTTP client, lease, then one
submit per leased task, again. Every reply carries the service's ``Server-Timing`` (time in
the handler, waiting for the writer thread, running on it), so each route's latency splits
into: outside the service's handler (client event loop, connection, uvicorn's loop) | waiting
for the writer | the writer (SQLite and the rules).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from typing import Any

import httpx
import numpy as np

from astraflow.dataflow.client import ssl_context  # one TLS context, as the node's client
from astraflow.records import MSGPACK_MEDIA_TYPE

JSON = {"content-type": "application/json"}
MSGPACK = {"content-type": MSGPACK_MEDIA_TYPE}
Timing = tuple[float, float, float, float, float]
"""(wall time, client latency, handler, writer wait, writer run) in seconds."""


def _timing(resp: httpx.Response, t0: float) -> Timing:
    parts = {}
    for item in resp.headers.get("server-timing", "").split(","):
        name, _, dur = item.strip().partition(";dur=")
        if dur:
            parts[name] = float(dur) / 1e3
    return (time.time(), time.perf_counter() - t0, parts.get("app", 0.0),
            parts.get("writer-wait", 0.0), parts.get("writer", 0.0))  # fmt: skip


async def _node(
    url: str, node: str, args: dict[str, Any], stop_at: float, raw: Any, out: dict[str, Any]
) -> None:
    from dataflow_load import body_for  # the same payload as the process mode

    lease = f'{{"node_id":"{node}","capacity":1,"workflows":["bench"]}}'.encode()
    async with httpx.AsyncClient(base_url=url, timeout=120, verify=ssl_context()) as http:
        while time.time() < stop_at:
            t0 = time.perf_counter()
            r = await http.post("/v1/lease", content=lease, headers=JSON)
            out["lease"].append(_timing(r, t0))
            reply = r.json()
            if not reply.get("tasks"):
                await asyncio.sleep(min(0.05, reply.get("retry_after_s", 0.05)))
                continue
            for task in reply["tasks"]:
                body = body_for(raw, node, task["task_id"], task["attempt"],
                                reply["secrets"][task["task_id"]])  # fmt: skip
                t0 = time.perf_counter()
                r = await http.post("/v1/submit", content=body, headers=MSGPACK)
                out["submit"].append(_timing(r, t0))
                if r.status_code == 200:
                    out["accepted"].append(time.time())


def many_worker(url: str, name: str, loops: int, args: dict[str, Any], end: Any, q: Any) -> None:
    """One node process: ``loops`` node loops on one event loop, from when the parent sets
    ``end`` (a shared double: the wall time to stop at) until then."""
    from dataflow_load import template

    raw = template(args["group"], args["tokens"], args["vocab"])
    q.put("ready")
    while end.value == 0:
        time.sleep(0.02)
    stop_at = float(end.value)
    out: dict[str, Any] = {"lease": [], "submit": [], "accepted": []}
    cpu0, wall0 = time.process_time(), time.time()

    async def run() -> None:
        results = await asyncio.gather(
            *(_node(url, f"{name}-{i}", args, stop_at, raw, out) for i in range(loops)),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            print(f"{name}: {len(errors)} node loops failed, first: {errors[0]!r}", flush=True)

    asyncio.run(run())
    cpu = ("nodes", time.process_time() - cpu0, time.time() - wall0)
    timings = {k: out[k] for k in ("lease", "submit")}
    q.put({"timings": timings, "accepted": out["accepted"], "lat": {}, "cpu": cpu})


def print_many(
    args: Any, res: list[dict[str, Any]], cpu: list[float], lo: float, hi: float
) -> None:
    """Throughput, per-route p50/p99 split by where the time went, and the service's CPU."""
    duration = hi - lo
    accepted = sum(lo <= t <= hi for r in res for t in r.get("accepted", []))
    print(f"submits accepted: {accepted / duration:,.0f}/s "
          f"({accepted * args.group / duration:,.0f} samples/s)\n")  # fmt: skip
    head = ("route", "calls/s", "p50 ms", "p99 ms", "handler p99", "writer-wait p99",
            "writer p99", "outside p99")  # fmt: skip
    print("{:8} {:>8} {:>8} {:>8} {:>12} {:>16} {:>11} {:>12}".format(*head))
    for route in ("lease", "submit"):
        rows = np.array([t for r in res for t in r.get("timings", {}).get(route, [])
                         if lo <= t[0] <= hi]).reshape(-1, 5)  # fmt: skip
        if not len(rows):
            continue
        ms = rows[:, 1:] * 1e3
        outside = ms[:, 0] - ms[:, 1]
        p = np.percentile
        print(f"{route:8} {len(rows) / duration:>8,.0f} {p(ms[:, 0], 50):>8.1f} "
              f"{p(ms[:, 0], 99):>8.1f} {p(ms[:, 1], 99):>12.1f} {p(ms[:, 2], 99):>16.1f} "
              f"{p(ms[:, 3], 99):>11.1f} {p(outside, 99):>12.1f}")  # fmt: skip
    used = (cpu[1] - cpu[0]) / duration if len(cpu) == 2 else float("nan")
    load = sum(r["cpu"][1] / r["cpu"][2] for r in res if r["cpu"][0] == "nodes")
    print(f"\nservice CPU: {used:.2f} cores; node processes' CPU: {load:.2f} cores "
          "(same machine: what they use, the service cannot)")  # fmt: skip


def drive_many(
    url: str, pid: int, args: Any, shared: dict[str, Any], duration: float, warmup: float
) -> tuple[list[dict[str, Any]], list[float], float, float]:
    """Start the node processes and a trainer; open the window once every process is ready
    (starting 100s of loops on a busy machine takes a while); results, service CPU, window."""
    from dataflow_load import cpu_seconds, trainer_worker

    ctx = mp.get_context("spawn")
    out, end = ctx.Queue(), ctx.Value("d", 0.0)
    loops = -(-args.nodes // args.procs)
    procs = [ctx.Process(target=many_worker, args=(url, f"p{i}", loops, shared, end, out))
             for i in range(args.procs)]  # fmt: skip
    for p in procs:
        p.start()
    for _ in procs:
        assert out.get(timeout=600) == "ready"
    lo = time.time() + warmup
    hi = lo + duration
    end.value = hi + 0.2
    trainer = ctx.Process(target=trainer_worker, args=(url, shared, hi + 0.2, out))
    trainer.start()
    time.sleep(max(0.0, lo - time.time()))
    cpu = [cpu_seconds(pid)]
    time.sleep(max(0.0, hi - time.time()))
    cpu.append(cpu_seconds(pid))
    res = [out.get(timeout=600) for _ in range(len(procs) + 1)]
    for p in [*procs, trainer]:
        p.join(30)
    return res, cpu, lo, hi
