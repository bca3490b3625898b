"""Load benchmark of the dataflow service: N rollout-node processes and a trainer, real HTTP.

    nodes (processes) ──lease / submit (msgpack, G x T-token samples)──► dataflow service
    trainer (process) ──take_batch (B samples) / ack──────────────────►  (subprocess, SQLite)

Prints sustained samples/s (accepted and consumed), p50/p99 latency per endpoint, the
service's CPU use, and two baselines measured in the same run with the same payload: the raw
HTTP round trip to a no-op endpoint on the same server stack (uvicorn + Starlette), and raw
SQLite inserts of the same blobs (WAL, one transaction per group). Target (issue 2): at least
2,000 samples/s of 2k-token samples with p99 submit under 100 ms.

    .venv/bin/python benchmarks/dataflow_load.py            # 20 s, 4 nodes
    .venv/bin/python benchmarks/dataflow_load.py --quick    # 5 s
    .venv/bin/python benchmarks/dataflow_load.py --nodes 256 --procs 8   # many-nodes mode

Many-nodes mode (more nodes than processes: ``many_nodes.py``): each of ``--procs`` processes
runs nodes / procs asyncio node loops (each with its own client, as a node does); it prints
throughput, p50/p99 per route split by where the time went (``Server-Timing``), and the
service's CPU. The baselines are skipped.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np

from astraflow.dataflow.client import DataflowClient
from astraflow.records import (
    MSGPACK_MEDIA_TYPE,
    AckRequest,
    DataflowReport,
    LeaseRequest,
    Sample,
    SubmitRequest,
    TakeBatchRequest,
    pack,
)
from many_nodes import drive_many, print_many

POLICY = "solver"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def template(group: int, tokens: int, vocab: int) -> dict[str, Any]:
    """A realistic submission (prompt 1/4 of the tokens) as a msgpack-ready dict."""
    rng = np.random.default_rng(0)
    prompt = tokens // 4
    mask = np.r_[np.zeros(prompt), np.ones(tokens - prompt)].astype(np.uint8)
    samples = [
        Sample(
            policy=POLICY,
            task_id="t",
            group_id="t",
            token_ids=rng.integers(0, vocab, tokens),
            loss_mask=mask,
            logprobs=-rng.random(tokens).astype(np.float32) * mask,
            versions=np.where(mask > 0, 0, -1),
            reward=float(i % 2),
            meta={"node": "bench", "turns": 1},
        )
        for i in range(group)
    ]
    req = SubmitRequest(node_id="n", task_id="t", attempt=0, secret="0" * 32, samples=samples)
    raw: dict[str, Any] = msgpack.unpackb(pack(req))
    return raw


def body_for(raw: dict[str, Any], node: str, task_id: str, attempt: int, secret: str) -> bytes:
    raw["node_id"], raw["task_id"], raw["attempt"], raw["secret"] = node, task_id, attempt, secret
    for s in raw["samples"]:
        s["task_id"] = s["group_id"] = task_id
    return bytes(msgpack.packb(raw, use_bin_type=True))


# --------------------------------------------------------------------------- workers


def node_worker(url: str, name: str, args: dict[str, Any], stop_at: float, out: Any) -> None:
    """Lease tasks, submit one group per task (pre-encoded payload), record latencies."""
    raw = template(args["group"], args["tokens"], args["vocab"])
    lat: dict[str, list[tuple[float, float]]] = {"lease": [], "submit": []}
    accepted: list[float] = []
    headers = {"content-type": MSGPACK_MEDIA_TYPE}
    cpu0, wall0 = time.process_time(), time.time()
    with DataflowClient(url, timeout_s=30) as c, httpx.Client(base_url=url, timeout=30) as http:
        while time.time() < stop_at:
            t0 = time.perf_counter()
            reply = c.lease(
                LeaseRequest(node_id=name, capacity=args["capacity"], workflows=["bench"])
            )
            lat["lease"].append((time.time(), time.perf_counter() - t0))
            if not reply.tasks:
                time.sleep(min(0.05, reply.retry_after_s))
                continue
            for task in reply.tasks:
                body = body_for(raw, name, task.task_id, task.attempt, reply.secrets[task.task_id])
                t0 = time.perf_counter()
                r = http.post("/v1/submit", content=body, headers=headers)
                lat["submit"].append((time.time(), time.perf_counter() - t0))
                r.raise_for_status()
                accepted.append(time.time())
    out.put(
        {
            "lat": lat,
            "accepted": accepted,
            "cpu": ("nodes", time.process_time() - cpu0, time.time() - wall0),
        }
    )


def trainer_worker(url: str, args: dict[str, Any], stop_at: float, out: Any) -> None:
    """Take batches of whole groups and ack them at once; record latencies and consumption."""
    lat: dict[str, list[tuple[float, float]]] = {"take": [], "ack": []}
    consumed: list[tuple[float, int]] = []
    cpu0, wall0 = time.process_time(), time.time()
    with DataflowClient(url, timeout_s=30) as c:
        while time.time() < stop_at:
            t0 = time.perf_counter()
            batch = c.take_batch(
                TakeBatchRequest(
                    policy=POLICY,
                    trainer_version=0,
                    min_samples=args["batch"],
                    max_samples=args["batch"],
                    timeout_s=2,
                )
            )
            lat["take"].append((time.time(), time.perf_counter() - t0))
            if batch is None:
                continue
            t0 = time.perf_counter()
            c.ack(AckRequest(batch_id=batch.batch_id))
            lat["ack"].append((time.time(), time.perf_counter() - t0))
            consumed.append((time.time(), len(batch.samples)))
    out.put(
        {
            "lat": lat,
            "consumed": consumed,
            "cpu": ("trainer", time.process_time() - cpu0, time.time() - wall0),
        }
    )


def noop_client(url: str, body: bytes, stop_at: float, out: Any) -> None:
    """POST the submit payload to a no-op endpoint as fast as possible."""
    lat: list[tuple[float, float]] = []
    with httpx.Client(base_url=url, timeout=30) as http:
        while time.time() < stop_at:
            t0 = time.perf_counter()
            http.post("/noop", content=body, headers={"content-type": MSGPACK_MEDIA_TYPE})
            lat.append((time.time(), time.perf_counter() - t0))
    out.put({"lat": {"noop": lat}})


def noop_server(port: int) -> None:
    """The baseline server: same stack (uvicorn + Starlette), reads the body, answers {}."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def noop(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({})

    app = Starlette(routes=[Route("/noop", noop, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --------------------------------------------------------------------------- harness


def wait_healthy(url: str, path: str, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(300):
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            httpx.request("GET" if path.startswith("/v1") else "POST", url + path, timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.05)
    raise SystemExit("server did not start")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_workers(targets: list[tuple[Any, tuple[Any, ...]]], stop_at: float) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*a, stop_at, out)) for fn, a in targets]
    for p in procs:
        p.start()
    results = [out.get(timeout=stop_at - time.time() + 120) for _ in procs]
    for p in procs:
        p.join(30)
    return results


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def in_window(pairs: list[tuple[float, float]], lo: float, hi: float) -> list[float]:
    return [v for t, v in pairs if lo <= t <= hi]


def sqlite_baseline(blob: bytes, seconds: float, tmp: Path) -> tuple[float, list[float]]:
    """Groups/s and latencies inserting the same blob, one WAL transaction per group."""
    db = sqlite3.connect(tmp / "baseline.sqlite", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("CREATE TABLE blobs(gid INTEGER PRIMARY KEY, meta TEXT, data BLOB)")
    lat = []
    end = time.time() + seconds
    while time.time() < end:
        t0 = time.perf_counter()
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT INTO blobs(meta, data) VALUES(?, ?)", ("{}", blob))
        db.execute("COMMIT")
        lat.append(time.perf_counter() - t0)
    db.close()
    return len(lat) / seconds, lat


def write_config(tmp: Path, args: argparse.Namespace, port: int) -> Path:
    rows = tmp / "tasks.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": f"p{i}"}) + "\n" for i in range(5000)))
    config = {
        "run_dir": str(tmp / "run"),
        "port": port,
        "policies": {
            POLICY: {
                "vocab_size": args.vocab,
                "max_staleness": 4,
                "max_buffered": args.max_buffered,
            }
        },
        "sources": [
            {
                "name": "bench",
                "type": "jsonl",
                "path": str(rows),
                "workflow": "bench",
                "policies": [POLICY],
                "group_size": args.group,
                "epochs": None,
            }
        ],
        "lease": {"ttl_s": 120},
    }
    path = tmp / "dataflow.yaml"
    path.write_text(json.dumps(config))
    return path


