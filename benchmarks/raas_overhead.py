"""Generation tokens/s through a rollout node vs calling its engine directly.

Same model, same engine config (max batch = ``batch`` tasks x ``group`` completions), same
prompts, same sampling with the same seeds (seeded sampling in the transformers engine does
not depend on batch composition, so both paths generate the same tokens). The baseline sends
each round's whole batch to ``engine.generate`` at once; the node path is the real thing: a
dataflow service in its own process (``astraflow dataflow serve``), the node in this process
leasing, running ``rlvr`` (prompt, generate, reward), submitting over HTTP. Two node rows:
capacity = one engine batch (lease, generate, submit, lease ... in turn), and capacity = two
batches (the default deployment shape: one wave submits and leases while the other
generates). Overhead = 1 - node tokens/s / direct tokens/s (target < 5%).

A second table (``--endpoint``) measures the node's OpenAI-compatible agent endpoint: the
same chat prompts sent by ``batch x group`` concurrent ``openai.AsyncOpenAI`` clients to
``/v1/chat/completions`` (SDK request building and reply parsing, render, token capture,
reply) against the same rendered prompt ids sent straight to ``PolicyHandle.generate`` on
the same engine (same config for every row), with the same seeds, so every path generates
the same tokens. The SDK clients are built as the ``agent`` workflow builds them: one per
episode over the node's shared HTTP client, in process (the workflow's default) or over
loopback HTTP, or the agents run in 2 agent worker processes (``workers: 2``, the
workflow's own ``AgentWorkers``). First every agent makes ``--rounds`` calls back to back
(free-running, how agents call; ``3 x --repeats`` runs, the paths taking turns run by run),
then in lockstep rounds (every agent's call of round r, then round r + 1), the paths taking
turns round by round, ``--repeats`` times; overhead = 1 - the median over runs or rounds of
the endpoint's speed relative to the direct one just before it (target < 10%). The
endpoint's cost is per call (the SDK's request building and reply parsing, render,
capture), so the overhead depends on how many tokens a call generates: the first tables let
the random tiny model end its turns where it draws the end-of-turn token (~25 tokens a call
on average), the next ones hold every call to exactly ``--call-tokens``
tokens on both paths (``min_tokens``, vLLM's extension, which the endpoint accepts), and a
summary gives the overhead per call shape. The table also gives this process's CPU time (all
threads) per 1k tokens, the engine thread's share of it (the engine's ``cpu_s``; the same
work on every path, so what the endpoint adds is the other threads' CPU: the SDK's, the
endpoint's) and the endpoint's extra CPU for the same tokens: on a shared machine other jobs
move wall time by +-30% from round to round, CPU time far less.

    .venv/bin/python benchmarks/raas_overhead.py            # 3.2M-param model, 8 rounds
    .venv/bin/python benchmarks/raas_overhead.py --quick    # small model, 3 rounds
    .venv/bin/python benchmarks/raas_overhead.py --endpoint --skip-node   # endpoint table only
    .venv/bin/python benchmarks/raas_overhead.py --endpoint --skip-node --engine-process
        # the same with the engine in a process of its own (engine option process: true); the
        # CPU columns then add the engine process's CPU to this one's

Timings on a shared 2-core machine are noisy (+-30%); the script runs the paths
alternately ``--repeats`` times and reports the median of each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
ALPHABET = "0123456789+-*=>?,. abcdefgh"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small model, few rounds (a smoke run)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the Qwen3 model")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--batch", type=int, default=8, help="tasks per engine batch (a round)")
    p.add_argument("--group", type=int, default=4, help="completions per task (group size)")
    p.add_argument("--new-tokens", type=int, default=48, help="max new tokens per completion")
    p.add_argument("--rounds", type=int, default=8, help="batches of `capacity` tasks")
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of each path")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--endpoint", action="store_true", help="also measure the agent endpoint")
    p.add_argument(
        "--call-tokens",
        type=int,
        nargs="*",
        default=[32, 64, 128],
        help="endpoint tables also for calls of exactly these lengths (min_tokens)",
    )
    p.add_argument("--skip-node", action="store_true", help="skip the node rows")
    p.add_argument(
        "--engine-process",
        action="store_true",
        help="every row's engine in a child process of its own (engine option process: true)",
    )
    args = p.parse_args()
    if args.quick:
        args.hidden, args.layers, args.rounds, args.repeats, args.new_tokens = 64, 2, 3, 1, 24
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompts(n: int) -> list[str]:
    return [f"{i % 10}+{(i * 7) % 10}=" for i in range(n)]


def bench_spec(hidden: int, layers: int, context: int = 256) -> Any:
    """The benchmark's Qwen3 (``hidden`` wide, ``layers`` deep) with a character tokenizer."""
    from astraflow.models import ModelSpec, TokenizerSpec

    return ModelSpec(
        model_type="qwen3",
        config={
            "hidden_size": hidden,
            "intermediate_size": 3 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": hidden // 4,
            "max_position_embeddings": context,
            "tie_word_embeddings": True,
        },
        tokenizer=TokenizerSpec(type="char", alphabet=ALPHABET),
    )


