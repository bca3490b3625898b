"""Throughput of the shipped agent environments, in-process and over HTTP, and their share of
rollout time next to generation.

For each environment (textcraft, household, shop, search_agent, nim):

1. **in-process**: ``--episodes`` episodes (seeds 0..N-1) played by the scripted expert, after
   10 warm-up episodes (other seeds: imports, indexes, TextWorld processes); only the
   environment's own ``reset``/``step`` calls are timed -> episodes/s, steps/s.
2. **over HTTP**: the same seeds and actions against ``astraflow env serve`` (a subprocess on
   loopback) through the ``remote`` client; every observation and reward must equal the
   in-process ones (checked) -> episodes/s, steps/s.
3. **rollout share**: ``--rollouts`` episodes where each turn a policy generates (the CPU
   recipe's model: a 0.4M-parameter Qwen3, char tokenizer, built locally, transformers engine)
   and the environment steps. The agent writes exactly as many tokens as the expert's action
   has characters (``min_new_tokens = max_new_tokens``) and the expert's action is what is
   sent, so the environment does real work every turn. env share = env time / (env time +
   generation time), in-process and over HTTP. Goal: < 10% in-process, < 20% over HTTP.

    .venv/bin/python benchmarks/env_throughput.py                 # everything
    .venv/bin/python benchmarks/env_throughput.py --quick         # fewer episodes
    .venv/bin/python benchmarks/env_throughput.py --envs shop nim --no-http

Household worlds are compiled into ``--household-cache`` first (about 3 s per missing world;
that is set-up, not timed). Timings on a shared 2-core machine are noisy: compare the figures
of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
ENVS = ("textcraft", "household", "shop", "search_agent", "nim")
ALPHABET = string.ascii_letters + string.digits + " \n.,:;!?'\"()[]{}<>=+-*/_$#%&|@"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--envs", nargs="+", default=list(ENVS), choices=ENVS, help="which envs")
    p.add_argument("--episodes", type=int, default=50, help="throughput episodes per env")
    p.add_argument("--rollouts", type=int, default=6, help="rollout-share episodes per env")
    p.add_argument("--household-cache", default="runs/cache/household", help="compiled worlds")
    p.add_argument("--household-worlds", type=int, default=8, help="worlds to use")
    p.add_argument("--no-http", action="store_true", help="skip the HTTP rows")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the model")
    p.add_argument("--quick", action="store_true", help="10 episodes, 3 rollouts per env")
    args = p.parse_args()
    if args.quick:
        args.episodes, args.rollouts = 10, 3
    return args


def env_spec(name: str, args: argparse.Namespace) -> dict[str, Any]:
    if name == "household":
        return {
            "type": name,
            "cache_dir": str(Path(args.household_cache).resolve()),
            "worlds": args.household_worlds,
        }
    return {"type": name}


# --------------------------------------------------------------------------- agents


class ExpertRun:
    """Plays one environment in-process with its expert, timing only the env's calls."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from astraflow.envs import EnvFactory

        self.env: Any = EnvFactory(spec).create()
        self.env_s = 0.0
        self.steps = 0

    def reset(self, seed: int) -> tuple[Any, dict[str, Any]]:
        t = time.perf_counter()
        out = self.env.reset(seed=seed)
        self.env_s += time.perf_counter() - t
        return out  # type: ignore[no-any-return]

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        t = time.perf_counter()
        out = self.env.step(action)
        self.env_s += time.perf_counter() - t
        self.steps += 1
        return out  # type: ignore[no-any-return]


def play(run: ExpertRun, seeds: range) -> list[Any]:
    """Expert episodes of ``seeds``; the transcript."""
    transcript: list[Any] = []
    for seed in seeds:
        obs, _ = run.reset(seed)
        transcript.append(obs)
        while True:
            action = run.env.expert_action()
            obs, reward, term, trunc, _ = run.step(action)
            transcript.append((action, obs, reward, term, trunc))
            if term or trunc:
                break
    return transcript


