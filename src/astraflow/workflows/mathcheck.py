"""Math answer checking with math-verify, in worker processes that enforce a timeout.

math-verify bounds its own work with ``signal.alarm``, which only works on the main thread,
so it cannot run inside a rollout node's event loop or executor. Here it runs with its own
timeouts off in small worker processes (``python -m astraflow.workflows.mathcheck``, JSON
lines over pipes, no pickle); a worker that passes the timeout is killed and replaced.

    caller ──(gold, pred)──► idle worker ──► {"ok": bool} ──► worker back to the idle queue
                                 │ no answer within timeout_s
                                 └─► SIGKILL, start a fresh worker, raise TimeoutError

A worker says it is ready once math-verify (and sympy) are imported, ~1 s, more on a loaded
machine: that start is not part of any check's ``timeout_s`` (it was, and a fresh worker's
first check on a busy machine timed out, scoring a right answer 0, and its replacement
started over), and is bounded by ``START_TIMEOUT_S`` instead.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import json
import logging
import queue
import select
import subprocess
import sys
import threading
from typing import IO, Any

from astraflow.errors import RewardError
from astraflow.workflows.gate import Gate

__all__ = ["MathVerifyPool", "as_gold", "shared_pool"]

log = logging.getLogger(__name__)

#: Seconds a new worker has to import math-verify and say it is ready.
START_TIMEOUT_S = 120.0


def as_gold(answer: Any) -> str:
    """A reference answer in the form math-verify parses reliably: wrapped in ``$…$``."""
    text = str(answer).strip()
    if "$" in text or "\\boxed" in text or "\\(" in text:
        return text
    return f"${text}$"


class _Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "astraflow.workflows.mathcheck"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin: IO[bytes] = self.proc.stdin
        self.stdout: IO[bytes] = self.proc.stdout
        self.started = False

    def ask(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        """Send one request; the reply, or None when none came within ``timeout_s`` (counted
        from when the worker is ready: its start is bounded by ``START_TIMEOUT_S``)."""
        if not self.started:
            hello = self._line(START_TIMEOUT_S)
            if hello is None or not hello.get("ready"):
                raise RewardError(f"math-verify worker did not start: {hello}")
            self.started = True
        self.stdin.write(json.dumps(request).encode() + b"\n")
        self.stdin.flush()
        return self._line(timeout_s)

    def _line(self, timeout_s: float) -> dict[str, Any] | None:
        ready, _, _ = select.select([self.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = self.stdout.readline()
        if not line:
            raise RewardError("math-verify worker exited unexpectedly")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        for stream in (self.stdin, self.stdout):
            with contextlib.suppress(OSError):
                stream.close()
        self.proc.wait()


class MathVerifyPool:
    """``workers`` math-verify processes; each check is bounded by ``timeout_s``."""

    def __init__(self, workers: int = 1, timeout_s: float = 5.0) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError("workers must be >= 1 and timeout_s > 0")
        self.timeout_s = timeout_s
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        self._lock = threading.Lock()
        self._all: set[_Worker] = set()
        self._closed = False
        self.timeouts = 0
        self._gate = Gate(workers)
        for _ in range(workers):
            self._idle.put(None)  # a slot; the process starts on first use

    def verify_sync(self, gold: str, prediction: str) -> bool:
        """Whether ``prediction`` states the same answer as ``gold`` (blocking).

        Raises:
            TimeoutError: the check ran past ``timeout_s`` (its worker was replaced).
            RewardError: math-verify failed or its worker died.
        """
        worker = self._checkout()
        try:
            reply = worker.ask({"gold": gold, "pred": prediction}, self.timeout_s)
        except (OSError, ValueError, RewardError) as exc:
            self._discard(worker)
            raise RewardError(f"math-verify worker failed: {exc}") from exc
        if reply is None:
            self._discard(worker)
            self.timeouts += 1
            raise TimeoutError(f"math-verify took longer than {self.timeout_s}s")
        self._idle.put(worker)
        if "error" in reply:
            raise RewardError(f"math-verify failed: {reply['error']}")
        return bool(reply["ok"])

    async def verify(self, gold: str, prediction: str) -> bool:
        """``verify_sync`` off the event loop (callers beyond ``workers`` wait here)."""
        async with self._gate:
            return await asyncio.to_thread(self.verify_sync, gold, prediction)

    def close(self) -> None:
        """Kill every worker."""
        with self._lock:
            self._closed = True
            workers, self._all = list(self._all), set()
        for worker in workers:
            worker.kill()

    def _checkout(self) -> _Worker:
        slot = self._idle.get()
        if slot is not None:
            if slot.proc.poll() is None:
                return slot
            slot.kill()  # died while idle: replace it
            with self._lock:
                self._all.discard(slot)
        with self._lock:
            if self._closed:
                self._idle.put(None)
                raise RewardError("math-verify pool is closed")
            worker = _Worker()
            self._all.add(worker)
        return worker

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._all.discard(worker)
        self._idle.put(None)


@functools.cache
def shared_pool(workers: int = 1, timeout_s: float = 5.0) -> MathVerifyPool:
    """One pool per process and setting, shared by every math reward; its workers are
    stopped when the process exits (their pipes closed, their exit waited for)."""
    pool = MathVerifyPool(workers, timeout_s)
    atexit.register(pool.close)
    return pool


def _serve() -> None:
    """Worker loop: one JSON request per stdin line, one JSON reply per stdout line."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" notes
    from math_verify import parse, verify

    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            gold = parse(str(request["gold"]), parsing_timeout=None)
            pred = parse(str(request["pred"]), parsing_timeout=None)
            reply: dict[str, Any] = {"ok": bool(verify(gold, pred, timeout_seconds=None))}
        except Exception as exc:  # reported to the caller, who raises RewardError
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