Row = tuple[str, str, str, str, str]


def row(name: str, per_s: float, lat: list[float], note: str) -> Row:
    return (name, f"{per_s:,.0f}", f"{pct(lat, 50):.2f}", f"{pct(lat, 99):.2f}", note)


def http_baseline(args: argparse.Namespace, body: bytes, secs: float) -> Row:
    """The same payload POSTed to a no-op endpoint on the same server stack."""
    port = free_port()
    srv = subprocess.Popen([sys.executable, __file__, "--noop-server", str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, "/noop", srv)
        start = time.time()
        res = run_workers([(noop_client, (url, body))] * args.nodes, start + secs + 1)
        lat = [v for r in res for v in in_window(r["lat"]["noop"], start + 1, start + 1 + secs)]
    finally:
        srv.terminate()
        srv.wait(10)
    n = len(lat) / secs
    return row("baseline: http no-op, same payload", n * args.group, lat, f"{n:,.0f} req/s")


def dataflow_load(
    args: argparse.Namespace, tmp: Path, duration: float, warmup: float
) -> tuple[list[dict[str, Any]], list[float], DataflowReport, float, float]:
    """Run nodes and a trainer against a real service; returns results, CPU samples, report."""
    port = free_port()
    config = write_config(tmp, args, port)
    cmd = [sys.executable, "-m", "astraflow.cli.main", "dataflow", "serve",
           "--config", str(config), "--log-level", "WARNING"]  # fmt: skip
    shared = {k: getattr(args, k) for k in ("group", "tokens", "batch", "capacity", "vocab")}
    srv = subprocess.Popen(cmd)
    cpu: list[float] = []
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, "/v1/health", srv)
        if args.procs < args.nodes:  # many-nodes mode: the window opens once all loops run
            res, cpu, lo, hi = drive_many(url, srv.pid, args, shared, duration, warmup)
            with DataflowClient(url) as c:
                return res, cpu, c.report(), lo, hi
        start = time.time()
        lo, hi = start + warmup, start + warmup + duration

        def sample_cpu() -> None:  # the service's CPU seconds at both ends of the window
            for t in (lo, hi):
                time.sleep(max(0.0, t - time.time()))
                cpu.append(cpu_seconds(srv.pid))

        sampler = threading.Thread(target=sample_cpu)
        sampler.start()
        targets: list[tuple[Any, tuple[Any, ...]]] = [
            (node_worker, (url, f"node{i}", shared)) for i in range(args.nodes)
        ]
        targets.append((trainer_worker, (url, shared)))
        res = run_workers(targets, hi + 0.5)
        sampler.join()
        with DataflowClient(url) as c:
            report = c.report()
    finally:
        srv.terminate()
        srv.wait(30)
    return res, cpu, report, lo, hi