def setup_store(root: Path, args: argparse.Namespace) -> Any:
    """Publish assets and version 0 of the benchmark model; return its spec."""
    from astraflow.models import build_model, build_tokenizer
    from astraflow.weights import WeightStore

    spec = bench_spec(args.hidden, args.layers)
    tok = build_tokenizer(spec)
    model = build_model(spec, tok)
    assets = root / "assets"
    model.config.save_pretrained(assets)
    model.generation_config.save_pretrained(assets)
    tok.save_pretrained(assets)
    store = WeightStore(root / "weights")
    store.publish_assets("policy", assets)
    store.publish("policy", 0, model.state_dict()).result()
    store.close()
    return spec


def sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_new_tokens": args.new_tokens, "temperature": 1.0, "seed": 1234}


async def run_direct(
    root: Path, args: argparse.Namespace, engine_cfg: dict[str, Any]
) -> dict[str, float]:
    """The baseline: each round's whole batch straight into engine.generate."""
    from transformers import AutoTokenizer

    from astraflow.raas.engines.base import EngineContext, GenerationRequest, build_engine
    from astraflow.weights import WeightClient
    from astraflow.workflows.api import SamplingParams, encode_prompt

    client = WeightClient(root / "weights")
    assets = client.fetch_assets("policy", root / "direct-assets")
    tok = AutoTokenizer.from_pretrained(assets)
    context = EngineContext(
        policy="policy", tokenizer=tok, work_dir=root / "direct", assets_dir=assets
    )
    engine = build_engine(engine_cfg, context)
    await engine.load(client.load("policy", 0), 0)
    params = SamplingParams(**sampling(args))
    texts = prompts(args.batch * args.rounds)
    requests = [
        GenerationRequest.from_sampling(encode_prompt(tok, text), params, seed=params.seed + i)  # type: ignore[operator]
        for text in texts
        for i in range(args.group)
    ]
    await engine.generate(requests[: args.group])  # warm-up
    per_round = args.batch * args.group
    tokens = 0
    started = time.perf_counter()
    for r in range(args.rounds):
        outs = await engine.generate(requests[r * per_round : (r + 1) * per_round])
        tokens += sum(len(o.token_ids) for o in outs)
    elapsed = time.perf_counter() - started
    metrics = engine.metrics()  # type: ignore[attr-defined]
    await engine.close()
    client.close()
    return {"tokens": tokens, "seconds": elapsed, "batch": metrics["mean_batch_size"]}


