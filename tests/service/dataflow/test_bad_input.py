"""Bad input over HTTP: each case is a 4xx naming the problem, and stored state is unchanged."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

from astraflow.dataflow.client import DataflowClient
from astraflow.records import (
    MSGPACK_MEDIA_TYPE,
    LeaseRequest,
    PolicyVersion,
    SubmitRequest,
    Task,
    pack,
)
from fixtures.dataflow import NO_SECRET, make_config, make_group, state_snapshot

JSON = {"content-type": "application/json"}
MSGPACK = {"content-type": MSGPACK_MEDIA_TYPE}


class Env:
    def __init__(self, url: str, db: Path, task: Task, secret: str) -> None:
        self.url, self.db, self.task, self.secret = url, db, task, secret

    def submit_body(self, mutate: Callable[[dict[str, Any]], None] | None = None) -> bytes:
        req = SubmitRequest(
            node_id="n1",
            task_id=self.task.task_id,
            attempt=0,
            secret=self.secret,
            samples=make_group(self.task, rewards=(0.0, 1.0, 0.5)),
        )
        raw = msgpack.unpackb(pack(req))
        if mutate is not None:
            mutate(raw)
        return bytes(msgpack.packb(raw, use_bin_type=True))

    def snapshot(self) -> dict[str, Any]:
        """Every row of every table (read-only), plus the service's own report counts."""
        return state_snapshot(self.db, self.url)


@pytest.fixture
def env(tmp_path: Path, dataflow_factory: Callable[..., str]) -> Iterator[Env]:
    config = make_config(tmp_path / "df", limits={"max_body_mb": 0.05})
    url = dataflow_factory(config)
    with DataflowClient(url) as c:
        reply = c.lease(LeaseRequest(node_id="n1", capacity=1, workflows=["rlvr"]))
        (task,) = reply.tasks
        c.announce(PolicyVersion(policy="solver", version=2, manifest="solver/v2/manifest.json"))
    yield Env(url, config.db_path, task, reply.secrets[task.task_id])


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(raw: dict[str, Any]) -> None:
        node: Any = raw
        *head, last = path.split(".")
        for p in head:
            node = node[int(p)] if p.isdigit() else node[p]
        node[int(last) if last.isdigit() else last] = value

    return mutate


def _retask(task_id: str) -> Callable[[dict[str, Any]], None]:
    def mutate(raw: dict[str, Any]) -> None:
        raw["task_id"] = task_id
        for sample in raw["samples"]:
            sample["task_id"] = sample["group_id"] = task_id

    return mutate


def _bytes(dtype: str, values: list[float]) -> bytes:
    import numpy as np

    return np.asarray(values, dtype=dtype).astype(np.dtype(dtype).newbyteorder("<")).tobytes()


def _chunks(n: int) -> Iterator[bytes]:
    for _ in range(n):
        yield b"x" * 10_000


