"""Non-finite and oversized numbers: 400 on every route that takes them, nothing stored, and
the report stays readable by every client."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

from astraflow.dataflow.client import DataflowClient
from astraflow.records import MSGPACK_MEDIA_TYPE, LeaseRequest, PolicyVersion, SubmitRequest
from fixtures.dataflow import make_config, make_group, state_snapshot

HUGE = 2**70
INF, NAN = math.inf, math.nan


class Env:
    def __init__(self, url: str, db: Path, task_id: str, secret: str) -> None:
        self.url, self.db, self.task_id, self.secret = url, db, task_id, secret

    def ref(self, **change: Any) -> dict[str, Any]:
        return {"task_id": self.task_id, "attempt": 0, "secret": self.secret, **change}

    def submit(self) -> dict[str, Any]:
        req = SubmitRequest(node_id="n1", task_id=self.task_id, attempt=0, secret=self.secret,
                            samples=make_group(self.task_id))  # fmt: skip
        raw: dict[str, Any] = req.model_dump(mode="json")  # arrays as lists: JSON and msgpack
        return raw


@pytest.fixture
def env(tmp_path: Path, dataflow_factory: Callable[..., str]) -> Iterator[Env]:
    config = make_config(tmp_path / "df")
    url = dataflow_factory(config)
    with DataflowClient(url) as c:
        reply = c.lease(LeaseRequest(node_id="n1", capacity=1, workflows=["rlvr"]))
        (task,) = reply.tasks
        c.announce(PolicyVersion(policy="solver", version=2, manifest="solver/v2/manifest.json"))
    yield Env(url, config.db_path, task.task_id, reply.secrets[task.task_id])


def lease(**change: Any) -> Callable[[Env], dict[str, Any]]:
    def body(e: Env) -> dict[str, Any]:
        return {"node_id": "n1", "capacity": 1, "workflows": ["rlvr"], **change}

    return body


def renew(**change: Any) -> Callable[[Env], dict[str, Any]]:
    return lambda e: {"node_id": "n1", "leases": [e.ref()], **change}


def submit(path: str, value: Any) -> Callable[[Env], dict[str, Any]]:
    def body(e: Env) -> dict[str, Any]:
        raw = e.submit()
        node: Any = raw
        *head, last = path.split(".")
        for p in head:
            node = node[int(p)] if p.isdigit() else node[p]
        node[int(last) if last.isdigit() else last] = value
        return raw

    return body


def _take(**change: Any) -> Callable[[Env], dict[str, Any]]:
    return lambda e: {"policy": "solver", "trainer_version": 2, "timeout_s": 0, **change}


def _announce(**change: Any) -> Callable[[Env], dict[str, Any]]:
    return lambda e: {"policy": "solver", "version": 3, "manifest": "m", **change}


# name: (path, body, field named in the error)
CASES: dict[str, tuple[str, Callable[[Env], dict[str, Any]], str]] = {
    "lease stats inf": ("/v1/lease", lease(stats={"samples_per_s": INF}), "samples_per_s"),
    "lease stats nan extra": ("/v1/lease", lease(stats={"extra": {"x": NAN}}), "extra"),
    "lease stats huge count": ("/v1/lease", lease(stats={"completed": HUGE}), "completed"),
    "lease huge version": ("/v1/lease", lease(versions={"solver": HUGE}), "versions"),
    "renew stats inf latency": (
        "/v1/renew",
        renew(stats={"mean_task_latency_s": INF}),
        "mean_task_latency_s",
    ),
    "renew huge attempt": (
        "/v1/renew",
        lambda e: {"node_id": "n1", "leases": [e.ref(attempt=HUGE)]},
        "attempt",
    ),
    "submit inf reward": ("/v1/submit", submit("samples.0.reward", -INF), "reward"),
    "submit nan in meta": ("/v1/submit", submit("samples.0.meta", {"a": [1.0, NAN]}), "meta"),
    "submit huge int in meta": ("/v1/submit", submit("samples.1.meta", {"n": HUGE}), "meta"),
    "submit huge attempt": ("/v1/submit", submit("attempt", HUGE), "attempt"),
    "submit logprob beyond float32": (
        "/v1/submit",
        submit("samples.0.logprobs", [0.0] * 7 + [3.8e38]),
        "logprobs",
    ),
    "submit token id beyond int32": (
        "/v1/submit",
        submit("samples.0.token_ids", [1, 2, 2**33 + 3, 4, 5, 6, 7, 8]),
        "token_ids",
    ),
    "fail huge attempt": (
        "/v1/fail",
        lambda e: {"node_id": "n1", **e.ref(attempt=HUGE), "error": "x"},
        "attempt",
    ),
    "release huge attempt": (
        "/v1/release",
        lambda e: {"node_id": "n1", "leases": [e.ref(attempt=HUGE)]},
        "attempt",
    ),
    "take huge version": ("/v1/batches/take", _take(trainer_version=HUGE), "trainer_version"),
    "take huge max": ("/v1/batches/take", _take(max_samples=HUGE), "max_samples"),
    "take nan timeout": ("/v1/batches/take", _take(timeout_s=NAN), "timeout_s"),
    "announce huge version": ("/v1/versions", _announce(version=HUGE), "version"),
    "announce nan created_at": ("/v1/versions", _announce(created_at=NAN), "created_at"),
    "announce inf created_at": ("/v1/versions", _announce(created_at=INF), "created_at"),
    "pool size huge": ("/v1/admin/pools", lambda e: {"pool": "p", "nodes": HUGE}, "nodes"),
}


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
@pytest.mark.parametrize("case", list(CASES))
def test_poison_number_is_400_and_report_stays_readable(env: Env, case: str, encoding: str) -> None:
    path, build, field = CASES[case]
    raw = build(env)
    if encoding == "json":
        content, ctype = json.dumps(raw).encode(), "application/json"  # NaN, Infinity tokens
    else:
        content, ctype = msgpack.packb(_u64(raw), use_bin_type=True), MSGPACK_MEDIA_TYPE
    before = state_snapshot(env.db, env.url)
    r = httpx.post(env.url + path, content=content, headers={"content-type": ctype})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"], r.json()
    assert state_snapshot(env.db, env.url) == before
    with DataflowClient(env.url) as c:
        report = c.report()  # every reader (launcher, live view, report.jsonl) parses it
        assert report.tasks.leased == 1


def _u64(value: Any) -> Any:
    """``value`` with integers beyond msgpack's range as the largest it carries (2**64 - 1)."""
    if isinstance(value, dict):
        return {k: _u64(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_u64(v) for v in value]
    return 2**64 - 1 if isinstance(value, int) and value >= 2**64 else value


@pytest.mark.parametrize(
    ("rewards", "metrics"),
    [((1e308, 1e308), {"x": 1e308}), ((1e200, -1e200), {"x": -1.7e308}), ((0.0, 1.0), {})],
)
def test_extreme_finite_numbers_are_stored_and_the_report_stays_readable(
    env: Env, rewards: tuple[float, float], metrics: dict[str, float]
) -> None:
    """Finite values at the float limit are legal: the group's reward figures and the report's
    per-sample means must not overflow (a 500 on submit, or a report no client can read)."""
    many = {f"m{i}": 1.0 for i in range(100)} | metrics  # more names than the report keeps
    samples = [
        s.model_copy(update={"meta": {"metrics": many}})
        for s in make_group(env.task_id, rewards=rewards)
    ]
    with DataflowClient(env.url) as c:
        c.submit(SubmitRequest(node_id="n1", task_id=env.task_id, attempt=0, secret=env.secret,
                               samples=samples))  # fmt: skip
        report = c.report()
        assert report.tasks.done == 1
        figures = report.policies["solver"].sample_metrics
        assert all(math.isfinite(v) for v in figures.values())
        assert len(figures) <= 32
