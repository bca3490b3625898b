"""The in-process ``transformers`` engine (the default): CPU or GPU, batched, exact logprobs.

Requests from every running workflow are batched on the engine thread
(``engines.batching``) and decoded with a KV cache by ``engines.decoding``. Weights are
double-buffered: ``apply`` pulls the new version from the weight store into a second copy of
the state dict on a worker thread while the engine keeps generating with the live one, then
swaps it in on the engine thread between batches (a copy into the live ``state_dict()``,
whose tensors share storage with the parameters). A refresh costs the engine only the swap;
a failed pull leaves the live weights untouched.

    apply(want): worker thread: pull have→want into the shadow copy (verified first)
                 engine thread, between batches: live ← shadow; version = want

The model is either the policy's own (``context.model``: built at construction, version
0) or built from the weight store's assets at the first ``load`` in the published dtype.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.errors import (
    ChecksumError,
    ServiceUnavailableError,
    TransferError,
    ValidationError,
)
from astraflow.raas.engines.base import (
    ENGINES,
    EngineContext,
    EngineOutput,
    WeightSource,
)
from astraflow.raas.engines.batching import BatchingEngine, Pending
from astraflow.raas.engines.decoding import BatchDecoder, DecodedRow
from astraflow.records import NO_VERSION

__all__ = ["TransformersEngine", "resolve_device"]

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """``auto`` is the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@ENGINES.register("transformers")
class TransformersEngine(BatchingEngine):
    """A Hugging Face causal LM in this process, driven by a batching thread."""

    class Config(ConfigModel):
        """Options of the ``transformers`` engine."""

        device: str = "auto"
        """'auto' (CUDA when available, else CPU), 'cpu', 'cuda', 'cuda:1' ..."""
        max_batch_size: int = Field(default=64, ge=1)
        """Most requests decoded together in one batch."""
        batch_wait_ms: float = Field(default=2.0, ge=0.0)
        """How long the first request of a batch waits for others to join it."""
        batch_gap_ms: float = Field(default=0.0, ge=0.0)
        """Stretch that wait while requests keep arriving less than this apart (0: off; for
        callers whose requests trickle in, e.g. agents through the OpenAI endpoint)."""
        batch_max_wait_ms: float = Field(default=1000.0, ge=0.0)
        """Longest a batch waits for stragglers when ``batch_gap_ms`` stretches the wait."""
        continuous: bool = True
        """Continuous batching: requests that arrive while a batch decodes join it (up to
        ``max_batch_size``), and each request is answered as soon as its row finishes."""
        threads: int | None = Field(default=None, ge=1)
        """torch intra-op threads for this process (default: torch's choice)."""
        process: bool = False
        """Run the engine in a child process of its own (``engines.process``): the node's
        event loop (workflows, the agent endpoint, submits) and weight pulls then no longer
        share an interpreter lock with the engine thread, and use a second core."""

    def __init__(self, config: TransformersEngine.Config, context: EngineContext) -> None:
        self.config = config
        self.context = context
        self.device = resolve_device(config.device)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self._model: Any = None
        self._decoder: BatchDecoder | None = None
        self._state: dict[str, torch.Tensor] = {}
        self._version = NO_VERSION
        self._shadow: dict[str, torch.Tensor] | None = None
        """The second buffer: a copy of the state dict that pulls write into."""
        self._shadow_version = NO_VERSION
        self.apply_phases: dict[str, float] = {}
        """Seconds of the last ``apply``'s steps (clone_s, pull_s, swap_s), for the node's log."""
        if context.model is not None:
            from astraflow.models import build_model

            self._install(build_model(context.model, context.tokenizer))
            self._version = 0
        super().__init__(
            name=context.policy,
            max_batch_size=config.max_batch_size,
            batch_wait_s=config.batch_wait_ms / 1000.0,
            batch_gap_s=config.batch_gap_ms / 1000.0,
            batch_max_wait_s=config.batch_max_wait_ms / 1000.0,
        )

    @property
    def version(self) -> int:
        """Weight version loaded (-1: none yet)."""
        return self._version

    @property
    def model(self) -> Any:
        """The live model (``None`` before the first load); read it only between batches."""
        return self._model

    async def load(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace all weights (building the model first when there is none)."""
        await self.call(lambda: self._load(tensors, version))

    async def apply(self, source: WeightSource, policy: str, want: int) -> None:
        """Pull ``want`` into the shadow weights while generating, then swap between batches.

        Callers serialise weight changes (``NodePolicy`` holds a lock around them).
        """
        started = time.perf_counter()
        if self._shadow is None or self._shadow_version != self._version:
            await self.call(self._clone_shadow)
        cloned = time.perf_counter()
        await asyncio.to_thread(self._pull_shadow, source, policy, want)
        pulled = time.perf_counter()
        await self.call(lambda: self._swap(want))
        self.apply_phases = {
            "clone_s": cloned - started,
            "pull_s": pulled - cloned,
            "swap_s": time.perf_counter() - pulled,  # mostly the wait for the batch running
        }

    # ----------------------------------------------------------------- engine thread

    def _install(self, model: Any) -> None:
        model = model.to(self.device).eval()
        tok = self.context.tokenizer
        eos: set[int] = set()
        for ids in (tok.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
            if isinstance(ids, int):
                eos.add(ids)
            elif ids is not None:
                eos.update(int(i) for i in ids)
        pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos, default=0)
        self._model = model
        self._state = model.state_dict()
        self._decoder = BatchDecoder(
            model, tok, eos_ids=sorted(eos), pad_id=pad, device=self.device, seed=self.context.seed
        )

    def _build_from_assets(self, dtype: torch.dtype) -> Any:
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.context.assets_dir is None:
            raise ServiceUnavailableError(
                f"policy {self.context.policy!r} has neither a model nor weight-store assets"
            )
        config = AutoConfig.from_pretrained(self.context.assets_dir)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.context.seed)
            return AutoModelForCausalLM.from_config(config, dtype=dtype)

    def _load(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
        dtype = floats[0] if floats else torch.float32
        if self._model is None:
            self._install(self._build_from_assets(dtype))
        elif next(self._model.parameters()).dtype != dtype:
            self._install(self._model.to(dtype))
        self._version = NO_VERSION
        self._shadow, self._shadow_version = None, NO_VERSION
        missing, unexpected = self._model.load_state_dict(dict(tensors), strict=False)
        if unexpected:
            raise ValidationError(
                f"policy {self.context.policy!r}: tensors {sorted(unexpected)[:5]} are not in "
                "the model",
                field="tensors",
            )
        loaded = {self._state[n].data_ptr() for n in tensors if n in self._state}
        untied = [n for n in missing if self._state[n].data_ptr() not in loaded]
        if untied:
            raise ValidationError(
                f"policy {self.context.policy!r}: no value for {sorted(untied)[:5]}",
                field="tensors",
            )
        self._version = version
        log.info("loaded weights policy=%s version=%d", self.context.policy, version)

    def _clone_shadow(self) -> None:
        """Engine thread: the shadow becomes a copy of the live weights (tied tensors stay
        tied: one copy per storage)."""
        if self._model is None:
            raise ServiceUnavailableError(
                f"policy {self.context.policy!r}: no model to update; load first"
            )
        copies: dict[int, torch.Tensor] = {}
        shadow = {}
        for name, tensor in self._state.items():
            ptr = tensor.data_ptr()
            if ptr not in copies:
                copies[ptr] = tensor.detach().clone()
            shadow[name] = copies[ptr]
        self._shadow, self._shadow_version = shadow, self._version

    def _pull_shadow(self, source: WeightSource, policy: str, want: int) -> None:
        """Worker thread: move the shadow to ``want``; the live weights are not touched."""
        assert self._shadow is not None
        have = self._shadow_version if self._shadow_version >= 0 else None
        try:
            source.pull(policy, self._shadow, have, want)
        except (TransferError, ChecksumError, ValidationError):
            raise  # the pull verifies everything before its first write: shadow unchanged
        except Exception:
            self._shadow, self._shadow_version = None, NO_VERSION  # maybe half-written
            raise
        self._shadow_version = want

    def _swap(self, want: int) -> None:
        """Engine thread, between batches: the live weights become the shadow's."""
        assert self._shadow is not None and self._shadow_version == want
        with torch.no_grad():
            for name, tensor in self._shadow.items():
                self._state[name].copy_(tensor)
        self._version = want

    def _run_batch(self, batch: list[Pending]) -> None:
        if self._decoder is None or self._version < 0:
            raise ServiceUnavailableError(
                f"policy {self.context.policy!r} has no weights loaded yet"
            )
        vocab = int(self._model.get_input_embeddings().num_embeddings)
        context_len = getattr(self._model.config, "max_position_embeddings", None)
        admitted = self._admit(batch, vocab, context_len)
        if not admitted:
            return
        version = self._version
        owner: dict[int, Pending] = {}

        def finished(row: DecodedRow) -> None:  # resolved at once, not at the batch's end
            job = owner.pop(id(row))
            job.future.set_result(
                EngineOutput(
                    token_ids=np.asarray(row.token_ids, dtype=np.int32),
                    logprobs=np.asarray(row.logprobs, dtype=np.float32),
                    finish_reason=row.finish_reason or "length",
                    version=version,
                    latency_s=time.monotonic() - job.arrived,
                )
            )

        def rows_of(jobs: list[tuple[Pending, int]]) -> list[DecodedRow]:
            rows = []
            for job, budget in jobs:
                row = DecodedRow(job.request, budget)
                owner[id(row)] = job
                rows.append(row)
            return rows

        def join(decoding: int) -> list[DecodedRow]:
            jobs = self._more(self._max_batch - decoding)
            batch.extend(jobs)  # the batch's end answers what its rows did not
            return rows_of(self._admit(jobs, vocab, context_len))

        joined = join if self.config.continuous else None
        self._decoder.run(
            rows_of(admitted),
            abort=self._closed.is_set,
            join=joined,
            on_done=finished,
            on_step=self._release_wakes,
        )
