"""The SIMULATED engine: drawn lengths and times, valid tokens, slots, weights, and a real
rollout node that serves a real dataflow service with it (its samples pass ingest)."""

from __future__ import annotations

import asyncio
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from astraflow.errors import PluginError, ServiceUnavailableError, ValidationError
from astraflow.raas.engines.base import EngineContext, GenerationRequest, build_engine
from astraflow.workflows.length_tail import LengthDistribution
from fixtures.models import tiny_spec
from simulated_engine import SimulatedEngine, step_time

#: The benchmark engine by path (pytest puts benchmarks/ on the import path).
SIMULATED = "simulated_engine:SimulatedEngine"


def _context(tmp_path: Path, *, model: bool = True, name: str = "a") -> EngineContext:
    from astraflow.models import build_tokenizer

    spec = tiny_spec()
    return EngineContext(
        policy="p",
        tokenizer=build_tokenizer(spec),
        work_dir=tmp_path / name,
        model=spec if model else None,
        seed=5,
    )


def _engine(tmp_path: Path, *, model: bool = True, name: str = "a", **config: Any) -> Any:
    engine = build_engine({"type": SIMULATED, **config}, _context(tmp_path, model=model, name=name))
    assert isinstance(engine, SimulatedEngine)
    return engine


def _req(n: int = 16, lo: int = 0, prompt: tuple[int, ...] = (5, 6, 7)) -> GenerationRequest:
    return GenerationRequest(prompt, max_new_tokens=n, min_new_tokens=lo)


def test_step_time_interpolates_between_calibration_points_and_is_flat_outside() -> None:
    points = [(1, 0.002), (8, 0.004), (64, 0.012)]
    assert step_time(points, 1) == 0.002
    assert step_time(points, 0) == 0.002
    assert math.isclose(step_time(points, 36), 0.008)
    assert step_time(points, 500) == 0.012


def test_lengths_are_long_tailed_and_clipped() -> None:
    dist = LengthDistribution(median=10, sigma=1.0, min_tokens=2, max_tokens=200)
    rng = random.Random(0)
    draws = np.array([dist.draw(rng) for _ in range(20000)])
    assert draws.min() >= 2 and draws.max() <= 200
    assert abs(np.median(draws) - 10) <= 1
    assert draws.mean() > 1.4 * np.median(draws), "a long tail pulls the mean above the median"
    flat = LengthDistribution(median=10, sigma=0.0)
    assert {flat.draw(rng) for _ in range(100)} == {10}
    with pytest.raises(ValueError, match="min_tokens"):
        LengthDistribution(min_tokens=9, max_tokens=3)


def test_bad_calibration_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(PluginError, match="step_s"):
        _engine(tmp_path, step_s=[(8, 0.01), (4, 0.02)])
    with pytest.raises(PluginError, match="speed"):
        _engine(tmp_path, speed=0)


async def test_outputs_are_valid_tokens_with_uniform_logprobs(tmp_path: Path) -> None:
    engine = _engine(tmp_path, step_s=[(1, 1e-4)], lengths={"median": 6, "sigma": 1.0})
    tok = engine.context.tokenizer
    vocab = len(tok)
    special = set(tok.all_special_ids)
    outs = await engine.generate([_req(12) for _ in range(200)])
    for out in outs:
        n = len(out.token_ids)
        assert 1 <= n <= 12 and len(out.logprobs) == n and out.version == 0
        body = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
        assert all(0 <= int(t) < vocab and int(t) not in special for t in body)
        if out.finish_reason == "stop":
            assert n < 12 and int(out.token_ids[-1]) == tok.eos_token_id
        else:
            assert n == 12
        np.testing.assert_allclose(out.logprobs, -math.log(vocab - len(special)), rtol=1e-6)
    lengths = [len(o.token_ids) for o in outs]
    assert len(set(lengths)) > 5, "lengths vary from request to request"
    assert any(o.finish_reason == "length" for o in outs), "the tail reaches the budget"


async def test_min_new_tokens_and_budget_bound_the_drawn_length(tmp_path: Path) -> None:
    engine = _engine(tmp_path, step_s=[(1, 1e-4)], lengths={"median": 50, "sigma": 0.1})
    outs = await engine.generate([_req(7, lo=7) for _ in range(20)])
    assert {len(o.token_ids) for o in outs} == {7}
    short = _engine(tmp_path, name="b", step_s=[(1, 1e-4)], lengths={"median": 1, "sigma": 0.0})
    outs = await short.generate([_req(30, lo=4) for _ in range(20)])
    assert {len(o.token_ids) for o in outs} == {4}


async def test_nodes_draw_different_lengths_and_one_node_repeats_its_run(tmp_path: Path) -> None:
    async def lengths(name: str) -> list[int]:
        engine = _engine(tmp_path, name=name, step_s=[(1, 1e-4)])
        return [len(o.token_ids) for o in await engine.generate([_req(200)] * 30)]

    first, again, other = await lengths("n1"), await lengths("n1"), await lengths("n2")
    assert first == again
    assert first != other


