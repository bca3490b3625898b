"""The engine in a child process of its own (``engine: {process: true}``): the same tokens and
logprobs as in process, weights pulled by the child from the same store, errors that keep
their kind, and no call left hanging when either process dies."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest

from astraflow.errors import AstraflowError, PluginError, ServiceUnavailableError, ValidationError
from astraflow.raas.config import NodeConfig
from astraflow.raas.engines.base import EngineContext, GenerationRequest, build_engine
from astraflow.raas.engines.process import ProcessEngine
from astraflow.raas.node import RolloutNode
from astraflow.raas.policy import NodePolicy
from astraflow.records import AckRequest, TakeBatchRequest
from astraflow.weights import WeightClient
from fixtures.raas import DataflowHarness, PolicyStore, dataflow_config, write_tasks

REQUESTS = [GenerationRequest((5, 14, 6, 17), max_new_tokens=10, seed=i) for i in range(5)] + [
    GenerationRequest((7, 8, 9), max_new_tokens=6, temperature=0.0),
    GenerationRequest((3, 4), max_new_tokens=8, temperature=0.7, top_k=5, top_p=0.9, seed=3),
]


def _context(store: PolicyStore, work: Path, *, model: bool = True) -> EngineContext:
    work.mkdir(parents=True, exist_ok=True)
    return EngineContext(
        policy="policy",
        tokenizer=store.tokenizer,
        work_dir=work,
        model=store.spec if model else None,
        assets_dir=None if model else store.root.parent / "policy-assets",
    )


def _same(a: list[Any], b: list[Any]) -> None:
    assert [o.token_ids.tolist() for o in a] == [o.token_ids.tolist() for o in b]
    assert [o.logprobs.tobytes() for o in a] == [o.logprobs.tobytes() for o in b]
    assert [(o.finish_reason, o.version) for o in a] == [(o.finish_reason, o.version) for o in b]


class MemoryOnly:
    """A weight source the child cannot open itself (not a ``WeightClient``)."""

    def __init__(self, client: WeightClient) -> None:
        self.client = client
        self.loads = 0

    def load(self, policy: str, version: int) -> Any:
        self.loads += 1
        return self.client.load(policy, version)

    def pull(
        self,
        policy: str,
        tensors: MutableMapping[str, Any],
        have: int | None,
        want: int | None = None,
    ) -> Any:
        raise AssertionError("a process engine never pulls through this process")


@contextlib.asynccontextmanager
async def _engines(
    store: PolicyStore, tmp_path: Path, *, remote_model: bool
) -> AsyncIterator[tuple[WeightClient, Any, ProcessEngine]]:
    """A weight client, an in-process engine and one in its own process (closed after)."""
    client = WeightClient(store.root)
    local = build_engine({"type": "transformers", "device": "cpu"}, _context(store, tmp_path / "a"))
    remote = build_engine(
        {"type": "transformers", "device": "cpu", "process": True},
        _context(store, tmp_path / "b", model=remote_model),
    )
    assert isinstance(remote, ProcessEngine) and remote.pid != os.getpid()
    try:
        yield client, local, remote
    finally:
        await local.close()
        await remote.close()
        client.close()


async def test_the_engine_process_generates_and_refreshes_exactly_as_in_process(
    tmp_path: Path, store: PolicyStore
) -> None:
    # the process engine built from the store's assets, the other from the policy's model
    async with _engines(store, tmp_path, remote_model=False) as (client, local, remote):
        for engine in (local, remote):
            await NodePolicy(
                "policy", store.tokenizer, engine, frozen=False, from_store=False
            ).load(client, 0)
        assert remote.version == 0
        _same(await local.generate(REQUESTS), await remote.generate(REQUESTS))
        store.publish_perturbed(1, fraction=0.3)
        store.publish_perturbed(2, fraction=0.3, seed=2)
        for engine in (local, remote):  # two one-version delta pulls, one after the other
            await engine.apply(client, "policy", 1)
            await engine.apply(client, "policy", 2)
        assert remote.version == 2 and set(remote.apply_phases) >= {"pull_s", "swap_s"}
        at_two = await remote.generate(REQUESTS)
        assert {o.version for o in at_two} == {2}
        _same(await local.generate(REQUESTS), at_two)
        figures = remote.metrics()
        assert figures["batches"] >= 2 and figures["process_cpu_s"] > 0


async def test_weights_only_this_process_can_read_are_handed_over_bit_exact(
    tmp_path: Path, store: PolicyStore
) -> None:
    async with _engines(store, tmp_path, remote_model=True) as (client, local, remote):
        source = MemoryOnly(client)
        store.publish_perturbed(1, fraction=0.5)
        await local.apply(client, "policy", 1)
        await remote.apply(source, "policy", 1)  # a full load of tied tensors from memory
        assert source.loads == 1 and remote.version == 1
        _same(await local.generate(REQUESTS), await remote.generate(REQUESTS))


async def test_a_bad_request_fails_alone_with_its_own_error(
    tmp_path: Path, store: PolicyStore
) -> None:
    engine = build_engine(
        {"type": "transformers", "device": "cpu", "process": True}, _context(store, tmp_path)
    )
    try:
        bad = GenerationRequest((5, 10**6), max_new_tokens=4)
        good, failed = await asyncio.gather(
            engine.generate(REQUESTS[:2]), engine.generate([bad]), return_exceptions=True
        )
        assert isinstance(failed, ValidationError) and failed.field == "prompt_ids"
        assert "outside the vocabulary" in str(failed)
        assert isinstance(good, list) and len(good) == 2
        task = asyncio.create_task(
            engine.generate([GenerationRequest((5, 6), max_new_tokens=200, min_new_tokens=200)])
        )
        await asyncio.sleep(0.05)
        task.cancel()  # the caller gave up: the engine keeps serving the others
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(await engine.generate(REQUESTS[:3])) == 3
    finally:
        await engine.close()


def test_an_unknown_engine_option_is_refused_before_a_process_starts(
    tmp_path: Path, store: PolicyStore
) -> None:
    with pytest.raises(PluginError, match="bogus"):
        build_engine(
            {"type": "transformers", "process": True, "bogus": 1}, _context(store, tmp_path)
        )


def test_an_engine_the_child_cannot_build_fails_with_its_error_and_leaves_no_process(
    tmp_path: Path, store: PolicyStore
) -> None:
    before = _children()
    with pytest.raises(AstraflowError, match="no-such-device"):
        build_engine(
            {"type": "transformers", "device": "no-such-device", "process": True},
            _context(store, tmp_path),
        )
    assert _children() == before


def _children() -> set[int]:
    """Live child processes of this one (an exited, unreaped one reads as gone)."""
    me = str(os.getpid())
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == me and fields[0] != "Z":
            out.add(int(stat.parent.name))
    return out


async def test_a_killed_engine_process_fails_waiting_and_later_calls(
    tmp_path: Path, store: PolicyStore
) -> None:
    engine = build_engine(
        {"type": "transformers", "device": "cpu", "process": True}, _context(store, tmp_path)
    )
    assert isinstance(engine, ProcessEngine)
    try:
        os.kill(engine.pid, signal.SIGSTOP)  # the call below cannot be answered before the kill
        waiting = asyncio.create_task(engine.generate(REQUESTS[:2]))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(ServiceUnavailableError, match="exited \\(status -9\\)"):
            await asyncio.wait_for(waiting, 60)
        with pytest.raises(ServiceUnavailableError, match="exited \\(status -9\\)"):
            await engine.generate(REQUESTS[:1])
    finally:
        await engine.close()


CHILD_OF_A_NODE = """
import asyncio, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from fixtures.raas import PolicyStore
from astraflow.raas.engines.base import EngineContext, build_engine

