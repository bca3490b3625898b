"""An engine in a child process of its own (``engine: {..., process: true}``).

A rollout node's event loop (workflows, the agent endpoint, the dataflow client, rewards)
and an in-process engine's batching thread share one interpreter lock: every millisecond of
Python on the loop is a millisecond the engine cannot step, however many cores are idle.
With ``process: true`` the engine runs in a child interpreter instead, so the node's own
work and the engine's run on two cores at once. The child pulls new weights itself, from
the same store with the same transfer options, so a refresh's CPU is spent beside the
engine thread there and never on the node's loop.

    node process                                   engine process (own interpreter lock)
    generate(requests) ─► frame ─► pipe ─► child loop ─► engine.generate ─┐
    futures resolved ◄─ reader thread ◄─ pipe ◄─ frame (one per answer) ◄─┘
    apply(source, want) ─► {store url, options} ─► WeightClient ─► engine.apply

The wire is this module's own framing, nothing pickled: a JSON header (``op``, ``id``,
fields) and raw little-endian arrays (prompt ids in, token ids and logprobs out, tensors for
a full load handed over from memory). Errors travel as the error tree's wire form
(``AstraflowError.to_wire``); anything else the child raised arrives as an ``AstraflowError``
naming its type. When the child dies, every waiting call fails with
``ServiceUnavailableError`` naming the exit status, and so does every later call.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from astraflow.errors import AstraflowError, ServiceUnavailableError, error_from_wire
from astraflow.raas.engines.base import (
    EngineContext,
    EngineOutput,
    GenerationRequest,
    WeightSource,
)
from astraflow.records import NO_VERSION

if TYPE_CHECKING:
    import torch

__all__ = [
    "ProcessEngine",
    "read_frame",
    "source_spec",
    "tensors_from_blob",
    "tensors_to_blob",
    "write_frame",
]

log = logging.getLogger(__name__)

#: Seconds the child may take to import, build its engine and answer ``init``.
START_S = 300.0
#: Seconds ``close`` waits for the child to exit before it is killed.
CLOSE_S = 30.0
#: Largest header a frame may carry (its arrays ride outside it).
MAX_HEADER = 16 << 20
_HEAD = struct.Struct("<IQ")  # header bytes, blob bytes


# ----------------------------------------------------------------- framing (both sides)


def write_frame(out: BinaryIO, header: Mapping[str, Any], blob: bytes = b"") -> None:
    """One frame: lengths, the JSON header, then the raw bytes."""
    out.write(frame_bytes(header, blob))
    out.flush()


def frame_bytes(header: Mapping[str, Any], blob: bytes = b"") -> bytes:
    """A frame as bytes (for writers that gather several before one write)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    return _HEAD.pack(len(head), len(blob)) + head + blob


def read_frame(inp: BinaryIO) -> tuple[dict[str, Any], bytes] | None:
    """The next frame; None at the end of the stream."""
    prefix = _read_exactly(inp, _HEAD.size)
    if prefix is None:
        return None
    n_head, n_blob = frame_sizes(prefix)
    head = _read_exactly(inp, n_head)
    blob = _read_exactly(inp, n_blob) if n_blob else b""
    if head is None or blob is None:
        raise EOFError("the engine pipe ended inside a frame")
    return frame_header(head), blob


def frame_sizes(prefix: bytes) -> tuple[int, int]:
    """Header and blob lengths from a frame's prefix (a header over ``MAX_HEADER`` refused)."""
    n_head, n_blob = _HEAD.unpack(prefix)
    if n_head > MAX_HEADER:
        raise ValueError(f"engine frame header of {n_head} bytes (at most {MAX_HEADER})")
    return int(n_head), int(n_blob)


def frame_header(raw: bytes) -> dict[str, Any]:
    """A frame's JSON header, which must be an object."""
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("an engine frame header must be a JSON object")
    return header