def start_dataflow(
    root: Path, args: argparse.Namespace, run: int
) -> tuple[subprocess.Popen[bytes], str]:
    tasks = root / f"tasks-{run}.jsonl"
    with tasks.open("w") as f:
        for i, text in enumerate(prompts(args.batch * args.rounds)):
            f.write(
                json.dumps(
                    {
                        "id": str(i),
                        "prompt": text,
                        "answer": str(int(text[0]) + int(text[2])),
                        "reward": "synthetic_exact",
                    }
                )
                + "\n"
            )
    port = free_port()
    config = {
        "run_dir": str(root / f"df-{run}"),
        "port": port,
        "policies": {"policy": {"vocab_size": 64, "max_staleness": 4, "max_buffered": 100000}},
        "sources": [
            {
                "name": "bench",
                "type": "jsonl",
                "path": str(tasks),
                "workflow": "rlvr",
                "policies": ["policy"],
                "group_size": args.group,
                "epochs": 1,
            }
        ],
        "selector": "sequential",
        "lease": {"ttl_s": 120, "retry_after_s": 0.05},
    }
    path = root / f"dataflow-{run}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (root / f"dataflow-{run}.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "astraflow.cli.main",
            "dataflow",
            "serve",
            "--config",
            str(path),
            "--log-level",
            "WARNING",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the dataflow service did not start; see {root}/dataflow-{run}.log")


async def run_node(
    root: Path, args: argparse.Namespace, engine_cfg: dict[str, Any], run: int, capacity: int
) -> dict[str, float]:
    """The real node against the dataflow service; time from ready to the last submit."""
    from astraflow.dataflow.client import AsyncDataflowClient
    from astraflow.raas.config import NodeConfig
    from astraflow.raas.node import RolloutNode

    proc, url = start_dataflow(root, args, run)
    total = args.batch * args.rounds
    try:
        config = NodeConfig.model_validate(
            {
                "dataflow_url": url,
                "weights": str(root / "weights"),
                "node_id": f"bench-{run}",
                "policies": {"policy": {"engine": engine_cfg}},
                "capacity": capacity,
                "workflows": {"rlvr": {"sampling": sampling(args)}},
                "idle_wait_s": 0.05,
                "work_dir": str(root / f"node-{run}"),
            }
        )
        node = RolloutNode(config)
        assert await node.start()
        policy = node.policies["policy"]
        await policy.generate("1+1=", n=args.group)  # warm-up, as the baseline
        warm = policy.generated_tokens
        async with AsyncDataflowClient(url, timeout_s=10) as watcher:
            started = time.perf_counter()
            serving = asyncio.create_task(node.serve())
            while node.meter.completed < total:
                await asyncio.sleep(0.005)
            elapsed = time.perf_counter() - started
            node.request_stop()
            await serving
            report = await watcher.report()
        metrics = policy.engine.metrics()  # type: ignore[attr-defined]
        await node.close()
        assert report.tasks.done == total, report.tasks
        return {
            "tokens": policy.generated_tokens - warm,
            "seconds": elapsed,
            "batch": metrics["mean_batch_size"],
        }
    finally:
        proc.terminate()
        proc.wait(30)


ENDPOINT_PATHS = ("direct", "in_process", "loopback", "worker")
#: Free-running measurements per ``--repeats`` (each is one figure, not ``rounds``).
FREE_RUNS = 3
#: Engine batching of the endpoint table (every row): a gap wide enough for calls that
#: trickle in on a loaded 2-core machine.
ENDPOINT_BATCHING = {"batch_wait_ms": 20.0, "batch_gap_ms": 100.0, "batch_max_wait_ms": 1000.0}