store = PolicyStore(Path({root!r}))
context = EngineContext(policy="policy", tokenizer=store.tokenizer, work_dir=Path({work!r}),
                        model=store.spec)
engine = build_engine({{"type": "transformers", "device": "cpu", "process": True}}, context)
print(engine.pid, flush=True)
time.sleep(600)
"""


def test_the_engine_process_exits_when_its_node_is_killed(tmp_path: Path) -> None:
    tests = str(Path(__file__).resolve().parents[2])
    script = CHILD_OF_A_NODE.format(
        tests=tests, root=str(tmp_path / "store"), work=str(tmp_path / "work")
    )
    (tmp_path / "work").mkdir()
    node = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert node.stdout is not None
        child = int(node.stdout.readline())
        assert Path(f"/proc/{child}").exists()
        node.send_signal(signal.SIGKILL)
        node.wait(30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.1)
        assert not _alive(child), "the engine process outlived its node"
    finally:
        node.kill()
        node.wait()
        if node.stdout is not None:
            node.stdout.close()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"  # a zombie has exited (its parent, init here, reaps it)


async def test_a_node_whose_engine_process_died_stops_instead_of_failing_its_tasks(
    tmp_path: Path, store: PolicyStore, weight_server: str
) -> None:
    tasks = write_tasks(tmp_path / "tasks.jsonl")
    harness = DataflowHarness(dataflow_config(tmp_path / "df", tasks, epochs=None))
    config = NodeConfig.model_validate({
        "dataflow_url": harness.url, "weights": weight_server,
        "policies": {"policy": {"engine": {"process": True}}},
        "workflows": {"rlvr": {"sampling": {"max_new_tokens": 6}}},
        "capacity": 2, "node_id": "node-a", "work_dir": str(tmp_path / "node"),
        "idle_wait_s": 0.1,
    })  # fmt: skip
    node = RolloutNode(config)
    client = harness.client()
    runner = asyncio.create_task(node.run())
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not await asyncio.to_thread(_submitted, client):
            await asyncio.sleep(0.1)
        assert time.monotonic() < deadline, "the node never served a task"
        engine = node.policies["policy"].engine
        assert isinstance(engine, ProcessEngine)
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(ServiceUnavailableError, match="engine of policy 'policy' is gone"):
            await asyncio.wait_for(runner, 60)
    finally:
        node.request_stop()
        if not runner.done():
            runner.cancel()
        client.close()
        harness.stop()


def _submitted(client: Any) -> bool:
    batch = client.take_batch(
        TakeBatchRequest(policy="policy", trainer_version=0, min_samples=1, max_samples=64,
                         timeout_s=0.2),
    )  # fmt: skip
    if batch is None:
        return False
    client.ack(AckRequest(batch_id=batch.batch_id))
    return True
