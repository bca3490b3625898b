"""The engine process of ``engines.process``: ``python -m astraflow.raas.engines.process_child
READ_FD WRITE_FD``.

It builds the engine the ``init`` frame names, answers ``gen`` / ``load`` / ``load_from`` /
``apply`` / ``cancel`` frames concurrently on its own event loop, and exits on ``close`` or
when the node's end of the pipe closes (the node died: nothing is left waiting here). The
answers of one engine step are gathered into one write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from astraflow.heap import freeze_heap
from astraflow.observability import setup_logging
from astraflow.raas.engines.process import (
    _HEAD,
    child_context,
    child_error,
    frame_bytes,
    frame_header,
    frame_sizes,
    tensors_from_blob,
)

log = logging.getLogger("astraflow.raas.engines.process")


class _Child:
    def __init__(self, write_fd: int) -> None:
        self._out = os.fdopen(write_fd, "wb", buffering=0)
        self._queued: list[bytes] = []
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._clients: dict[str, Any] = {}
        self.engine: Any = None
        self._frozen = False

    # ------------------------------------------------------------- answers

    def send(self, header: Mapping[str, Any], blob: bytes = b"") -> None:
        """Queue an answer; everything queued in one loop turn goes out in one write."""
        if not self._queued:
            asyncio.get_running_loop().call_soon(self._flush)
        self._queued.append(frame_bytes(header, blob))

    def _flush(self) -> None:
        data, self._queued = b"".join(self._queued), []
        with contextlib.suppress(OSError):  # the node is gone; the read side ends us
            self._out.write(data)

    def _state(self) -> dict[str, Any]:
        engine = self.engine
        # the whole child's CPU too: what the engine process costs beside the node's own
        metrics = {**engine.metrics(), "process_cpu_s": time.process_time()}
        return {"version": int(engine.version), "metrics": metrics}

    # ------------------------------------------------------------- requests

    def start(self, head: dict[str, Any], blob: bytes) -> None:
        ident = int(head["id"])
        op = head["op"]
        if op == "cancel":
            task = self._tasks.pop(ident, None)
            if task is not None:
                task.cancel()
            return
        task = asyncio.get_running_loop().create_task(self._answer(ident, op, head, blob))
        self._tasks[ident] = task

    async def _answer(self, ident: int, op: str, head: dict[str, Any], blob: bytes) -> None:
        try:
            if op == "gen":
                reply, data = await self._generate(head, blob)
            elif op == "load":
                await self.engine.load(tensors_from_blob(head["tensors"], blob), head["version"])
                self._loaded()
                reply, data = {}, b""
            elif op == "load_from":
                client = self._client(head["source"])
                tensors = await asyncio.to_thread(client.load, head["policy"], head["version"])
                await self.engine.load(tensors, head["version"])
                self._loaded()
                reply, data = {}, b""
            elif op == "apply":
                await self.engine.apply(self._client(head["source"]), head["policy"], head["want"])
                reply = {"phases": dict(getattr(self.engine, "apply_phases", {}) or {})}
                data = b""
            else:
                raise ValueError(f"unknown engine op {op!r}")
        except asyncio.CancelledError:
            return
        except Exception as exc:
            self.send({"op": "err", "id": ident, **child_error(exc), **self._state()})
        else:
            self.send({"op": "ok", "id": ident, **reply, **self._state()}, data)
        finally:
            self._tasks.pop(ident, None)

    def _loaded(self) -> None:
        """After the first full load the model and the engine live until exit: out of the
        garbage collector's way (``heap.freeze_heap``)."""
        if not self._frozen:
            self._frozen = True
            freeze_heap(f"engine process {self.engine.context.policy}")

    async def _generate(self, head: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        from astraflow.raas.engines.base import GenerationRequest

        ids = np.frombuffer(blob, dtype="<i8")
        requests, at = [], 0
        for f in head["requests"]:
            n = int(f["n"])
            requests.append(
                GenerationRequest(
                    prompt_ids=tuple(ids[at : at + n].tolist()),
                    max_new_tokens=int(f["max_new_tokens"]),
                    min_new_tokens=int(f["min_new_tokens"]),
                    temperature=float(f["temperature"]),
                    top_p=float(f["top_p"]),
                    top_k=int(f["top_k"]),
                    stop=tuple(str(s) for s in f["stop"]),
                    seed=None if f["seed"] is None else int(f["seed"]),
                )
            )
            at += n
        outs = await self.engine.generate(requests)
        fields = [
            {"n": int(o.token_ids.shape[0]), "finish": o.finish_reason, "version": o.version,
             "latency_s": o.latency_s}
            for o in outs
        ]  # fmt: skip
        tokens = np.concatenate([o.token_ids for o in outs]).astype("<i4", copy=False)
        logprobs = np.concatenate([o.logprobs for o in outs]).astype("<f4", copy=False)
        return {"outputs": fields}, tokens.tobytes() + logprobs.tobytes()

    def _client(self, spec: Mapping[str, Any]) -> Any:
        """One ``WeightClient`` per store the node named (opened on first use)."""
        from astraflow.weights import WeightClient
        from astraflow.weights.transfer import TransferOptions

        key = repr(sorted(spec.items()))
        client = self._clients.get(key)
        if client is None:
            client = WeightClient(
                spec["url"],
                options=TransferOptions(**spec["options"]),
                cache_dir=spec.get("cache_dir"),
                verify_base=bool(spec.get("verify_base", True)),
            )
            self._clients[key] = client
        return client

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        if self.engine is not None:
            await self.engine.close()
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                client.close()
        self._flush()


async def _read(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes] | None:
    try:
        prefix = await reader.readexactly(_HEAD.size)
    except asyncio.IncompleteReadError:
        return None
    n_head, n_blob = frame_sizes(prefix)
    head = frame_header(await reader.readexactly(n_head))
    blob = await reader.readexactly(n_blob) if n_blob else b""
    return head, blob


async def serve(read_fd: int, write_fd: int) -> None:
    """Build the engine from the first frame, then answer frames until ``close`` or EOF."""
    from astraflow.raas.engines.base import build_engine

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb", buffering=0)
    )
    child = _Child(write_fd)
    first = await _read(reader)
    if first is None:
        return
    head, _ = first
    log_setup = head.get("log") or {}
    with contextlib.suppress(ValueError):  # a level this side does not know: keep INFO
        setup_logging(
            str(log_setup.get("level", "INFO")),
            "json" if log_setup.get("format") == "json" else "text",
            component="engine",
        )
    try:
        if head.get("torch_threads"):
            import torch

            torch.set_num_threads(int(head["torch_threads"]))
        context = await asyncio.to_thread(child_context, head["context"])
        child.engine = await asyncio.to_thread(build_engine, head["spec"], context)
    except Exception as exc:
        log.exception("engine process failed to start")
        child.send({"op": "err", "id": 0, **child_error(exc)})
        await asyncio.sleep(0)
        return
    child.send({"op": "ready", "id": 0, **child._state()})
    try:
        while True:
            frame = await _read(reader)
            if frame is None or frame[0].get("op") == "close":
                break
            child.start(*frame)
    finally:
        await child.close()


def main() -> None:
    read_fd, write_fd = int(sys.argv[1]), int(sys.argv[2])
    setup_logging("INFO", component="engine")  # the node's level and format come with init
    asyncio.run(serve(read_fd, write_fd))


if __name__ == "__main__":
    main()