async def run_endpoint_pair(
    root: Path,
    args: argparse.Namespace,
    engine_cfg: dict[str, Any],
    fixed: int | None = None,
    free: bool = False,
) -> dict[str, dict[str, float]]:
    """Direct ``PolicyHandle.generate`` vs the agent endpoint, same policy, prompts, seeds;
    in lockstep rounds (every agent's call of round r, then round r + 1) or ``free``-running
    (each agent's calls back to back; one figure per repeat).

    The endpoint rows reach it as the ``agent`` workflow's SDK clients do: one
    ``openai.AsyncOpenAI`` per episode sharing the node's HTTP client (in process, the
    workflow's default, or over loopback HTTP).
    """
    import openai
    from transformers import AutoTokenizer

    from astraflow.raas.endpoint import AgentEndpoint
    from astraflow.raas.engines.base import EngineContext, build_engine
    from astraflow.raas.policy import NodePolicy
    from astraflow.weights import WeightClient
    from astraflow.workflows.agent import AgentConfig, AgentSession
    from astraflow.workflows.agent_worker import AgentWorkers, WorkerSpec
    from astraflow.workflows.api import SamplingParams
    from astraflow.workflows.chat_format import ChatFormat

    client = WeightClient(root / "weights")
    assets = client.fetch_assets("policy", root / "ep-assets")
    tok = AutoTokenizer.from_pretrained(assets)
    context = EngineContext(policy="policy", tokenizer=tok, work_dir=root / "ep", assets_dir=assets)
    policy = NodePolicy(
        "policy", tok, build_engine(engine_cfg, context), frozen=False, from_store=False
    )
    await policy.load(client, 0)
    fmt = ChatFormat(tok)
    endpoint = AgentEndpoint()
    await endpoint.start()
    config = AgentConfig(entry="astraflow.examples.openai_search_agent:run", max_tokens_limit=4096)
    per_round = args.batch * args.group
    texts = prompts(per_round * args.rounds)
    chats = [[{"role": "user", "content": t}] for t in texts]
    ids = [tok.encode(fmt.render(c), add_special_tokens=False) for c in chats]

    budget = fixed or args.new_tokens
    extra = {"min_tokens": fixed} if fixed else None

    async def direct(i: int, sdk: Any) -> int:
        params = SamplingParams(
            max_new_tokens=budget, min_new_tokens=fixed or 0, temperature=1.0, seed=1234 + i
        )
        (gen,) = await policy.generate(ids[i], params)
        return len(gen.token_ids)

    async def via_endpoint(i: int, sdk: Any) -> int:
        reply = await sdk.chat.completions.create(
            model="policy", messages=chats[i], max_tokens=budget, seed=1234 + i, extra_body=extra
        )
        return int(reply.usage.completion_tokens)

    # the agent workflow with ``workers: 2``: the same call made by an agent in a worker
    # process, through the workflow's own worker pool
    workers = AgentWorkers(WorkerSpec("raas_overhead:one_call", 600.0), 2)

    async def via_worker(i: int, session: Any) -> int:
        call = {"messages": chats[i], "max_tokens": budget, "seed": 1234 + i, "extra": extra}
        result = await workers.run(
            call,
            base_url=session.base_url,
            api_key=session.api_key,
            client="openai",
            extra={},
            tools=None,
        )
        return int(result["tokens"])

    calls = {"direct": direct, "in_process": via_endpoint, "loopback": via_endpoint}
    calls["worker"] = via_worker

    def sdk_clients(path: str) -> list[Any]:
        if path == "direct":
            return [None] * per_round
        if path == "worker":
            return list(sessions)
        http = endpoint.http_client(path)  # type: ignore[arg-type]
        return [
            openai.AsyncOpenAI(
                base_url=s.base_url, api_key=s.api_key, max_retries=0, http_client=http
            )
            for s in sessions
        ]

    def _measured(
        tokens: int, started: float, cpu: float, before: dict[str, float], calls: int
    ) -> dict[str, float]:
        """One measurement: tokens, wall and process CPU seconds since ``started``/``cpu``,
        and the engine's batches and engine-thread CPU since ``before`` (its metrics)."""
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        after = policy.engine.metrics()  # type: ignore[attr-defined]
        # an engine in its own process (--engine-process): its CPU counts too
        cpu += after.get("process_cpu_s", 0.0) - before.get("process_cpu_s", 0.0)
        return {
            "tokens": tokens, "seconds": elapsed, "cpu": cpu, "calls": calls,
            "batches": after["batches"] - before["batches"],
            "engine_cpu": after["cpu_s"] - before["cpu_s"],
        }  # fmt: skip

    async def one_round(path: str, r: int, sdks: list[Any]) -> dict[str, float]:
        call = calls[path]
        idx = range(r * per_round, (r + 1) * per_round)
        before = policy.engine.metrics()  # type: ignore[attr-defined]
        started, cpu = time.perf_counter(), time.process_time()
        tokens = sum(await asyncio.gather(*(call(i, sdks[i % per_round]) for i in idx)))
        return _measured(tokens, started, cpu, before, per_round)

    async def free_run(path: str, sdks: list[Any]) -> dict[str, float]:
        """Every agent makes its ``rounds`` calls one after the other, no barrier between
        agents (how agents call: the next turn as soon as the last reply is in)."""
        call = calls[path]

        async def agent(j: int) -> int:
            return sum([await call(r * per_round + j, sdks[j]) for r in range(args.rounds)])

        before = policy.engine.metrics()  # type: ignore[attr-defined]
        started, cpu = time.perf_counter(), time.process_time()
        tokens = sum(await asyncio.gather(*(agent(j) for j in range(per_round))))
        return _measured(tokens, started, cpu, before, per_round * args.rounds)

    out: dict[str, list[dict[str, float]]] = {k: [] for k in ENDPOINT_PATHS}
    for _ in range(args.repeats * (FREE_RUNS if free else 1)):
        sessions = [
            endpoint.open(AgentSession("", {"policy": policy}, {"policy": fmt}, config))
            for _ in range(per_round)
        ]
        clients = {path: sdk_clients(path) for path in ENDPOINT_PATHS}
        for _ in range(2):  # warm-up (connections, lazy imports, first renders): the first
            # measured in-process round still paid a one-time cost after a single warm-up round
            for path in ENDPOINT_PATHS:
                call = calls[path]
                await asyncio.gather(*(call(i, clients[path][i]) for i in range(per_round)))
        if free:  # the paths take turns run by run
            for path in ENDPOINT_PATHS:
                out[path].append(await free_run(path, clients[path]))
        # the paths take turns round by round: a load change on the shared machine hits all
        for r in range(0 if free else args.rounds):
            for path in ENDPOINT_PATHS:
                out[path].append(await one_round(path, r, clients[path]))
        for s in sessions:
            endpoint.close(s)
    await workers.aclose()
    await endpoint.stop()
    await policy.close()
    client.close()
    return {k: _endpoint_row(v, out["direct"], per_round) for k, v in out.items()}