# name: (method, path, headers, body builder, status, message pattern)
CASES: dict[str, tuple[str, str, dict[str, str], Callable[[Env], Any], int, str]] = {
    "malformed json": ("POST", "/v1/lease", JSON, lambda e: b"{not json", 400, "Invalid JSON"),
    "wrong type": (
        "POST",
        "/v1/lease",
        JSON,
        lambda e: json.dumps({"node_id": "n1", "capacity": "lots", "workflows": ["rlvr"]}),
        400,
        "capacity",
    ),
    "unknown field": (
        "POST",
        "/v1/lease",
        JSON,
        lambda e: json.dumps(
            {"node_id": "n1", "capacity": 1, "workflows": ["rlvr"], "colour": "red"}
        ),
        400,
        "colour",
    ),
    "bad node name": (
        "POST",
        "/v1/lease",
        JSON,
        lambda e: json.dumps({"node_id": "a b", "capacity": 1, "workflows": ["rlvr"]}),
        400,
        "node_id",
    ),
    "empty body": ("POST", "/v1/submit", MSGPACK, lambda e: b"", 400, "empty body"),
    "not msgpack": ("POST", "/v1/submit", MSGPACK, lambda e: b"\xc1\xc1\xc1", 400, "msgpack"),
    "wrong content type": (
        "POST",
        "/v1/submit",
        {"content-type": "text/plain"},
        lambda e: e.submit_body(),
        400,
        "Content-Type",
    ),
    "token id out of vocab": (
        "POST",
        "/v1/submit",
        MSGPACK,
        lambda e: e.submit_body(_set("samples.1.token_ids", _bytes("int32", [1] * 7 + [64]))),
        400,
        "token id 64 is outside the vocabulary",
    ),
    "mismatched lengths": (
        "POST",
        "/v1/submit",
        MSGPACK,
        lambda e: e.submit_body(_set("samples.0.logprobs", _bytes("float32", [0.0] * 5))),
        400,
        "logprobs.*has 5 entries but token_ids has 8",
    ),
    "nan reward": (
        "POST",
        "/v1/submit",
        MSGPACK,
        lambda e: e.submit_body(_set("samples.2.reward", math.nan)),
        400,
        "reward.*finite",
    ),
    "inf logprob": (
        "POST",
        "/v1/submit",
        MSGPACK,
        lambda e: e.submit_body(
            _set("samples.0.logprobs", _bytes("float32", [-math.inf] + [0.0] * 7))
        ),
        400,
        "logprobs.*non-finite",
    ),
    "unknown policy": (
        "POST",
        "/v1/submit",
        MSGPACK,
        lambda e: e.submit_body(_set("samples.2.policy", "ghost")),
        400,
        "unknown policy 'ghost'",
    ),
    "negative attempt": (
        "POST",
        "/v1/submit",
        MSGPACK,
        lambda e: e.submit_body(_set("attempt", -1)),
        400,
        "attempt",
    ),
    "sample of another task": (
        "POST",
        "/v1/submit",
        MSGPACK,
        lambda e: e.submit_body(_set("task_id", "arith/nope@e0")),
        400,
        "submission is for",
    ),
    "unknown task": (
        "POST",
        "/v1/submit",
        MSGPACK,
        lambda e: e.submit_body(_retask("arith/nope@e0")),
        404,
        "unknown task",
    ),
    "oversize body": ("POST", "/v1/submit", MSGPACK, lambda e: b"\0" * 60_000, 413, "limit"),
    "oversize chunked body": ("POST", "/v1/submit", MSGPACK, lambda e: _chunks(6), 413, "limit"),
    "take for unknown policy": (
        "POST",
        "/v1/batches/take",
        JSON,
        lambda e: json.dumps({"policy": "ghost", "trainer_version": 0}),
        404,
        "unknown policy 'ghost'",
    ),
    "take min above max": (
        "POST",
        "/v1/batches/take",
        JSON,
        lambda e: json.dumps(
            {"policy": "solver", "trainer_version": 0, "min_samples": 9, "max_samples": 2}
        ),
        400,
        "min_samples",
    ),
    "ack unknown batch": (
        "POST",
        "/v1/batches/ack",
        JSON,
        lambda e: json.dumps({"batch_id": "nope"}),
        404,
        "unknown batch",
    ),
    "announce older version": (
        "POST",
        "/v1/versions",
        JSON,
        lambda e: json.dumps({"policy": "solver", "version": 1, "manifest": "m"}),
        409,
        "already at version 2",
    ),
    "announce unknown policy": (
        "POST",
        "/v1/versions",
        JSON,
        lambda e: json.dumps({"policy": "ghost", "version": 1, "manifest": "m"}),
        404,
        "unknown policy",
    ),
    "watch with a version below -1": (
        "POST",
        "/v1/versions/watch",
        JSON,
        lambda e: json.dumps({"known": {"solver": -2}, "timeout_s": 0}),
        400,
        "known.*-1",
    ),
    "watch for too long": (
        "POST",
        "/v1/versions/watch",
        JSON,
        lambda e: json.dumps({"known": {"solver": 0}, "timeout_s": 1e9}),
        400,
        "timeout_s",
    ),
    "watch a policy named badly": (
        "POST",
        "/v1/versions/watch",
        JSON,
        lambda e: json.dumps({"known": {"../x": 0}, "timeout_s": 0}),
        400,
        "known",
    ),
    "fail without lease": (
        "POST",
        "/v1/fail",
        JSON,
        lambda e: json.dumps(
            {
                "node_id": "n2",
                "task_id": e.task.task_id,
                "attempt": 0,
                "error": "x",
                "secret": NO_SECRET,
            }
        ),
        403,
        "wrong lease secret",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_and_changes_nothing(env: Env, case: str) -> None:
    method, path, headers, build, status, pattern = CASES[case]
    before = env.snapshot()
    r = httpx.request(method, env.url + path, headers=headers, content=build(env))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] and error["message"]
    assert re.search(pattern, error["message"]), error["message"]
    assert env.snapshot() == before
    # the lease still works: the good submission is accepted afterwards
    ok = httpx.post(env.url + "/v1/submit", headers=MSGPACK, content=env.submit_body())
    assert ok.status_code == 200 and ok.json()["accepted"]