def in_process(spec: dict[str, Any], episodes: int) -> tuple[dict[str, float], list[Any]]:
    """Expert episodes after a warm-up; the figures and the transcript (for HTTP)."""
    run = ExpertRun(spec)
    play(run, range(10_000, 10_010))  # warm-up: imports, indexes, TextWorld game processes
    run.env_s, run.steps = 0.0, 0
    transcript = play(run, range(episodes))
    run.env.close()
    return {"eps_s": episodes / run.env_s, "steps_s": run.steps / run.env_s}, transcript


# --------------------------------------------------------------------------- HTTP


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(spec: dict[str, Any], root: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``astraflow env serve`` in a subprocess; its URL once /health answers."""
    port = free_port()
    config = root / f"serve-{spec['type']}.yaml"
    config.write_text(yaml.safe_dump({"env": spec, "port": port, "max_sessions": 64}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("ASTRAFLOW_ENV_TOKEN", None)
    log = (root / f"serve-{spec['type']}.log").open("wb")
    cmd = [sys.executable, "-m", "astraflow", "env", "serve", "--config", str(config)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1, trust_env=False).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"astraflow env serve did not start; see {log.name}")


async def over_http(url: str, transcript: list[Any], episodes: int) -> dict[str, float]:
    """Replays the in-process transcript (same seeds, same actions) against the server."""
    from astraflow.envs import EnvFactory

    factory = EnvFactory({"type": "remote", "url": url})
    env: Any = factory.create()
    env_s, steps, i = 0.0, 0, 0
    for seed in range(episodes):
        t = time.perf_counter()
        obs, _ = await env.areset(seed=seed)
        env_s += time.perf_counter() - t
        assert obs == transcript[i], f"seed {seed}: reset differs from in-process"
        i += 1
        while True:
            action, *expected = transcript[i]
            t = time.perf_counter()
            obs, reward, term, trunc, _ = await env.astep(action)
            env_s += time.perf_counter() - t
            steps += 1
            i += 1
            assert [obs, reward, term, trunc] == expected, f"seed {seed}: a step differs"
            if term or trunc:
                break
    await env.aclose()
    return {"eps_s": episodes / env_s, "steps_s": steps / env_s}


# --------------------------------------------------------------------------- rollout share


def build_policy(threads: int, work: Path) -> Any:
    """The CPU env recipe's model (gridnav_cpu.yaml's Qwen3) with a printable alphabet."""
    import torch

    from astraflow.models import ModelSpec, TokenizerSpec, build_tokenizer
    from astraflow.raas.engines.base import EngineContext, build_engine
    from astraflow.raas.policy import NodePolicy

    torch.set_num_threads(threads)
    spec = ModelSpec(
        model_type="qwen3",
        config={
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 16384,
            "tie_word_embeddings": True,
        },
        tokenizer=TokenizerSpec(type="char", alphabet=ALPHABET),
    )
    tok = build_tokenizer(spec)
    ctx = EngineContext(policy="policy", tokenizer=tok, work_dir=work, model=spec, seed=0)
    engine = build_engine({"type": "transformers", "device": "cpu"}, ctx)
    return NodePolicy("policy", tok, engine, frozen=False, from_store=False)


async def rollout_share(
    policy: Any, spec: dict[str, Any], rollouts: int, url: str | None
) -> dict[str, float]:
    """Generation and env time over ``rollouts`` episodes (seeds 1000..)."""
    from astraflow.envs import EnvFactory
    from astraflow.workflows.api import SamplingParams, Trajectory

    shadow: Any = EnvFactory(spec).create()  # the expert's view (not timed)
    shadow.reset(seed=0)  # warm (one-time imports and indexes are not per-turn costs)
    remote: Any = EnvFactory({"type": "remote", "url": url}).create() if url else None
    gen_s = env_s = 0.0
    turns = tokens = 0
    for seed in range(1000, 1000 + rollouts):
        t = time.perf_counter()
        obs, _ = (await remote.areset(seed=seed)) if remote else shadow.reset(seed=seed)
        env_s += time.perf_counter() - t
        if remote:
            shadow.reset(seed=seed)
        traj = Trajectory(policy)
        traj.add_text(f"{obs}\n> ")
        while True:
            action = shadow.expert_action()
            n = len(action) + 1
            t = time.perf_counter()
            await traj.generate(SamplingParams(max_new_tokens=n, min_new_tokens=n))
            gen_s += time.perf_counter() - t
            t = time.perf_counter()
            step = (await remote.astep(action)) if remote else shadow.step(action)
            env_s += time.perf_counter() - t
            if remote:
                shadow.step(action)
            turns += 1
            tokens += n
            if step[2] or step[3]:
                break
            traj.add_text(f"\n{step[0]}\n> ")
    if remote:
        await remote.aclose()
    shadow.close()
    return {
        "env_share": env_s / (env_s + gen_s),
        "env_ms_turn": 1000 * env_s / turns,
        "gen_ms_turn": 1000 * gen_s / turns,
        "tokens_turn": tokens / turns,
        "ctx_tokens": float(len(traj.token_ids)),
    }


# --------------------------------------------------------------------------- main


def prepare(args: argparse.Namespace) -> None:
    if "household" in args.envs:
        from astraflow.envs.household_worlds import generate_worlds

        t = time.perf_counter()
        generate_worlds(args.household_cache, args.household_worlds)
        print(f"household worlds ready in {args.household_cache} ({time.perf_counter() - t:.1f}s)")


def http_available() -> bool:
    try:
        import astraflow.envs.remote
        import astraflow.envs.server  # noqa: F401
    except ImportError:
        return False
    return True


async def main_async(args: argparse.Namespace) -> None:
    prepare(args)
    use_http = not args.no_http and http_available()
    if not args.no_http and not use_http:
        print("HTTP rows skipped: astraflow.envs.server (astraflow env serve) is not here yet")
    root = Path(tempfile.mkdtemp(prefix="env-throughput-"))
    policy = build_policy(args.threads, root)
    rows: list[tuple[str, dict[str, float], dict[str, float] | None, dict[str, float], Any]] = []
    for name in args.envs:
        spec = env_spec(name, args)
        local, transcript = in_process(spec, args.episodes)
        share = await rollout_share(policy, spec, args.rollouts, None)
        remote = remote_share = None
        if use_http:
            proc, url = start_server(spec, root)
            try:
                remote = await over_http(url, transcript, args.episodes)
                remote_share = await rollout_share(policy, spec, args.rollouts, url)
            finally:
                proc.terminate()
                proc.wait(30)
        rows.append((name, local, remote, share, remote_share))
        print(f"{name}: done", flush=True)
    report(args, rows)


def _fmt(row: dict[str, float] | None, key: str, spec: str) -> str:
    width = spec.lstrip(">").split(".")[0]
    return format("-", f">{width}") if row is None else format(row[key], spec)


def report(args: argparse.Namespace, rows: list[Any]) -> None:
    print(
        f"\nenv throughput: {args.episodes} expert episodes per env (seeds 0..), "
        f"rollout share over {args.rollouts} episodes with the CPU recipe's model"
    )
    head = (
        f"{'env':<13}{'eps/s in':>10}{'steps/s in':>12}{'eps/s http':>12}{'steps/s http':>14}"
        f"{'env ms/turn':>13}{'gen ms/turn':>13}{'share in':>10}{'share http':>12}"
    )
    print(head)
    print("-" * len(head))
    ok = True
    for name, local, remote, share, remote_share in rows:
        http_ok = remote_share is None or remote_share["env_share"] < 0.20
        ok &= share["env_share"] < 0.10 and http_ok
        print(
            f"{name:<13}{local['eps_s']:>10.1f}{local['steps_s']:>12.1f}"
            f"{_fmt(remote, 'eps_s', '>12.1f')}{_fmt(remote, 'steps_s', '>14.1f')}"
            f"{share['env_ms_turn']:>13.2f}{share['gen_ms_turn']:>13.1f}"
            f"{share['env_share']:>10.1%}{_fmt(remote_share, 'env_share', '>12.1%')}"
        )
    print(
        "\ngoal: env share < 10% in-process and < 20% over HTTP for every env: "
        + ("met" if ok else "NOT met")
    )


def main() -> None:
    asyncio.run(main_async(parse_args()))


if __name__ == "__main__":
    main()
