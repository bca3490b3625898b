"""Agent worker processes: the ``agent`` workflow's episodes run off the node's interpreter.

With ``workers: N`` (N > 0) the ``agent`` workflow runs its agent function in N processes of
its own (``python -m astraflow.workflows.agent_worker``) instead of the node's. Each episode
still gets its own session (API key) on the node's endpoint; the agent's ``openai`` client
reaches it over loopback HTTP. What moves off the node's interpreter is the agent's own CPU:
the SDK's request building and reply parsing (~1.3 ms a call) and whatever the agent
computes between calls, which in the node's process holds the GIL the engine's decoding
loop needs. A crash, a blocked event loop or a stray ``print`` in agent code cannot stall
the node either: a worker that dies fails the episodes it was running (their tasks are
re-queued, as for any failing workflow) and the next episode starts a new one.

The node and a worker speak JSON lines over the worker's stdin and a private copy of its
stdout (the agent's own stdout goes to stderr), never pickle::

    node → worker   {"op": "run", "id", "task", "base_url", "api_key", "client", "extra",
                     "tools": [names]}          one episode
                    {"op": "cancel", "id"}      the episode's task was cancelled
                    {"op": "tool_result", "id", "call", "result"}
    worker → node   {"op": "ready"} | {"op": "fatal", "error"}     after start-up
                    {"op": "tool", "id", "call", "name", "arguments"}   a tool call
                    {"op": "done", "id", "result"} | {"op": "error", "id", "error"}

Tools named in the config run in the node (a worker gets proxies that call back), so a
node's own tools behave as they do in process.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from astraflow.errors import WorkflowError

__all__ = ["AgentWorkers", "WorkerSpec"]

log = logging.getLogger(__name__)

#: Longest JSON line either side accepts (a long conversation's task payload fits).
MAX_LINE = 64 << 20
#: Seconds a new worker has to import its agent and say it is ready.
START_TIMEOUT_S = 120.0

ToolFn = Callable[[str], Awaitable[str]]


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker of one workflow runs."""

    entry: str
    """The agent function, ``package.module:function``."""
    request_timeout_s: float
    """Timeout of the SDK client's requests."""
    sys_path: Sequence[str] = field(default_factory=lambda: list(sys.path))
    """The node's import path (so an entry importable in the node is importable here)."""


class _Worker:
    """One worker process and the episodes it runs."""

    def __init__(self, proc: asyncio.subprocess.Process, out: asyncio.StreamReader) -> None:
        self.proc = proc
        self.out = out
        self.pending: dict[int, tuple[asyncio.Future[Any], Mapping[str, ToolFn]]] = {}
        self.reader: asyncio.Task[None] | None = None
        self.write_lock = asyncio.Lock()

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None and self.reader is not None and not self.reader.done()

    async def send(self, message: dict[str, Any]) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        async with self.write_lock:
            stdin.write(json.dumps(message).encode() + b"\n")
            await stdin.drain()


