"""The in-process ``transformers`` engine (the default): CPU or GPU, batched, exact logprobs.

Requests from every running workflow are batched on the engine thread
(``engines.batching``) and decoded with a KV cache by ``engines.decoding``. Weights are
double-buffered in two models: ``apply`` pulls the new version into the spare model on a
worker thread while the engine keeps generating with the live one, then swaps the two
between two decode steps. Rows already decoding finish on the model they started with (their
own lane of the batch); rows that start after the swap decode on the new one. So a refresh
neither stops generation nor waits for the running batch's longest row, and no generation
mixes two versions. The next pull into the spare waits until the old lane's last row ended;
a failed pull leaves the live weights untouched.

    apply(want): engine thread: a spare model (a copy of the live one, the first time)
                 worker thread:  wait until no row decodes on the spare; copy the live weights
                                 into it, then pull live version→want (a one-version delta)
                 engine thread, between decode steps: live ⇄ spare; version = want

The model is either the policy's own (``context.model``: built at construction, version
0) or built from the weight store's assets at the first ``load`` in the published dtype.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.errors import UNCHANGED_BY_FAILED_PULL, ServiceUnavailableError, ValidationError
from astraflow.models import ComputeDType, compute_dtype
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
        dtype: ComputeDType = "auto"
        """Dtype the model computes in. 'auto': float32 on a CPU for weights published in
        bfloat16 or float16 (a CPU's half-precision matmul is slow: 4.4x here), else the
        published dtype; 'published'; or a dtype by name. Pulls still move the published
        tensors bit for bit (into a copy kept in that dtype), so deltas stay exact."""
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
        self._spare: Any = None
        """The second buffer: a second model that pulls write into, then swapped in."""
        self._spare_state: dict[str, torch.Tensor] = {}
        self._spare_version = NO_VERSION
        self._pulled: dict[str, torch.Tensor] | None = None
        """Where the model computes in another dtype than the published one: the published
        tensors, bit for bit, that pulls write into (then copied into the spare model)."""
        self._pulled_version = NO_VERSION
        self._lanes = threading.Condition()
        self._decoding_on: dict[int, int] = {}
        """id(model) -> lanes of the running batch decoding on it (engine thread writes)."""
        self.apply_phases: dict[str, float] = {}
        """Seconds of the last ``apply``'s steps (clone_s, wait_s: for the spare's last rows,
        pull_s, swap_s), for the node's log."""
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
        """Pull ``want`` into the spare model while generating, then swap it in between two
        decode steps (rows already decoding finish on the old model).

        Callers serialise weight changes (``NodePolicy`` holds a lock around them).
        """
        started = time.perf_counter()
        if self._spare is None:  # set on the engine thread; weight changes are serialised
            await self.call(self._prepare_spare, overlap=True)
        cloned = time.perf_counter()
        waited = await asyncio.to_thread(self._pull_spare, source, policy, want)
        pulled = time.perf_counter()
        await self.call(lambda: self._swap(want), overlap=True)
        self.apply_phases = {
            "clone_s": cloned - started,
            "wait_s": waited,
            "pull_s": pulled - cloned - waited,
            "swap_s": time.perf_counter() - pulled,
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
        self._spare, self._spare_state, self._spare_version = None, {}, NO_VERSION
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
        published = floats[0] if floats else torch.float32
        dtype = compute_dtype(self.config.dtype, published, self.device)
        if self._model is None:
            self._install(self._build_from_assets(dtype))
        elif next(self._model.parameters()).dtype != dtype:
            self._install(self._model.to(dtype))
        self._version = NO_VERSION
        self._spare, self._spare_state, self._spare_version = None, {}, NO_VERSION
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
        if dtype != published:  # pulls need the published tensors: keep them beside
            self._pulled = {name: t.detach().clone() for name, t in tensors.items()}
            self._pulled_version = version
        else:
            self._pulled, self._pulled_version = None, NO_VERSION
        log.info("loaded weights policy=%s version=%d dtype=%s", self.context.policy, version,
                 str(dtype).removeprefix("torch."))  # fmt: skip

    def _prepare_spare(self) -> None:
        """Engine thread (between decode steps: it only reads the live model): a spare model,
        a copy of the live one, where there is none (tied tensors stay tied)."""
        if self._model is None:
            raise ServiceUnavailableError(
                f"policy {self.context.policy!r}: no model to update; load first"
            )
        if self._spare is None:
            with torch.inference_mode(False):  # mid-batch it runs inside the decoder's
                # inference mode, whose tensors could not be pulled into in place afterwards
                self._spare = copy.deepcopy(self._model)
            self._spare_state = self._spare.state_dict()
            self._spare_version = self._version

    def _on_lane(self, model: Any, started: bool) -> None:
        """Engine thread: a lane of the running batch started or ended on ``model``."""
        with self._lanes:
            key = id(model)
            count = self._decoding_on.get(key, 0) + (1 if started else -1)
            if count > 0:
                self._decoding_on[key] = count
            else:
                self._decoding_on.pop(key, None)
                self._lanes.notify_all()

    def _pull_spare(self, source: WeightSource, policy: str, want: int) -> float:
        """Worker thread: once no row decodes on the spare any more, move it to ``want``; the
        live model is not touched. The seconds it waited for those rows."""
        spare = self._spare
        assert spare is not None
        pulled = self._pulled
        if pulled is not None:  # the published tensors first: no row reads them
            try:
                have = self._pulled_version if self._pulled_version >= 0 else None
                source.pull(policy, pulled, have, want)
            except UNCHANGED_BY_FAILED_PULL:
                raise  # the client undid its changes (or made none): still `have`
            except Exception:  # maybe half-written: the next refresh pulls a full snapshot
                self._pulled_version = NO_VERSION
                raise
            self._pulled_version = want
        started = time.perf_counter()
        with self._lanes:
            while self._decoding_on.get(id(spare), 0) and not self._closed.is_set():
                self._lanes.wait(0.5)
        if self._closed.is_set():
            raise ServiceUnavailableError(f"the engine of policy {policy!r} was closed")
        waited = time.perf_counter() - started
        try:
            if pulled is not None:  # the published tensors, in the model's dtype
                with torch.no_grad():
                    for name, tensor in pulled.items():
                        self._spare_state[name].copy_(tensor)
                self._spare_version = want
                return waited
            if self._spare_version != self._version:  # it holds the version before the live
                # one: catch up with a copy of the live weights (only read meanwhile; weight
                # changes are serialised), then pull one version on top, as the live one would
                with torch.no_grad():
                    for name, tensor in self._spare_state.items():
                        tensor.copy_(self._state[name])
                self._spare_version = self._version
            have = self._spare_version if self._spare_version >= 0 else None
            source.pull(policy, self._spare_state, have, want)
        except UNCHANGED_BY_FAILED_PULL:
            raise  # the client undid its changes (or made none): spare unchanged
        except Exception:  # maybe half-written: the next refresh starts from a fresh copy
            self._spare, self._spare_state, self._spare_version = None, {}, NO_VERSION
            raise
        self._spare_version = want
        return waited

    def _swap(self, want: int) -> None:
        """Engine thread, between decode steps: the spare becomes the live model (rows that
        start from now on decode on it) and the live one the spare."""
        assert self._spare is not None and self._spare_version == want
        self._model, self._spare = self._spare, self._model
        self._state, self._spare_state = self._spare_state, self._state
        self._version, self._spare_version = want, self._version
        assert self._decoder is not None
        self._decoder.model = self._model

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
        owner: dict[int, tuple[Pending, int]] = {}

        def finished(row: DecodedRow) -> None:  # resolved at once, not at the batch's end
            job, version = owner.pop(id(row))
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
            rows = []  # they decode on the live model (the decoder's), of this version
            for job, budget in jobs:
                row = DecodedRow(job.request, budget)
                owner[id(row)] = (job, self._version)
                rows.append(row)
            return rows

        def join(decoding: int) -> list[DecodedRow]:
            jobs = self._more(self._max_batch - decoding)  # may swap the weights first
            batch.extend(jobs)  # the batch's end answers what its rows did not
            return rows_of(self._admit(jobs, vocab, context_len))

        joined = join if self.config.continuous else None
        self._decoder.run(
            rows_of(admitted),
            abort=self._closed.is_set,
            join=joined,
            on_done=finished,
            on_step=self._release_wakes,
            on_lane=self._on_lane,
        )
