"""The ``sglang`` engine: an adapter over a running SGLang server's native HTTP API.

SGLang is CUDA-only, so this adapter cannot run on the CPU machines this project is tested
on (its test is skipped with that reason). It uses the documented routes:

- ``POST /generate`` with ``input_ids``, ``sampling_params`` and ``return_logprob``: reply
  ``meta_info.output_token_logprobs`` = ``[[logprob, token_id, text], ...]`` and
  ``meta_info.finish_reason.type``. SGLang reports ``log_softmax(logits / T)`` before its
  top-p / top-k filters, which is the logprob this project trains with (leave
  ``SGLANG_RETURN_ORIGINAL_LOGPROB`` unset). Seeds are honoured only by servers started
  with ``--enable-deterministic-inference``.
- ``POST /update_weights_from_disk`` with ``model_path`` (and ``weight_version``): the node
  applies deltas to a host copy (``engines.host``) and writes a model directory under
  ``weights_dir``, which the server must be able to read (same machine or shared storage).
  Tensors never travel pickled (``update_weights_from_tensor`` would need that).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.errors import ServiceUnavailableError, ValidationError
from astraflow.raas.engines.base import (
    ENGINES,
    EngineContext,
    EngineOutput,
    GenerationRequest,
    WeightSource,
)
from astraflow.raas.engines.host import HostWeights, write_model_dir
from astraflow.raas.engines.openai import RemoteEngine
from astraflow.records import NO_VERSION

__all__ = ["SGLangEngine"]


class _Gate:
    """Many generations at once, or one weight swap: never both (tags stay exact)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writing = False

    @asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing)
            self._writing = True
            await self._cond.wait_for(lambda: self._readers == 0)
        try:
            yield
        finally:
            async with self._cond:
                self._writing = False
                self._cond.notify_all()


@ENGINES.register("sglang")
class SGLangEngine(RemoteEngine):
    """Samples from an SGLang server and swaps its weights from a shared directory."""

    class Config(ConfigModel):
        """Options of the ``sglang`` engine."""

        url: str
        """SGLang server base URL, e.g. http://gpu-host:30000."""
        weights_dir: str | None = None
        """Directory the server can read, for weight updates (default: the engine's own)."""
        timeout_s: float = Field(default=600.0, gt=0)
        """Per-request timeout (weight updates included)."""
        max_concurrency: int = Field(default=256, ge=1)
        """Requests in flight at once."""

    def __init__(self, config: SGLangEngine.Config, context: EngineContext) -> None:
        super().__init__(config.url, config.timeout_s, config.max_concurrency, context.policy)
        self.config = config
        self.context = context
        self._host = HostWeights(context.policy)
        self._version = 0 if context.model is not None else NO_VERSION
        self._gate = _Gate()

    @property
    def version(self) -> int:
        """Weight version the server holds (-1: none pushed yet)."""
        return self._version

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[EngineOutput]:
        """One ``/generate`` call per request, concurrently (SGLang batches them)."""
        async with self._gate.reading():
            if self._version < 0:
                raise ServiceUnavailableError(f"policy {self.policy!r} has no weights loaded yet")
            return list(await asyncio.gather(*(self._one(r, self._version) for r in requests)))

    async def load(self, tensors: Mapping[str, Any], version: int) -> None:
        """Push full weights to the server."""
        self._host.load(tensors, version)
        async with self._gate.writing():
            await self._push()

    async def apply(self, source: WeightSource, policy: str, want: int) -> None:
        """Apply the update to the host copy, then have the server reload it."""
        await asyncio.to_thread(self._host.pull, source, want)
        async with self._gate.writing():
            await self._push()

    async def _push(self) -> None:
        """Write the host copy and have the server load it (no generation in flight)."""
        version = self._host.version
        root = Path(self.config.weights_dir) if self.config.weights_dir else self.context.work_dir
        dest = await asyncio.to_thread(
            write_model_dir,
            self._host.tensors,
            root / f"{self.policy}-v{version:08d}",
            assets=self.context.assets_dir,
            tokenizer=self.context.tokenizer,
        )
        self._version = NO_VERSION
        reply = await self.post(
            "/update_weights_from_disk",
            {"model_path": str(dest), "weight_version": str(version)},
        )
        if not (isinstance(reply, dict) and reply.get("success")):
            raise ServiceUnavailableError(
                f"policy {self.policy!r}: {self.url} did not load weights v{version}: {reply!r}"
            )
        self._version = version

    async def _one(self, request: GenerationRequest, version: int) -> EngineOutput:
        if not request.prompt_ids:
            raise ValidationError("the prompt is empty", field="prompt_ids")
        sampling: dict[str, Any] = {
            "max_new_tokens": request.max_new_tokens,
            "min_new_tokens": min(request.min_new_tokens, request.max_new_tokens),
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k if request.top_k > 0 else -1,
            "no_stop_trim": True,
        }
        if request.stop:
            sampling["stop"] = list(request.stop)
        if request.seed is not None:
            sampling["sampling_seed"] = request.seed
        started = time.monotonic()
        reply = await self.post(
            "/generate",
            {
                "input_ids": list(request.prompt_ids),
                "sampling_params": sampling,
                "return_logprob": True,
            },
        )
        return self._parse(reply, version, time.monotonic() - started)

    def _parse(self, reply: Any, version: int, latency: float) -> EngineOutput:
        try:
            meta = reply["meta_info"]
            pairs = meta["output_token_logprobs"]
            ids = [int(p[1]) for p in pairs]
            logprobs = [float(p[0]) for p in pairs]
            reason = (meta.get("finish_reason") or {}).get("type")
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ValidationError(
                f"policy {self.policy!r}: {self.url}/generate sent no token logprobs ({exc!r})"
            ) from exc
        return EngineOutput(
            token_ids=np.asarray(ids, dtype=np.int32),
            logprobs=np.asarray(logprobs, dtype=np.float32),
            finish_reason=reason if reason in ("stop", "length") else "abort",
            version=version,
            latency_s=latency,
        )