async def one_call(task: dict[str, Any], client: Any) -> dict[str, float]:
    """The ``worker`` row's agent: one chat call, as ``via_endpoint`` makes it."""
    reply = await client.chat.completions.create(
        model="policy",
        messages=task["messages"],
        max_tokens=task["max_tokens"],
        seed=task["seed"],
        extra_body=task["extra"],
    )
    return {"reward": 0.0, "tokens": float(reply.usage.completion_tokens)}


def _endpoint_row(
    rounds: list[dict[str, float]], direct: list[dict[str, float]], per_round: int
) -> dict[str, Any]:
    """Figures of one path: total tokens/s, mean batch, and its speed relative to the direct
    round run just before it, per round (same prompts and seeds: the same tokens)."""
    tokens = sum(r["tokens"] for r in rounds)
    return {
        "tokens": tokens,
        "calls": sum(r["calls"] for r in rounds),
        "rate": tokens / sum(r["seconds"] for r in rounds),
        "batch": sum(r["calls"] for r in rounds) / max(sum(r["batches"] for r in rounds), 1),
        "ratios": [d["seconds"] / r["seconds"] for r, d in zip(rounds, direct, strict=True)],
        "cpu_ratios": [d["cpu"] / r["cpu"] for r, d in zip(rounds, direct, strict=True)],
        "cpu_per_ktok": 1000 * sum(r["cpu"] for r in rounds) / max(tokens, 1),
        "engine_per_ktok": 1000 * sum(r["engine_cpu"] for r in rounds) / max(tokens, 1),
    }