async def test_generation_takes_the_drawn_time_at_the_pool_speed(tmp_path: Path) -> None:
    fast = _engine(tmp_path, step_s=[(1, 0.01)], lengths={"median": 10, "sigma": 0.0})
    slow = _engine(
        tmp_path, name="slow", step_s=[(1, 0.01)], lengths={"median": 10, "sigma": 0.0}, speed=0.4
    )
    for engine, least in ((fast, 0.1), (slow, 0.25)):
        started = time.monotonic()
        (out,) = await engine.generate([_req(50)])
        assert len(out.token_ids) == 10
        assert time.monotonic() - started >= least * 0.99  # 10 tokens x 10 ms / speed
        assert out.latency_s >= least * 0.99


async def test_at_most_max_batch_size_sequences_run_at_once(tmp_path: Path) -> None:
    engine = _engine(
        tmp_path, step_s=[(1, 0.01)], lengths={"median": 5, "sigma": 0.0}, max_batch_size=2
    )
    started = time.monotonic()
    outs = await engine.generate([_req(50) for _ in range(6)])
    elapsed = time.monotonic() - started
    assert len(outs) == 6
    assert elapsed >= 3 * 0.05 * 0.99, "six 50 ms requests, two at a time: three waves"
    assert sorted(o.latency_s for o in outs)[-1] >= 0.15 * 0.99, "the last ones queued"


async def test_busy_time_counts_only_time_with_a_sequence_running(tmp_path: Path) -> None:
    engine = _engine(tmp_path, step_s=[(1, 0.01)], lengths={"median": 5, "sigma": 0.0})
    await engine.generate([_req(50), _req(50)])  # overlapping: about 50 ms busy, not 100
    await asyncio.sleep(0.2)  # idle: not counted
    busy = engine.metrics()["busy_s"]
    assert 0.049 <= busy < 0.09, busy
    assert engine.metrics()["requests"] == 2 and engine.metrics()["generated_tokens"] == 10


async def test_weights_first_load_then_simulated_updates(tmp_path: Path) -> None:
    import torch

    engine = _engine(tmp_path, model=False, step_s=[(1, 1e-3)], sync_s=0.1)
    assert engine.version == -1
    with pytest.raises(ServiceUnavailableError, match="no weights"):
        await engine.generate([_req()])
    await engine.load({"w": torch.zeros(2)}, 3)
    assert engine.version == 3
    update = asyncio.create_task(engine.apply(object(), "p", 4))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    started = time.monotonic()
    (out,) = await engine.generate([_req(4)])
    assert time.monotonic() - started >= 0.05, "new sequences wait for the update"
    await update
    assert out.version == 4 and engine.version == 4


async def test_bad_prompts_and_closed_engines_are_refused(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    with pytest.raises(ValidationError, match="outside the vocabulary"):
        await engine.generate([_req(prompt=(1, 10_000))])
    with pytest.raises(ValidationError, match="empty"):
        await engine.generate([_req(prompt=())])
    await engine.close()
    with pytest.raises(ServiceUnavailableError, match="closed"):
        await engine.generate([_req()])


async def test_a_node_with_the_simulated_engine_serves_a_real_dataflow(tmp_path: Path) -> None:
    """A real RolloutNode, real HTTP, real dataflow ingest (vocab and schema checks)."""
    from astraflow.raas.config import NodeConfig
    from astraflow.raas.node import RolloutNode
    from astraflow.records import AckRequest, TakeBatchRequest
    from fixtures.raas import DataflowHarness, dataflow_config, write_tasks

    spec = tiny_spec()
    tasks = write_tasks(tmp_path / "tasks.jsonl")
    harness = DataflowHarness(
        dataflow_config(tmp_path / "df", tasks, vocab_size=len(_context(tmp_path).tokenizer))
    )
    node = RolloutNode(
        NodeConfig.model_validate(
            {
                "dataflow_url": harness.url,
                "weights": str(tmp_path / "no-store"),
                "policies": {
                    "policy": {
                        "model": spec.model_dump(),
                        "engine": {
                            "type": SIMULATED,
                            "step_s": [[1, 0.001], [64, 0.002]],
                            "lengths": {"median": 8, "sigma": 1.0, "max_tokens": 40},
                            "speed": 0.5,
                        },
                    }
                },
                "workflows": {"rlvr": {"sampling": {"max_new_tokens": 40}}},
                "capacity": 4,
                "node_id": "sim-0",
                "pool": "slow",
                "work_dir": str(tmp_path / "node"),
                "idle_wait_s": 0.1,
            }
        )
    )
    client = harness.client()
    runner = asyncio.create_task(node.run())
    try:
        samples: list[Any] = []
        deadline = time.monotonic() + 60
        while len(samples) < 18 and time.monotonic() < deadline:
            request = TakeBatchRequest(
                policy="policy", trainer_version=0, min_samples=1, max_samples=64, timeout_s=2
            )
            batch = await asyncio.to_thread(client.take_batch, request)
            if batch is not None:
                samples += batch.samples
                await asyncio.to_thread(client.ack, AckRequest(batch_id=batch.batch_id))
        assert len(samples) == 18, "every task of the file, as whole groups"
        generated = [int(s.loss_mask.sum()) for s in samples]
        assert min(generated) >= 1 and max(generated) <= 40 and len(set(generated)) > 3
        assert all(s.meta["pool"] == "slow" and s.meta["node"] == "sim-0" for s in samples)
        report = client.report()
        stats = report.nodes["sim-0"].stats
        assert stats.extra["busy_s.policy"] > 0, "engine utilisation reaches the report"
    finally:
        node.request_stop()
        await asyncio.wait_for(runner, 60)
        client.close()
        harness.stop()