def _read_exactly(inp: BinaryIO, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = inp.read(left)
        if not chunk:
            if left == n:
                return None
            raise EOFError("the engine pipe ended inside a frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def tensors_to_blob(tensors: Mapping[str, torch.Tensor]) -> tuple[list[dict[str, Any]], bytes]:
    """Tensors as (name, dtype, shape, bytes) entries and one concatenated buffer (tensors
    that share storage, tied weights, travel once each: the child's load ties them again)."""
    import torch

    entries: list[dict[str, Any]] = []
    parts: list[bytes] = []
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        dtype = str(t.dtype).removeprefix("torch.")
        entries.append({"name": name, "dtype": dtype, "shape": list(t.shape), "bytes": len(raw)})
        parts.append(raw)
    return entries, b"".join(parts)


def tensors_from_blob(entries: Sequence[Mapping[str, Any]], blob: bytes) -> dict[str, Any]:
    """The inverse of ``tensors_to_blob`` (each tensor owns a copy of its bytes)."""
    import torch

    out: dict[str, Any] = {}
    offset = 0
    for e in entries:
        n = int(e["bytes"])
        dtype = getattr(torch, str(e["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {e['name']!r}: unknown dtype {e['dtype']!r}")
        raw = bytearray(blob[offset : offset + n])
        offset += n
        flat = torch.frombuffer(raw, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        out[str(e["name"])] = flat.view(dtype).reshape([int(d) for d in e["shape"]])
    if offset != len(blob):
        raise ValueError(f"tensor entries cover {offset} of {len(blob)} bytes")
    return out


def source_spec(source: WeightSource) -> dict[str, Any] | None:
    """How the child opens the same weight store (None: ``source`` is not a ``WeightClient``,
    so weights reach the child as tensors from this process)."""
    from astraflow.weights import WeightClient

    if not isinstance(source, WeightClient):
        return None
    return {
        "url": str(source.source.url),
        "options": dataclasses.asdict(source.options),
        "cache_dir": None if source.cache_dir is None else str(source.cache_dir),
        "verify_base": source.verify_base,
    }


# ----------------------------------------------------------------- node side


class ProcessEngine:
    """Runs another engine (``spec``) in a child process; the ``Engine`` protocol here."""

    def __init__(self, spec: Mapping[str, Any], context: EngineContext) -> None:
        self.spec = dict(spec)
        self.context = context
        self.apply_phases: dict[str, float] = {}
        self._version = NO_VERSION
        self._metrics: dict[str, float] = {}
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._lock = threading.Lock()  # pending table, writes to the pipe, the closed flag
        self._dead: str | None = None
        """Why calls fail from now on (the child exited, or the engine was closed)."""
        self._closing = False
        child_r, to_child = os.pipe()
        from_child, child_w = os.pipe()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "astraflow.raas.engines.process_child", str(child_r),
             str(child_w)],
            pass_fds=(child_r, child_w),
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )  # fmt: skip
        os.close(child_r)
        os.close(child_w)
        self._out: BinaryIO = os.fdopen(to_child, "wb", buffering=0)
        self._in: BinaryIO = os.fdopen(from_child, "rb")
        try:
            self._start()
        except BaseException:
            self._kill()
            for pipe in (self._out, self._in):
                with contextlib.suppress(OSError):
                    pipe.close()
            raise
        self._reader = threading.Thread(
            target=self._read_loop, name=f"engine-pipe-{context.policy}", daemon=True
        )
        self._reader.start()

    def _start(self) -> None:
        ctx = self.context
        tokenizer_dir: str | None = None
        if ctx.model is None and ctx.assets_dir is None:  # the child reads what we hold
            path = ctx.work_dir / "process-tokenizer"
            ctx.tokenizer.save_pretrained(path)
            tokenizer_dir = str(path)
        header = {
            "op": "init",
            "spec": self.spec,
            "context": {
                "policy": ctx.policy,
                "work_dir": str(ctx.work_dir),
                "model": None if ctx.model is None else ctx.model.model_dump(mode="json"),
                "assets_dir": None if ctx.assets_dir is None else str(ctx.assets_dir),
                "tokenizer_dir": tokenizer_dir,
                "seed": ctx.seed,
            },
            # torch's intra-op threads as set in this process (the engine's own ``threads``
            # still wins): the child computes what this process would, bit for bit
            "torch_threads": _torch_threads(),
            "log": _log_setup(),
        }
        write_frame(self._out, header)
        answer: list[tuple[dict[str, Any], bytes] | None] = []
        reader = threading.Thread(target=lambda: answer.append(read_frame(self._in)))
        reader.start()
        reader.join(START_S)
        if not answer:
            raise ServiceUnavailableError(
                f"the engine process of policy {ctx.policy!r} did not start in {START_S:.0f} s"
            )
        frame = answer[0]
        if frame is None:
            raise ServiceUnavailableError(
                f"the engine process of policy {ctx.policy!r} exited while starting "
                f"(status {self._proc.wait()})"
            )
        head, _ = frame
        if head.get("op") == "err":
            raise error_from_wire(head, default_message="the engine process failed to start")
        self._note(head)

    # ------------------------------------------------------------- Engine protocol

    @property
    def version(self) -> int:
        """Weight version loaded (-1: none yet)."""
        return self._version

    @property
    def failed(self) -> str | None:
        """Why the engine can serve no more calls (its process exited), None while it can;
        the node stops on it so that its tasks go to nodes that can run them."""
        return None if self._closing else self._dead

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._proc.pid

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[EngineOutput]:
        """Sample every request in the child (batched there with concurrent calls)."""
        if not requests:
            return []
        fields = [
            {"n": len(r.prompt_ids), "max_new_tokens": r.max_new_tokens,
             "min_new_tokens": r.min_new_tokens, "temperature": r.temperature, "top_p": r.top_p,
             "top_k": r.top_k, "stop": list(r.stop), "seed": r.seed}
            for r in requests
        ]  # fmt: skip
        ids = np.fromiter(
            itertools.chain.from_iterable(r.prompt_ids for r in requests), dtype="<i8"
        )
        head, blob = await self._ask({"op": "gen", "requests": fields}, ids.tobytes())
        return _outputs(head["outputs"], blob)

    async def load(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Hand ``tensors`` over to the child and load them there."""
        entries, blob = await asyncio.to_thread(tensors_to_blob, tensors)
        head = {"op": "load", "version": version, "tensors": entries}
        self._note((await self._ask(head, blob, big=True))[0])

    async def load_from(self, source: WeightSource, policy: str, version: int) -> None:
        """Load ``version`` in full, read by the child from the store itself when it can."""
        spec = source_spec(source)
        if spec is None:
            await self.load(await asyncio.to_thread(source.load, policy, version), version)
            return
        head = {"op": "load_from", "source": spec, "policy": policy, "version": version}
        self._note((await self._ask(head))[0])

    async def apply(self, source: WeightSource, policy: str, want: int) -> None:
        """Move the child's weights to ``want`` (its own pull, double-buffered there)."""
        spec = source_spec(source)
        if spec is None:  # weights only this process can read: a full load from here
            await self.load(await asyncio.to_thread(source.load, policy, want), want)
            return
        head = {"op": "apply", "source": spec, "policy": policy, "want": want}
        self._note((await self._ask(head))[0])

    def metrics(self) -> dict[str, float]:
        """The child engine's counters, as of its last answer."""
        return dict(self._metrics)

    async def close(self) -> None:
        """Stop the child (its pending requests fail) and wait for it to exit."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            with contextlib.suppress(OSError):
                write_frame(self._out, {"op": "close"})
        try:
            await asyncio.wait_for(asyncio.to_thread(self._proc.wait), CLOSE_S)
        except TimeoutError:
            log.warning("engine process of policy %s did not exit: killed", self.context.policy)
            self._kill()
        await asyncio.to_thread(self._reader.join, CLOSE_S)
        self._fail_all(f"the engine of policy {self.context.policy!r} was closed")
        with contextlib.suppress(OSError):
            self._out.close()

    # ------------------------------------------------------------- plumbing

    def _note(self, head: Mapping[str, Any]) -> None:
        """Version, metrics and phases the child reports with an answer."""
        if "version" in head:
            self._version = int(head["version"])
        if "metrics" in head:
            self._metrics = {str(k): float(v) for k, v in head["metrics"].items()}
        if "phases" in head:
            self.apply_phases = {str(k): float(v) for k, v in head["phases"].items()}

    async def _ask(
        self, header: dict[str, Any], blob: bytes = b"", *, big: bool = False
    ) -> tuple[dict[str, Any], bytes]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[dict[str, Any], bytes]] = loop.create_future()
        ident = next(self._ids)
        frame = frame_bytes({**header, "id": ident}, blob)
        with self._lock:
            if self._dead is not None or self._closing:
                raise ServiceUnavailableError(
                    self._dead or f"the engine of policy {self.context.policy!r} is closed"
                )
            self._pending[ident] = (loop, future)
        try:
            if big:  # a full load's tensors: written off the loop (a pipe takes 64 KiB a go)
                await asyncio.to_thread(self._send_locked, frame)
            else:
                with self._lock:
                    self._send(frame)
        except BaseException:
            with self._lock:
                self._pending.pop(ident, None)
            raise
        try:
            return await future
        except asyncio.CancelledError:
            with self._lock:
                if self._pending.pop(ident, None) is not None and self._dead is None:
                    with contextlib.suppress(OSError):
                        self._send(frame_bytes({"op": "cancel", "id": ident}))
            raise

    def _send(self, frame: bytes) -> None:
        try:
            self._out.write(frame)
        except OSError as exc:  # the child is gone: the reader fails everyone
            raise ServiceUnavailableError(
                f"the engine process of policy {self.context.policy!r} is gone: {exc}"
            ) from exc

    def _send_locked(self, frame: bytes) -> None:
        with self._lock:
            self._send(frame)

    def _read_loop(self) -> None:
        try:
            while True:
                frame = read_frame(self._in)
                if frame is None:
                    break
                head, blob = frame
                self._note(head)
                with self._lock:
                    waiting = self._pending.pop(int(head.get("id", 0)), None)
                if waiting is not None:
                    loop, future = waiting
                    with contextlib.suppress(RuntimeError):  # the caller's loop has closed
                        loop.call_soon_threadsafe(_settle, future, head, blob)
        except Exception:
            log.exception("engine pipe of policy %s failed", self.context.policy)
        status = self._proc.wait()
        if not self._closing:
            log.error(
                "the engine process of policy %s exited with status %s",
                self.context.policy,
                status,
            )
        self._fail_all(
            f"the engine process of policy {self.context.policy!r} exited (status {status})"
        )
        with contextlib.suppress(OSError):
            self._in.close()

    def _fail_all(self, why: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = why
            pending, self._pending = self._pending, {}
        for loop, future in pending.values():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_fail, future, why)

    def _kill(self) -> None:
        with contextlib.suppress(OSError):
            self._proc.kill()
        with contextlib.suppress(Exception):
            self._proc.wait(CLOSE_S)

    def __del__(self) -> None:  # a node that never closed its engine leaves no child behind
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(Exception):
                proc.kill()


def _log_setup() -> dict[str, str]:
    """This process's log level and format, for the child's lines to match the node's."""
    from astraflow.observability import _JsonFormatter

    root = logging.getLogger()
    json_lines = any(isinstance(h.formatter, _JsonFormatter) for h in root.handlers)
    level = logging.getLevelName(root.getEffectiveLevel())
    return {
        "level": level if isinstance(level, str) else "INFO",
        "format": "json" if json_lines else "text",
    }


def _torch_threads() -> int | None:
    torch = sys.modules.get("torch")
    return None if torch is None else int(torch.get_num_threads())


def _settle(future: asyncio.Future[Any], head: dict[str, Any], blob: bytes) -> None:
    if future.done():
        return
    if head.get("op") == "err":
        future.set_exception(error_from_wire(head, default_message="the engine failed"))
    else:
        future.set_result((head, blob))


def _fail(future: asyncio.Future[Any], why: str) -> None:
    if not future.done():
        future.set_exception(ServiceUnavailableError(why))


def _outputs(fields: Sequence[Mapping[str, Any]], blob: bytes) -> list[EngineOutput]:
    total = sum(int(f["n"]) for f in fields)
    tokens = np.frombuffer(blob, dtype="<i4", count=total)
    logprobs = np.frombuffer(blob, dtype="<f4", count=total, offset=4 * total)
    out, at = [], 0
    for f in fields:
        n = int(f["n"])
        out.append(
            EngineOutput(
                token_ids=tokens[at : at + n].astype(np.int32),
                logprobs=logprobs[at : at + n].astype(np.float32),
                finish_reason=f["finish"],
                version=int(f["version"]),
                latency_s=float(f["latency_s"]),
            )
        )
        at += n
    return out


def child_error(exc: BaseException) -> dict[str, Any]:
    """An exception raised in the child as the wire form the node rebuilds."""
    if isinstance(exc, AstraflowError):
        return exc.to_wire()
    return AstraflowError(f"{type(exc).__name__}: {exc}").to_wire()


def child_context(fields: Mapping[str, Any]) -> EngineContext:
    """The child's ``EngineContext`` from the ``init`` frame (tokenizer rebuilt here)."""
    from astraflow.models import ModelSpec, build_tokenizer

    model = None if fields.get("model") is None else ModelSpec.model_validate(fields["model"])
    assets = None if fields.get("assets_dir") is None else Path(fields["assets_dir"])
    if model is not None:
        tokenizer = build_tokenizer(model)
    else:
        from transformers import AutoTokenizer

        where = assets if assets is not None else fields.get("tokenizer_dir")
        if where is None:
            raise AstraflowError("the engine process was given no tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(where)
    return EngineContext(
        policy=str(fields["policy"]),
        tokenizer=tokenizer,
        work_dir=Path(fields["work_dir"]),
        model=model,
        assets_dir=assets,
        seed=int(fields.get("seed", 0)),
    )
