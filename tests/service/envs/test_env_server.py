"""``astraflow env serve`` on loopback: concurrent sessions give the same episodes as
in-process environments, auth, session bounds and idle expiry, bad input, and a node whose
environment server is killed mid-run (tasks fail, are re-queued, and finish once it is back)."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from astraflow.envs import EnvFactory
from astraflow.envs.server import EnvServerConfig, ThreadedEnvServer
from astraflow.errors import EnvError
from fixtures.envs import COUNTDOWN, server_command, subprocess_env
from fixtures.net import free_port


def _start(tmp: Path, port: int, *args: str, token: str | None = None) -> subprocess.Popen[bytes]:
    env = subprocess_env()
    if token is not None:
        env["ASTRAFLOW_ENV_TOKEN"] = token
    with (tmp / f"env-server-{port}.log").open("ab") as log:
        proc = subprocess.Popen(
            server_command("--port", str(port), *args),
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp / f"env-server-{port}.log").read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError("env server did not start")


def _config(**kw: Any) -> EnvServerConfig:
    return EnvServerConfig.model_validate({"env": "gridnav", "port": 0, **kw})


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@pytest.fixture
def gridnav_server(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proc = _start(tmp_path, port, "--env", "gridnav", "--set", "env.holdout=0.2")
    yield f"http://127.0.0.1:{port}"
    _kill(proc)


async def _play(factory: EnvFactory, seed: int) -> list[Any]:
    """An episode of seeded random actions (some invalid), every step recorded."""
    rng = random.Random(seed)
    env = await factory.acreate()
    try:
        trace: list[Any] = [await env.areset(seed=seed, options={"split": "train"})]
        for _ in range(12):
            step = await env.astep(rng.choice(["n", "s", "e", "w", "jump"]))
            trace.append(step)
            if step[2] or step[3]:
                break
        return trace
    finally:
        await env.aclose()


async def test_32_concurrent_sessions_match_in_process(gridnav_server: str) -> None:
    remote = EnvFactory({"type": "remote", "url": gridnav_server})
    local = EnvFactory({"type": "gridnav", "holdout": 0.2})
    seeds = list(range(100, 132))
    served = await asyncio.gather(*(_play(remote, s) for s in seeds))
    in_process = [await _play(local, s) for s in seeds]
    assert served == in_process
    assert sum(len(t) - 1 for t in served) > 64, "episodes of several steps"
    assert any(t[-1][2] for t in served) and any(t[-1][3] for t in served), "won and lost"
    health = httpx.get(f"{gridnav_server}/health").json()
    assert health["sessions"] == 0, "every session was closed by its client"


async def test_the_env_workflow_gives_the_same_samples_remote_and_in_process(
    gridnav_server: str,
) -> None:
    import zlib

    from astraflow.records import Task
    from astraflow.workflows.registry import WORKFLOWS
    from fixtures.workflows import TinyPolicy

    policy = TinyPolicy("policy", script=lambda p: "nsewx"[zlib.crc32(p.encode()) % 5] + "\n")
    out = []
    for env in ({"type": "remote", "url": gridnav_server}, {"type": "gridnav", "holdout": 0.2}):
        workflow = WORKFLOWS.build(
            {"type": "env", "env": env, "sampling": {"max_new_tokens": 2, "stop": ["\n"]}}
        )
        tasks = [
            Task(task_id=f"t{i}", workflow="env", payload={"seed": i}, group_size=2)
            for i in range(8)
        ]
        groups = await asyncio.gather(*(workflow(t, {"policy": policy}, {}) for t in tasks))
        out.append([(s.token_ids.tolist(), s.reward, s.meta["turns"]) for g in groups for s in g])
    assert out[0] == out[1]


def test_tokens_missing_401_wrong_403_health_open() -> None:
    server = ThreadedEnvServer(
        EnvServerConfig.model_validate({"env": "gridnav", "port": 0, "token": "s3cret"})
    )
    url = server.start()
    try:
        assert httpx.get(f"{url}/health").status_code == 200
        calls = [("POST", "/reset", {"seed": 1}), ("GET", "/state?episode_id=x", None),
                 ("POST", "/step", {"episode_id": "x", "action": {"message": "n"}})]  # fmt: skip
        for method, path, body in calls:
            missing = httpx.request(method, url + path, json=body)
            assert missing.status_code == 401, path
            assert missing.json()["error"]["code"] == "unauthorized"
            wrong = httpx.request(method, url + path, json=body,
                                  headers={"Authorization": "Bearer nope"})  # fmt: skip
            assert wrong.status_code == 403, path
        good = {"Authorization": "Bearer s3cret"}
        reply = httpx.post(f"{url}/reset", json={"seed": 1}, headers=good)
        assert reply.status_code == 200 and reply.json()["observation"]["text"].startswith("goal")
        assert len(server.server.config.app.state.env_server.pool.sessions) == 1  # type: ignore[attr-defined]
    finally:
        server.stop()


async def test_remote_env_without_token_fails_with_an_env_error() -> None:
    server = ThreadedEnvServer(
        EnvServerConfig.model_validate({"env": "gridnav", "port": 0, "token": "s3cret"})
    )
    url = server.start()
    try:
        env = await EnvFactory({"type": "remote", "url": url}).acreate()
        with pytest.raises(EnvError, match="401"):
            await env.areset(seed=1)
        await env.aclose()
        env = await EnvFactory({"type": "remote", "url": url, "token": "s3cret"}).acreate()
        obs, _ = await env.areset(seed=1)
        assert isinstance(obs, str) and obs.startswith("goal")
        await env.aclose()
    finally:
        server.stop()


def test_sessions_are_bounded_expire_when_idle_and_bad_input_changes_nothing() -> None:
    config = EnvServerConfig.model_validate({"env": "gridnav", "port": 0, "max_sessions": 2,
                                             "idle_timeout_s": 2.0, "max_body_kb": 1})  # fmt: skip
    server = ThreadedEnvServer(config)
    url = server.start()
    try:
        a = httpx.post(f"{url}/reset", json={"seed": 1}).json()["episode_id"]
        httpx.post(f"{url}/reset", json={"seed": 2})
        full = httpx.post(f"{url}/reset", json={"seed": 3})
        assert full.status_code == 503 and "sessions" in full.json()["error"]["message"]
        before = httpx.get(f"{url}/state", params={"episode_id": a}).json()
        for body in (
            b"{not json",
            json.dumps({"episode_id": a}).encode(),
            json.dumps({"episode_id": a, "action": {"message": "n" * 4096}}).encode(),
        ):
            bad = httpx.post(f"{url}/step", content=body)
            assert bad.status_code in (400, 413), bad.text
        assert httpx.get(f"{url}/state", params={"episode_id": a}).json() == before
        time.sleep(4.0)
        gone = httpx.post(f"{url}/step", json={"episode_id": a, "action": {"message": "n"}})
        assert gone.status_code == 404 and "expired" in gone.json()["error"]["message"]
        health = httpx.get(f"{url}/health").json()
        assert health["sessions"] == 0 and health["expired_sessions"] == 2
    finally:
        server.stop()


def test_an_env_that_raises_answers_500_and_closes_the_session() -> None:
    server = ThreadedEnvServer(
        EnvServerConfig.model_validate({"env": {"type": COUNTDOWN, "raise_at": 2}, "port": 0})
    )
    url = server.start()
    try:
        sid = httpx.post(f"{url}/reset", json={"seed": 1}).json()["episode_id"]
        ok = httpx.post(f"{url}/step", json={"episode_id": sid, "action": {"message": "a"}})
        assert ok.status_code == 200 and ok.json()["observation"]["text"] == "d4 >"
        broke = httpx.post(f"{url}/step", json={"episode_id": sid, "action": {"message": "a"}})
        assert broke.status_code == 500 and broke.json()["error"]["code"] == "env"
        assert "countdown broke" in broke.json()["error"]["message"]
        assert httpx.get(f"{url}/state", params={"episode_id": sid}).status_code == 404
    finally:
        server.stop()


@pytest.mark.e2e
async def test_killing_the_env_server_fails_its_tasks_and_the_run_goes_on(
    tmp_path: Path, weight_root: Path, weight_server: str
) -> None:
    """A node runs ``env`` tasks against a served environment; the server is killed while
    episodes are in flight: those tasks fail (no sample), are re-queued, and every task
    completes once the server is back on the same port."""
    from astraflow.raas.config import NodeConfig
    from astraflow.raas.node import RolloutNode
    from fixtures.raas import DataflowHarness, PolicyStore, dataflow_config

    store = PolicyStore(weight_root, max_position_embeddings=512)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": str(i), "seed": i}) + "\n" for i in range(8)))
    lease = {"ttl_s": 30, "max_attempts": 100, "retry_after_s": 0.3}
    config = dataflow_config(tmp_path / "df", tasks, workflow="env", lease=lease)
    harness = DataflowHarness(config)
    port = free_port()
    args = ("--env", COUNTDOWN, "--set", "env.turns=4", "--set", "env.step_sleep_s=0.25")
    proc = _start(tmp_path, port, *args)
    url = f"http://127.0.0.1:{port}"
    node = RolloutNode(
        NodeConfig.model_validate({
            "dataflow_url": harness.url, "weights": weight_server, "policies": {"policy": {}},
            "workflows": {"env": {"env": {"type": "remote", "url": url},
                                  "sampling": {"max_new_tokens": 3, "stop": [">"]}}},
            "capacity": 2, "node_id": "node-a", "pool": "p", "work_dir": str(tmp_path / "node"),
            "idle_wait_s": 0.1,
        })
    )  # fmt: skip
    client = harness.client()
    runner = asyncio.create_task(node.run())
    try:
        await _until(lambda: httpx.get(f"{url}/health").json()["sessions"] > 0, 60)
        _kill(proc)
        await _until(lambda: node.meter.failed >= 1, 60)
        done_while_down = client.report().tasks.done
        proc = _start(tmp_path, port, *args)
        await _until(lambda: client.report().tasks.done == 8, 120)
        report = client.report()
        assert (report.tasks.done, report.tasks.failed) == (8, 0)
        assert done_while_down < 8
        figures = report.policies["policy"].sample_metrics
        assert figures["env/turns"] == 4.0 and 0.0 <= figures["env/success"] <= 1.0
        samples = await _take_all(client, 16)
        assert len(samples) == 16, "every task's group exactly once, none from a failed attempt"
        assert set(Counter(s.task_id for s in samples).values()) == {2}
        assert all(s.meta["turns"] == 4 for s in samples), "no truncated episode was trained"
    finally:
        node.request_stop()
        await asyncio.wait_for(runner, 60)
        client.close()
        harness.stop()
        _kill(proc)
        store.close()


async def _until(check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def _take_all(client: Any, n: int) -> list[Any]:
    from astraflow.records import AckRequest, TakeBatchRequest

    samples: list[Any] = []
    deadline = time.monotonic() + 30
    while len(samples) < n and time.monotonic() < deadline:
        request = TakeBatchRequest(policy="policy", trainer_version=0, min_samples=1,
                                   max_samples=64, timeout_s=1.0)  # fmt: skip
        batch = await asyncio.to_thread(client.take_batch, request)
        if batch is not None:
            samples += batch.samples
            await asyncio.to_thread(client.ack, AckRequest(batch_id=batch.batch_id))
    return samples


def test_hostile_json_gets_400_not_a_crash() -> None:
    """Bodies within the size limit that break a naive parser: nesting past the interpreter's
    recursion limit and a lone UTF-16 surrogate. Each is refused as bad input."""
    server = ThreadedEnvServer(EnvServerConfig.model_validate({"env": "gridnav", "port": 0}))
    url = server.start()
    try:
        a = httpx.post(f"{url}/reset", json={"seed": 1}).json()["episode_id"]
        before = httpx.get(f"{url}/state", params={"episode_id": a}).json()
        for body in (
            b'{"episode_id": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            b'{"episode_id": "%s", "action": {"message": "\\ud800"}}' % a.encode(),
        ):
            bad = httpx.post(f"{url}/step", content=body)
            assert bad.status_code == 400, bad.text
            assert "not JSON" in bad.json()["error"]["message"]
        assert httpx.get(f"{url}/state", params={"episode_id": a}).json() == before
    finally:
        server.stop()
