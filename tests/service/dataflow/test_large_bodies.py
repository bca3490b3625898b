"""Concurrent large submissions: other calls are not held behind them, and the service's peak
memory stays within a small multiple of the decoding budget (``limits.max_decoding_mb``).

The service runs as a real subprocess so its resident memory (``VmHWM``: the peak) can be read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from astraflow.records import MSGPACK_MEDIA_TYPE, LeaseRequest, Sample, SubmitRequest, pack
from fixtures.dataflow import DataflowProcess, make_config

MB = 1024 * 1024
BODIES = 10
TOKENS = 600_000  # two samples of 13 bytes a token: ~15 MB a submission
CAP_MB = 24  # one ~15 MB body at a time


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"{key} not in /proc/{pid}/status")


def _big_submit(task_id: str, attempt: int, secret: str) -> bytes:
    mask = np.ones(TOKENS, dtype=np.uint8)
    mask[:100] = 0
    samples = [
        Sample(policy="solver", task_id=task_id, group_id=task_id,
               token_ids=np.arange(TOKENS) % 64, loss_mask=mask, logprobs=-0.5 * mask,
               versions=np.where(mask > 0, 0, -1), reward=float(r))
        for r in (0, 1)
    ]  # fmt: skip
    return pack(SubmitRequest(node_id="n1", task_id=task_id, attempt=attempt, secret=secret,
                              samples=samples))  # fmt: skip


def _post_until_accepted(url: str, body: bytes, done: list[float], busy: list[int]) -> None:
    """POST a submission, waiting out 503 busy answers as they ask (retry_after_s)."""
    with httpx.Client(timeout=120) as http:
        deadline = time.monotonic() + 300  # a safety net for a hung service, not a budget
        while time.monotonic() < deadline:
            r = http.post(url + "/v1/submit", content=body,
                          headers={"content-type": MSGPACK_MEDIA_TYPE})  # fmt: skip
            if r.status_code == 503:
                busy.append(1)
                time.sleep(r.json()["error"]["retry_after_s"])
                continue
            assert r.status_code == 200 and r.json()["accepted"], r.text
            done.append(time.monotonic())
            return
    raise AssertionError("submission not accepted")


@pytest.mark.slow
def test_large_bodies_do_not_hold_other_calls_and_memory_is_bounded(
    tmp_path: Path, dataflow_process: Callable[..., DataflowProcess]
) -> None:
    config = make_config(
        tmp_path / "df",
        limits={"max_body_mb": 20, "max_decoding_mb": CAP_MB, "busy_retry_after_s": 0.1},
        policies={"solver": {"vocab_size": 64, "max_buffered": 10_000}},
    )
    proc = dataflow_process(config)
    assert proc.proc is not None
    lease = LeaseRequest(node_id="n1", capacity=BODIES + 1, workflows=["rlvr"])
    reply = httpx.post(proc.url + "/v1/lease", content=lease.model_dump_json()).json()
    bodies = [_big_submit(t["task_id"], t["attempt"], reply["secrets"][t["task_id"]])
              for t in reply["tasks"]]  # fmt: skip
    assert len(bodies) == BODIES + 1 and all(12 * MB < len(b) < 20 * MB for b in bodies)
    _post_until_accepted(proc.url, bodies.pop(), [], [])  # warm-up: one alone
    base = _status(proc.proc.pid, "VmRSS")

    done: list[float] = []
    busy: list[int] = []  # 503s: bodies that waited past busy_wait_s (allowed, not required)
    start = time.monotonic()
    threads = [
        threading.Thread(target=_post_until_accepted, args=(proc.url, b, done, busy))
        for b in bodies
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)  # every body is on its way or queued
    small = LeaseRequest(node_id="n2", capacity=1, workflows=["rlvr"]).model_dump_json()
    lease_start = time.monotonic()
    r = httpx.post(proc.url + "/v1/lease", content=small, timeout=120)
    lease_done = time.monotonic()
    assert r.status_code == 200 and len(r.json()["tasks"]) == 1
    for t in threads:
        t.join()
    storm = max(done) - start

    # the lease completed while large submissions were in progress, not behind the bodies the
    # service had received: its latency is a fraction of the time the rest of them still took
    # (how many bodies finish before the lease is sent depends on the machine's speed)
    after_lease = sum(d > lease_done for d in done)
    assert after_lease >= 2, f"only {after_lease} of {BODIES} submissions were left in progress"
    latency, rest = lease_done - lease_start, max(done) - lease_start
    assert latency < rest / 3, f"the lease took {latency:.2f} s of the {rest:.2f} s left"
    assert storm > 1.5 * (lease_done - start), "the lease did not overlap the submissions"
    peak = _status(proc.proc.pid, "VmHWM")
    assert peak - base < 6 * CAP_MB * MB, (
        f"peak grew {(peak - base) / MB:.0f} MB over {base / MB:.0f} MB"
    )
    report = httpx.get(proc.url + "/v1/report").json()
    assert report["tasks"]["done"] == BODIES + 1