class AgentWorkers:
    """A pool of agent worker processes (started on first use, restarted when one dies)."""

    def __init__(self, spec: WorkerSpec, count: int) -> None:
        if count < 1:
            raise ValueError(f"an agent worker pool needs at least one worker, got {count}")
        self.spec = spec
        self.count = count
        self._workers: list[_Worker | None] = [None] * count
        self._starting: list[asyncio.Lock] = [asyncio.Lock() for _ in range(count)]
        self._ids = itertools.count(1)
        self._closed = False
        self.started = 0
        """Worker processes started so far (restarts included)."""

    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        return [w.proc.pid for w in self._workers if w is not None and w.alive]

    async def run(
        self,
        task: dict[str, Any],
        *,
        base_url: str,
        api_key: str,
        client: str,
        extra: dict[str, Any],
        tools: Mapping[str, ToolFn] | None,
    ) -> Any:
        """Run one episode in a worker; returns what the agent returned (JSON), raises
        ``WorkflowError`` when the agent raised or its worker died."""
        if self._closed:
            raise WorkflowError("the agent workers are closed")
        worker = await self._pick()
        episode = next(self._ids)
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        worker.pending[episode] = (done, tools or {})
        message = {
            "op": "run",
            "id": episode,
            "task": task,
            "base_url": base_url,
            "api_key": api_key,
            "client": client,
            "extra": extra,
            "tools": None if tools is None else sorted(tools),
        }
        try:
            try:
                await worker.send(message)
            except (TypeError, ValueError) as exc:
                raise WorkflowError(f"the agent's task or kwargs are not JSON: {exc}") from exc
            except (ConnectionError, RuntimeError) as exc:
                raise WorkflowError(f"agent worker {worker.proc.pid} is gone: {exc}") from exc
            return await done
        except asyncio.CancelledError:
            if worker.alive:
                with contextlib.suppress(Exception):
                    await asyncio.shield(worker.send({"op": "cancel", "id": episode}))
            raise
        finally:
            worker.pending.pop(episode, None)

    async def _pick(self) -> _Worker:
        """The live worker with the fewest episodes, starting any that is not running."""
        for i in range(self.count):
            w = self._workers[i]
            if w is None or not w.alive:
                async with self._starting[i]:
                    w = self._workers[i]
                    if w is None or not w.alive:
                        self._workers[i] = await self._start()
        live = [w for w in self._workers if w is not None and w.alive]
        if not live:
            raise WorkflowError("no agent worker is running")
        return min(live, key=lambda w: len(w.pending))

    async def _start(self) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            __name__,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=MAX_LINE,
        )
        assert proc.stdout is not None
        worker = _Worker(proc, proc.stdout)
        await worker.send(
            {
                "op": "init",
                "entry": self.spec.entry,
                "sys_path": list(self.spec.sys_path),
                "request_timeout_s": self.spec.request_timeout_s,
            }
        )
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
            hello = json.loads(line) if line else {"op": "fatal", "error": "exited at start"}
        except (TimeoutError, ValueError) as exc:
            hello = {"op": "fatal", "error": f"no ready message: {exc!r}"}
        if hello.get("op") != "ready":
            await _stop(proc)
            raise WorkflowError(
                f"agent worker for {self.spec.entry} did not start: {hello.get('error')}"
            )
        worker.reader = asyncio.create_task(self._read(worker), name=f"agent-worker-{proc.pid}")
        self.started += 1
        log.info("agent worker started pid=%d entry=%s", proc.pid, self.spec.entry)
        return worker

    async def _read(self, worker: _Worker) -> None:
        """Dispatch the worker's messages until it exits; then fail what it was running."""
        tool_calls: set[asyncio.Task[None]] = set()
        try:
            while line := await worker.out.readline():
                try:
                    msg = json.loads(line)
                    op, episode = msg["op"], int(msg["id"])
                except (ValueError, KeyError, TypeError):
                    log.warning("agent worker pid=%d sent a bad line; stopping it", worker.proc.pid)
                    break
                entry = worker.pending.get(episode)
                if entry is None:
                    continue  # an episode already cancelled
                done, tools = entry
                if op == "tool":
                    call = asyncio.create_task(self._tool(worker, msg, tools))
                    tool_calls.add(call)
                    call.add_done_callback(tool_calls.discard)
                elif not done.done():
                    if op == "done":
                        done.set_result(msg.get("result"))
                    else:
                        done.set_exception(WorkflowError(str(msg.get("error", "agent failed"))))
        except (ValueError, ConnectionError) as exc:  # a line over MAX_LINE, a broken pipe
            log.warning("agent worker pid=%d: %s; stopping it", worker.proc.pid, exc)
        finally:
            for call in list(tool_calls):
                call.cancel()
            code = await _stop(worker.proc)
            for done, _ in list(worker.pending.values()):
                if not done.done():
                    done.set_exception(
                        WorkflowError(f"agent worker {worker.proc.pid} exited (code {code})")
                    )

    async def _tool(
        self, worker: _Worker, msg: dict[str, Any], tools: Mapping[str, ToolFn]
    ) -> None:
        fn = tools.get(str(msg.get("name")))
        if fn is None:
            result = f"error: no tool named {msg.get('name')!r}"
        else:
            try:
                result = await fn(str(msg.get("arguments", "")))
            except Exception as exc:  # a tool's failure is text for the model
                result = f"error: {exc}"
        reply = {"op": "tool_result", "id": msg["id"], "call": msg.get("call"), "result": result}
        with contextlib.suppress(ConnectionError, RuntimeError):
            await worker.send(reply)

    async def aclose(self) -> None:
        """Stop every worker (its running episodes fail)."""
        self._closed = True
        workers = [w for w in self._workers if w is not None]
        self._workers = [None] * self.count
        for worker in workers:
            if worker.proc.stdin is not None:
                worker.proc.stdin.close()  # EOF: a worker exits on its own
            await _stop(worker.proc)
            if worker.reader is not None:
                await asyncio.gather(worker.reader, return_exceptions=True)