def print_endpoint_summary(
    summary: list[tuple[str, dict[str, dict[str, Any]]]], args: argparse.Namespace
) -> None:
    """One line per call shape: tokens per call and the endpoint's overhead (in process)."""
    print(
        f"\n{'call shape':<40}{'tokens/call':>12}{'overhead: in process':>22}{'(CPU)':>8}"
        f"{'in workers':>12}{'(node CPU)':>12}"
    )
    for label, result in summary:
        calls = result["direct"]["calls"]
        cells = []
        for path in ("in_process", "worker"):
            r = result[path]
            over = 1 - statistics.median(r["ratios"])
            cpu = 1 / statistics.median(r["cpu_ratios"]) - 1
            cells.append((over, cpu))
        tokens = result["in_process"]["tokens"] / calls
        (a, b), (c, d) = cells
        print(f"{label:<40}{tokens:>12.1f}{a:>+22.1%}{b:>+8.1%}{c:>+12.1%}{d:>+12.1%}")
    print(
        "(in process: the agent workflow's default, workers: 0; in workers: workers: 2, the "
        "agents' SDK in their own processes; target < 10%)"
    )


def print_endpoint(result: dict[str, dict[str, Any]], shape: str) -> None:
    """The endpoint table. Overhead = 1 - the median over rounds of (direct round time /
    endpoint round time): the paths take turns round by round on the same prompts and
    seeds, so a load change on the shared machine hits neighbouring rounds alike. The CPU
    columns count this process's CPU time (every thread: engine and event loop), which other
    jobs on a shared machine move far less than wall time."""
    print(f"\ncalls: {shape}")
    print(
        f"{'path':<44}{'tokens':>7}{'tokens/s':>10}{'mean batch':>12}{'overhead':>10}"
        f"{'CPU s/1k tok':>14}{'of it engine':>14}{'CPU overhead':>14}"
        "  per-round speed vs direct: quartiles"
    )
    labels = {
        "direct": "PolicyHandle.generate (baseline)",
        "in_process": "/v1/chat/completions, SDK in process",
        "loopback": "/v1/chat/completions, SDK over loopback HTTP",
        "worker": "/v1/chat/completions, agents in 2 workers",
    }
    for key, label in labels.items():
        r = result[key]
        over, cpu_over, spread = "", "", ""
        if key != "direct":
            over = f"{1 - statistics.median(r['ratios']):+.1%}"
            cpu_over = f"{1 / statistics.median(r['cpu_ratios']) - 1:+.1%}"
            q = statistics.quantiles(r["ratios"], n=4) if len(r["ratios"]) > 1 else r["ratios"]
            spread = "  " + " ".join(f"{x:.3f}" for x in q)
        print(
            f"{label:<44}{int(r['tokens']):>7}{r['rate']:>10.0f}{r['batch']:>12.1f}{over:>10}"
            f"{r['cpu_per_ktok']:>14.2f}{r['engine_per_ktok']:>14.2f}{cpu_over:>14}{spread}"
        )
    print(
        "overhead = 1 - endpoint tokens/s / direct tokens/s (median over rounds; target < 10%); "
        "CPU overhead = endpoint CPU s / direct CPU s - 1 for the same tokens (median over "
        "rounds); of it engine = the engine thread's own CPU (the same work on every path: "
        "what differs is the other threads' CPU, which competes with it for the cores and "
        "the interpreter)"
    )


