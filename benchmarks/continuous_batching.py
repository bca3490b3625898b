"""Tokens/s of the transformers engine with continuous batching on and off.

Continuous batching (``continuous: true``, the default) lets requests that arrive while a
batch decodes join it, and answers each request as soon as its row ends. Without it a batch
runs until its longest row ends, and requests that arrive meanwhile wait for the next batch
(``batch_gap_ms`` can stretch the window a batch waits for stragglers instead).

Two workloads, the same for every engine row (same model, prompts and seeds):

- ``agents``: ``--agents`` concurrent multi-turn agents, ``--turns`` calls each; every call
  sends the conversation so far (prompt + earlier replies + a new user line) and ends where
  the model draws end-of-turn (or at ``--new-tokens``); between calls an agent "acts" for a
  random 0-``--act-ms`` ms (a tool, an environment step), so calls trickle in.
- ``rounds``: ``--agents`` requests sent at once, one call each (GRPO group generation).

The engine rows take turns, ``--repeats`` times; the table gives the median tokens/s of each
and its ratio to the first row's (``continuous: false``, the old behaviour).

    .venv/bin/python benchmarks/continuous_batching.py
    .venv/bin/python benchmarks/continuous_batching.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from raas_overhead import bench_spec

ROWS: dict[str, dict[str, Any]] = {
    "continuous off": {"continuous": False},
    "continuous off, 100 ms gap window": {
        "continuous": False,
        "batch_wait_ms": 20.0,
        "batch_gap_ms": 100.0,
    },
    "continuous on (default)": {"continuous": True},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small model, 1 repeat (a smoke run)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the Qwen3 model")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--agents", type=int, default=32, help="concurrent agents / requests")
    p.add_argument("--turns", type=int, default=4, help="calls per agent")
    p.add_argument("--new-tokens", type=int, default=48, help="max new tokens per call")
    p.add_argument("--act-ms", type=float, default=20.0, help="most an agent acts between calls")
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of each row")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.quick:
        args.hidden, args.layers, args.agents, args.turns, args.repeats = 64, 2, 8, 2, 1
    return args


def build(args: argparse.Namespace, work: Path, config: dict[str, Any]) -> Any:
    from astraflow.models import build_tokenizer
    from astraflow.raas.engines.base import EngineContext, build_engine

    spec = bench_spec(args.hidden, args.layers, context=1024)
    context = EngineContext(
        policy="p", tokenizer=build_tokenizer(spec), work_dir=work, model=spec, seed=0
    )
    cfg = {"type": "transformers", "device": "cpu", "max_batch_size": args.agents, **config}
    return build_engine(cfg, context)


async def agents(engine: Any, args: argparse.Namespace, seed: int) -> int:
    """Every agent's calls in turn; returns the tokens generated."""
    from astraflow.raas.engines.base import GenerationRequest

    tok = engine.context.tokenizer

    async def agent(i: int) -> int:
        rng = random.Random(seed * 1000 + i)
        history = tok.encode(f"{i % 10}+{(i * 7) % 10}=")
        made = 0
        for turn in range(args.turns):
            request = GenerationRequest(
                tuple(history), max_new_tokens=args.new_tokens, seed=seed * 1000 + i * 10 + turn
            )
            (out,) = await engine.generate([request])
            made += len(out.token_ids)
            history += out.token_ids.tolist() + tok.encode(f" {turn}?")
            await asyncio.sleep(rng.uniform(0, args.act_ms) / 1000)
        return made

    return sum(await asyncio.gather(*(agent(i) for i in range(args.agents))))


async def rounds(engine: Any, args: argparse.Namespace, seed: int) -> int:
    """``--turns`` rounds of ``--agents`` requests sent at once."""
    from astraflow.raas.engines.base import GenerationRequest

    tok = engine.context.tokenizer
    made = 0
    for turn in range(args.turns):
        requests = [
            GenerationRequest(
                tuple(tok.encode(f"{i % 10}+{(i * 7) % 10}=")),
                max_new_tokens=args.new_tokens,
                seed=seed * 1000 + i * 10 + turn,
            )
            for i in range(args.agents)
        ]
        outs = await asyncio.gather(*(engine.generate([r]) for r in requests))
        made += sum(len(o[0].token_ids) for o in outs)
    return made


async def main() -> None:
    args = parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"model: qwen3 hidden={args.hidden} layers={args.layers}; {args.agents} agents x "
        f"{args.turns} calls x <= {args.new_tokens} new tokens; act 0-{args.act_ms:g} ms between "
        f"calls; torch threads {torch.get_num_threads()}; {args.repeats} repeats"
    )
    with tempfile.TemporaryDirectory(prefix="cb-bench-") as tmp:
        engines = {name: build(args, Path(tmp) / str(i), cfg) for i, (name, cfg) in
                   enumerate(ROWS.items())}  # fmt: skip
        for workload in (agents, rounds):
            rates: dict[str, list[float]] = {name: [] for name in engines}
            batches: dict[str, float] = dict.fromkeys(engines, 0.0)
            for engine in engines.values():  # warm-up
                await workload(engine, args, seed=99)
            for repeat in range(args.repeats):
                for name, engine in engines.items():
                    before = engine.metrics()["batches"]
                    started = time.perf_counter()
                    tokens = await workload(engine, args, seed=repeat)
                    rates[name].append(tokens / (time.perf_counter() - started))
                    batches[name] += engine.metrics()["batches"] - before
            print(f"\nworkload: {workload.__name__}")
            print(f"{'engine':<38}{'tokens/s':>10}{'vs off':>8}{'batches/run':>13}")
            base = statistics.median(rates[next(iter(rates))])
            for name, values in rates.items():
                rate = statistics.median(values)
                per_run = batches[name] / args.repeats
                print(f"{name:<38}{rate:>10.0f}{rate / base:>7.2f}x{per_run:>13.0f}")
        for engine in engines.values():
            await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
