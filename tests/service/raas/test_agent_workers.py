"""The ``agent`` workflow with ``workers`` > 0: agents in worker processes of their own.

Real worker processes (``python -m astraflow.workflows.agent_worker``) reach the endpoint
over loopback HTTP; the node's engine produces every token. Checked: the trained tokens and
logprobs are the engine's, bit for bit; tools run in the node; an agent's stdout does not
reach the protocol; an agent that raises, returns something that is not JSON or kills its
process fails its episode only (the next one gets a new worker); cancelling an episode
cancels it in the worker; stopping the endpoint stops the workers.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import numpy as np
import pytest

from astraflow.errors import WorkflowError
from astraflow.raas.endpoint import AgentEndpoint
from fixtures.workflows import TinyPolicy, agent_task, agent_workflow, record_generations

pytest.importorskip("openai")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_agents_in_workers_train_on_the_engines_tokens(
    endpoint: AgentEndpoint, node_policy: Any
) -> None:
    policy, tok = node_policy, node_policy.tokenizer
    produced = record_generations(policy)
    wf = agent_workflow(endpoint, "fixtures.agents:worker_agent", workers=2, tools=["calculator"])
    tasks = [agent_task(f"w{i}", prompt=f"ep{i}", turns=3, max_tokens=4) for i in range(8)]
    results = await asyncio.gather(*(wf(t, {"policy": policy}, {}) for t in tasks))
    assert wf.workers is not None and wf.workers.started == 2
    pids = set(wf.workers.pids())
    assert len(pids) == 2 and os.getpid() not in pids
    by_prompt = {tuple(g.prompt_ids.tolist()): g for g in produced}
    for task, (sample,) in zip(tasks, results, strict=True):
        assert sample.reward == 1.0 and sample.meta["turns"] == 3
        assert int(sample.meta["agent.pid"]) in pids, "the agent ran in a worker"
        assert sample.meta["agent.calculator"] == 42.0, "the node's calculator, by proxy"
        # every trained run is a generation of the engine, tokens and logprobs bit for bit
        trained = np.flatnonzero(sample.loss_mask)
        runs = np.split(trained, np.flatnonzero(np.diff(trained) > 1) + 1)
        assert len(runs) == 3
        for run in runs:
            gen = by_prompt[tuple(sample.token_ids[: run[0]].tolist())]
            assert np.array_equal(sample.token_ids[run], gen.token_ids)
            assert np.array_equal(sample.logprobs[run], gen.logprobs)
        assert tok.decode(sample.token_ids.tolist()).count(task.payload["prompt"]) == 3
    await endpoint.stop()
    await asyncio.sleep(0)
    assert not any(_alive(pid) for pid in pids), "stopping the endpoint stops its workers"


async def test_a_failing_agent_fails_its_episode_and_the_next_gets_a_worker(
    endpoint: AgentEndpoint,
) -> None:
    policy = TinyPolicy("policy")
    wf = agent_workflow(endpoint, "fixtures.agents:worker_agent", workers=1)
    (first,) = await wf(agent_task("ok-1", prompt="hi"), {"policy": policy}, {})
    assert first.meta["agent.calculator"] == -1.0, "no tools configured: none handed over"
    assert wf.workers is not None
    (pid,) = wf.workers.pids()
    with pytest.raises(WorkflowError, match=r"exited \(code 7\)"):
        await wf(agent_task("dies", prompt="hi", exit=7), {"policy": policy}, {})
    with pytest.raises(WorkflowError, match="returned object"):
        await wf(agent_task("object", prompt="hi", returns="object"), {"policy": policy}, {})
    (after,) = await wf(agent_task("ok-2", prompt="hi"), {"policy": policy}, {})
    assert after.reward == 1.0
    assert wf.workers.started == 2 and int(after.meta["agent.pid"]) != pid
    assert endpoint.metrics()["sessions"] == 0, "every episode's key was revoked"
    raising = agent_workflow(endpoint, "fixtures.agents:failing_agent", workers=1)
    with pytest.raises(WorkflowError, match="the agent crashed"):
        await raising(agent_task("raises"), {"policy": policy}, {})


async def test_cancelling_an_episode_cancels_it_in_the_worker(endpoint: AgentEndpoint) -> None:
    stopped = asyncio.Event()

    class Slow(TinyPolicy):
        async def generate(self, *args: Any, **kw: Any) -> Any:
            try:
                await asyncio.sleep(3600)
            finally:
                stopped.set()

    wf = agent_workflow(endpoint, "fixtures.agents:worker_agent", workers=1)
    slow = agent_task("slow", prompt="hi")
    episode = asyncio.create_task(wf(slow, {"policy": Slow("policy")}, {}))
    while endpoint.metrics()["requests"] < 1:  # the agent's call reached the node
        await asyncio.sleep(0.01)
    episode.cancel()
    with pytest.raises(asyncio.CancelledError):
        await episode
    # the worker cancelled the agent, its client hung up, the node stopped generating
    await asyncio.wait_for(stopped.wait(), 60)
    assert endpoint.metrics()["sessions"] == 0
    assert wf.workers is not None and wf.workers.pids(), "the worker stays up"
    (sample,) = await wf(agent_task("next", prompt="hi"), {"policy": TinyPolicy("policy")}, {})
    assert sample.reward == 1.0 and wf.workers.started == 1


async def test_an_entry_a_worker_cannot_import_is_named() -> None:
    from astraflow.workflows.agent_worker import AgentWorkers, WorkerSpec

    pool = AgentWorkers(WorkerSpec("fixtures.agents:worker_agent", 5.0, sys_path=["/nowhere"]), 1)
    with pytest.raises(WorkflowError, match="did not start: .*fixtures"):
        await pool.run({}, base_url="", api_key="", client="openai", extra={}, tools=None)
    await pool.aclose()