def print_results(
    args: argparse.Namespace, rows: list[Row], res: list[dict[str, Any]], cpu: list[float],
    report: DataflowReport, lo: float, hi: float,
) -> None:  # fmt: skip
    duration = hi - lo
    accepted = sum(lo <= t <= hi for r in res for t in r.get("accepted", []))
    consumed = sum(n for r in res for t, n in r.get("consumed", []) if lo <= t <= hi)
    lat: dict[str, list[float]] = {}
    for r in res:
        for k, pairs in r["lat"].items():
            lat.setdefault(k, []).extend(in_window(pairs, lo, hi))
    rate = accepted * args.group / duration
    rows.append(row("dataflow: submitted (accepted)", rate, lat["submit"],
                    f"{accepted / duration:,.0f} submits/s"))  # fmt: skip
    rows.append(row("dataflow: consumed by the trainer", consumed / duration, [],
                    f"batches of {args.batch}"))  # fmt: skip
    print(f"{'phase':40} {'samples/s':>10} {'p50 ms':>8} {'p99 ms':>8}  note")
    for name, per_s, p50, p99, note in rows:
        print(f"{name:40} {per_s:>10} {p50:>8} {p99:>8}  {note}")
    print(f"\n{'endpoint':12} {'calls':>7} {'p50 ms':>8} {'p99 ms':>8}")
    for k in ("lease", "submit", "take", "ack"):
        v = lat.get(k, [])
        print(f"{k:12} {len(v):>7} {pct(v, 50):>8.2f} {pct(v, 99):>8.2f}")
    used = (cpu[1] - cpu[0]) / duration if len(cpu) == 2 else float("nan")
    print(f"\nservice CPU: {used:.2f} cores ({used * 100:.0f}% of one core) over the window")
    load: dict[str, float] = {}
    for r in res:
        who, secs, wall = r["cpu"]
        load[who] = load.get(who, 0.0) + secs / wall
    print("load generators' CPU: " + ", ".join(f"{k} {v:.2f} cores" for k, v in load.items())
          + " (same machine: what they use, the service cannot)")  # fmt: skip
    waiting = max((t.waiting_fraction for t in report.trainers.values()), default=float("nan"))
    pol = report.policies[POLICY]
    print(f"trainer waiting fraction {waiting:.2f}; buffered at end {pol.buffered_samples} "
          f"samples; stale-dropped {pol.stale_dropped_samples}")  # fmt: skip
    p99 = pct(lat["submit"], 99)
    met = "MET" if rate >= 2000 and p99 < 100 else "NOT MET"
    print(f"target >= 2,000 samples/s sustained with p99 submit < 100 ms: {met} "
          f"({rate:,.0f} samples/s, p99 {p99:.1f} ms)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nodes", type=int, default=4, help="rollout nodes (default 4)")
    p.add_argument("--procs", type=int, default=0,
                   help="node processes (default: one per node, at most 8); fewer processes "
                        "than nodes runs the many-nodes mode")  # fmt: skip
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load (default 20)")
    p.add_argument("--quick", action="store_true", help="5 s of load, shorter baselines")
    p.add_argument("--group", type=int, default=8, help="samples per submitted group (8)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per sample (2048)")
    p.add_argument("--batch", type=int, default=256, help="samples per trainer batch (256)")
    p.add_argument("--capacity", type=int, default=8, help="tasks a node leases per call (8)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (32000)")
    p.add_argument("--max-buffered", type=int, default=8192, help="policy buffer cap (8192)")
    p.add_argument("--noop-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.noop_server:
        noop_server(args.noop_server)
        return
    duration = 5.0 if args.quick else args.duration
    warmup = min(2.0, duration / 4)
    args.procs = args.procs or min(args.nodes, 8)
    if args.procs < args.nodes:
        run_many(args, duration, warmup)
        return
    body = body_for(template(args.group, args.tokens, args.vocab), "n", "t", 0, "0" * 32)
    blob = b"".join(pack(s) for s in SubmitRequest.model_validate(msgpack.unpackb(body)).samples)
    print(f"dataflow load benchmark: {args.nodes} node processes, groups of {args.group} x "
          f"{args.tokens} tokens ({len(body) / 1e3:.0f} kB per submit), trainer batches of "
          f"{args.batch}, {duration:.0f} s (+{warmup:.0f} s warm-up excluded), "
          f"{os.cpu_count()} CPU cores")  # fmt: skip
    print("note: every process shares this machine's cores; on a busy machine figures vary\n")
    with tempfile.TemporaryDirectory(prefix="astraflow-bench-") as d:
        tmp = Path(d)
        rate, lat = sqlite_baseline(blob, 2.0 if args.quick else 4.0, tmp)
        rows = [row("baseline: sqlite insert, 1 txn/group", rate * args.group, lat,
                    f"{rate:,.0f} groups/s")]  # fmt: skip
        rows.append(http_baseline(args, body, duration / 2))
        res, cpu, report, lo, hi = dataflow_load(args, tmp, duration, warmup)
    print_results(args, rows, res, cpu, report, lo, hi)


def run_many(args: argparse.Namespace, duration: float, warmup: float) -> None:
    """The many-nodes mode: no baselines; routes split by where their time went."""
    loops = -(-args.nodes // args.procs)
    print(f"dataflow load benchmark, many-nodes mode: {args.procs} node processes x {loops} "
          f"node loops = {args.procs * loops} nodes, groups of {args.group} x {args.tokens} "
          f"tokens, trainer batches of {args.batch}, {duration:.0f} s (+{warmup:.0f} s warm-up "
          f"excluded), {os.cpu_count()} CPU cores")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="astraflow-bench-") as d:
        res, cpu, _, lo, hi = dataflow_load(args, Path(d), duration, warmup)
    print_many(args, res, cpu, lo, hi)


if __name__ == "__main__":
    main()