async def _stop(proc: asyncio.subprocess.Process, grace_s: float = 2.0) -> int:
    """Wait ``grace_s`` for ``proc`` to exit (its stdin closed), then kill it; its code."""
    if proc.returncode is None:
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    return proc.returncode if proc.returncode is not None else -1


# ------------------------------------------------------------------------- the worker side


class _Child:
    """The worker's side: runs episodes, proxies tool calls to the node."""

    def __init__(self, out_fd: int, fn: Callable[..., Awaitable[Any]], timeout_s: float) -> None:
        self.out_fd = out_fd
        self.fn = fn
        self.timeout_s = timeout_s
        self.episodes: dict[int, asyncio.Task[None]] = {}
        self.tool_waits: dict[tuple[int, int], asyncio.Future[str]] = {}
        self.calls = itertools.count()
        self._http: Any = None

    def send(self, message: dict[str, Any]) -> None:
        data = memoryview(json.dumps(message).encode() + b"\n")
        while data:
            data = data[os.write(self.out_fd, data) :]

    def http(self) -> Any:
        """One pooled HTTP client for every episode's SDK client in this worker."""
        if self._http is None:  # the client the node's own agents share, built alike
            from astraflow.workflows.sdk_http import sdk_http_client

            self._http = sdk_http_client("loopback", None)
        return self._http

    def start(self, msg: dict[str, Any]) -> None:
        episode = int(msg["id"])
        task = asyncio.create_task(self._episode(episode, msg))
        self.episodes[episode] = task
        task.add_done_callback(lambda _: self.episodes.pop(episode, None))

    async def _episode(self, episode: int, msg: dict[str, Any]) -> None:
        try:
            client: Any = msg["base_url"]
            if msg["client"] == "openai":
                import openai

                client = openai.AsyncOpenAI(
                    base_url=msg["base_url"],
                    api_key=msg["api_key"],
                    max_retries=0,
                    timeout=self.timeout_s,
                    http_client=self.http(),
                )
            extra = dict(msg["extra"])
            if msg["tools"] is not None:
                extra["tools"] = {name: self._proxy(episode, name) for name in msg["tools"]}
            result = await self.fn(msg["task"], client, **extra)
            try:
                self.send({"op": "done", "id": episode, "result": result})
            except (TypeError, ValueError):
                kind = type(result).__name__
                self.send({"op": "error", "id": episode, "error": f"the agent returned {kind}"})
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            self.send({"op": "error", "id": episode, "error": repr(exc)})

    def _proxy(self, episode: int, name: str) -> ToolFn:
        async def call(arguments: str) -> str:
            key = (episode, next(self.calls))
            wait: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            self.tool_waits[key] = wait
            try:
                self.send(
                    {
                        "op": "tool",
                        "id": episode,
                        "call": key[1],
                        "name": name,
                        "arguments": str(arguments),
                    }
                )
                return await wait
            finally:
                self.tool_waits.pop(key, None)

        return call

    def answer_tool(self, msg: dict[str, Any]) -> None:
        wait = self.tool_waits.get((int(msg["id"]), int(msg["call"])))
        if wait is not None and not wait.done():
            wait.set_result(str(msg.get("result", "")))

    async def close(self) -> None:
        for task in list(self.episodes.values()):
            task.cancel()
        await asyncio.gather(*self.episodes.values(), return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()


async def _child_main(out_fd: int) -> int:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_LINE)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    def fatal(error: str) -> int:
        os.write(out_fd, json.dumps({"op": "fatal", "error": error}).encode() + b"\n")
        return 2

    try:
        init = json.loads(await reader.readline())
        sys.path[:] = [str(p) for p in init["sys_path"]]
        module_name, _, attr = str(init["entry"]).partition(":")
        fn = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # anything: reported to the node, which names the entry
        return fatal(repr(exc))
    child = _Child(out_fd, fn, float(init["request_timeout_s"]))
    child.send({"op": "ready"})
    try:
        while line := await reader.readline():
            msg = json.loads(line)
            op = msg.get("op")
            if op == "run":
                child.start(msg)
            elif op == "tool_result":
                child.answer_tool(msg)
            elif op == "cancel":
                task = child.episodes.get(int(msg["id"]))
                if task is not None:
                    task.cancel()
    finally:
        await child.close()
    return 0


def main() -> int:
    """Worker entry point: the protocol on a private copy of stdout, agents' prints to stderr.
    Ctrl-C in a terminal reaches the whole process group: the node decides when a worker
    stops (stdin closed), so SIGINT is ignored here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out_fd = os.dup(1)
    os.dup2(2, 1)
    return asyncio.run(_child_main(out_fd))


if __name__ == "__main__":
    sys.exit(main())