async def per_call_cpu(args: argparse.Namespace, calls: int = 640) -> dict[str, float]:
    """CPU ms per call of each layer of the endpoint path, with a policy that answers at once
    (a fixed 48-token generation, no engine): the handle called directly, a raw HTTP POST into
    the endpoint in process (transport, routes, render, capture, reply), and the ``openai``
    SDK call the agent makes (the POST plus the SDK's request building and reply parsing)."""
    import numpy as np
    import openai

    from astraflow.models import ModelSpec, TokenizerSpec, build_tokenizer
    from astraflow.raas.endpoint import AgentEndpoint
    from astraflow.workflows.agent import AgentConfig, AgentSession
    from astraflow.workflows.api import Generation, NamedPolicy, encode_prompt
    from astraflow.workflows.chat_format import ChatFormat

    spec = ModelSpec(model_type="qwen3", tokenizer=TokenizerSpec(type="char", alphabet=ALPHABET))
    tok = build_tokenizer(spec)
    reply = np.asarray(tok.encode("1+2=3, 4+5=9. " * 4, add_special_tokens=False)[:48], np.int32)

    class Instant(NamedPolicy):
        version = 0

        async def generate(self, prompt: Any, sampling: Any = None, *, n: int = 1) -> Any:
            ids = np.asarray(encode_prompt(self.tokenizer, prompt), dtype=np.int32)
            await asyncio.sleep(0)
            logprobs = np.zeros(len(reply), np.float32)
            return [Generation("policy", 0, ids, reply, logprobs, "", "length")] * n

    policy, fmt = Instant("policy", tok), ChatFormat(tok)
    endpoint = AgentEndpoint()
    await endpoint.start()
    http = endpoint.http_client("in_process")
    config = AgentConfig(entry="astraflow.examples.openai_search_agent:run", max_tokens_limit=4096)
    wave = args.batch * args.group
    chats = [[{"role": "user", "content": t}] for t in prompts(wave)]
    ids = [tok.encode(fmt.render(c), add_special_tokens=False) for c in chats]
    cpu = dict.fromkeys(("direct", "http", "sdk"), 0.0)
    bodies: list[dict[str, Any]] = [
        {"model": "policy", "messages": c, "max_tokens": args.new_tokens, "seed": i}
        for i, c in enumerate(chats)
    ]
    waves = max(1, calls // wave)
    for w in range(waves + 1):  # the first wave warms up
        sessions = [
            endpoint.open(AgentSession("", {"policy": policy}, {"policy": fmt}, config))
            for _ in range(wave)
        ]
        sdks = [
            openai.AsyncOpenAI(
                base_url=s.base_url, api_key=s.api_key, max_retries=0, http_client=http
            )
            for s in sessions
        ]
        urls = [f"{s.base_url}/chat/completions" for s in sessions]
        for name in cpu:
            started = time.process_time()
            if name == "direct":
                await asyncio.gather(*(policy.generate(ids[i]) for i in range(wave)))
            elif name == "http":
                await asyncio.gather(*(http.post(urls[i], json=bodies[i]) for i in range(wave)))
            else:
                await asyncio.gather(
                    *(sdks[i].chat.completions.create(**bodies[i]) for i in range(wave))
                )
            if w:
                cpu[name] += time.process_time() - started
        for s in sessions:
            endpoint.close(s)
    await endpoint.stop()
    return {k: 1000 * v / (waves * wave) for k, v in cpu.items()}


def print_per_call(ms: dict[str, float]) -> None:
    """Where an endpoint call's CPU goes (instant policy, no engine)."""
    endpoint, sdk = ms["http"] - ms["direct"], ms["sdk"] - ms["http"]
    print(
        f"\nCPU per call, instant policy: handle {ms['direct']:.2f} ms; raw HTTP POST into the "
        f"endpoint {ms['http']:.2f} ms (endpoint + transport {endpoint:.2f} ms); openai SDK "
        f"call {ms['sdk']:.2f} ms (SDK request building and reply parsing {sdk:.2f} ms)"
    )


async def main() -> None:
    args = parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    engine_cfg = {
        "type": "transformers",
        "device": "cpu",
        "max_batch_size": args.batch * args.group,
    }
    if args.engine_process:  # the child sets its own torch threads
        engine_cfg |= {"process": True, **({"threads": args.threads} if args.threads else {})}
    with tempfile.TemporaryDirectory(prefix="raas-bench-") as tmp:
        root = Path(tmp)
        setup_store(root, args)
        import torch

        print(
            f"model: qwen3 hidden={args.hidden} layers={args.layers}; batch {args.batch} tasks x "
            f"{args.group} completions x <= {args.new_tokens} new tokens; {args.rounds} rounds; "
            f"torch threads {torch.get_num_threads()}; cpu x{os.cpu_count()}"
        )
        if args.endpoint:  # agents' calls reach the engine one by one: a window that waits
            # for stragglers while calls keep arriving (the same engine config for all rows)
            cfg = {**engine_cfg, **ENDPOINT_BATCHING}
            summary = []
            natural = f"up to {args.new_tokens} tokens, ending where the model ends its turn"
            free = f"{natural}; free-running agents, {args.rounds} calls each back to back"
            result = await run_endpoint_pair(root, args, cfg, None, free=True)
            print_endpoint(result, free)
            summary.append((f"natural, free-running (<= {args.new_tokens})", result))
            for fixed in [None, *args.call_tokens]:
                exact = f"each exactly {fixed} tokens (min_tokens = max_tokens)"
                shape = exact if fixed else natural
                result = await run_endpoint_pair(root, args, cfg, fixed)
                print_endpoint(result, f"{shape}; lockstep rounds")
                label = f"exactly {fixed} tokens" if fixed else f"natural (<= {args.new_tokens})"
                summary.append((f"{label}, lockstep", result))
            print_endpoint_summary(summary, args)
            print_per_call(await per_call_cpu(args))
        if not args.skip_node:
            print_node(await node_rows(root, args, engine_cfg), args)


async def node_rows(
    root: Path, args: argparse.Namespace, engine_cfg: dict[str, Any]
) -> dict[str, list[dict[str, float]]]:
    """Direct engine vs the node at two capacities, alternating ``repeats`` times."""
    runs: dict[str, list[dict[str, float]]] = {"direct": [], "node1": [], "node2": []}
    for run in range(args.repeats):
        runs["direct"].append(await run_direct(root, args, engine_cfg))
        runs["node1"].append(await run_node(root, args, engine_cfg, 2 * run, args.batch))
        runs["node2"].append(await run_node(root, args, engine_cfg, 2 * run + 1, 2 * args.batch))
    return runs


def print_node(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    """The node table."""
    names = {
        "direct": "engine.generate (baseline)",
        "node1": f"node, capacity {args.batch}",
        "node2": f"node, capacity {2 * args.batch}",
    }
    rate = {k: [r["tokens"] / r["seconds"] for r in v] for k, v in runs.items()}
    base = statistics.median(rate["direct"])
    print(
        f"\n{'path':<30}{'tokens':>8}{'tokens/s (median)':>19}{'mean batch':>12}"
        f"{'overhead':>10}  runs"
    )
    for key, label in names.items():
        mid = statistics.median(rate[key])
        r = runs[key][0]
        over = "" if key == "direct" else f"{1 - mid / base:+.1%}"
        print(
            f"{label:<30}{int(r['tokens']):>8}{mid:>19.0f}{r['batch']:>12.1f}{over:>10}  "
            f"{[round(x) for x in rate[key]]}"
        )
    print(
        "\noverhead = 1 - node tokens/s / engine tokens/s (target < 5%); timings on a shared "
        "machine vary +-30%: compare medians of alternating runs"
    )


if __name__ == "__main__":
    asyncio.run(main())
