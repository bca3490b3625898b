"""SIMULATION ONLY: an engine that runs no model. It waits a drawn generation time, then
returns random valid tokens. For cluster-scale benchmarks on one machine, never for training:
it is not a registered engine; a benchmark names it by path, ``simulated_engine:SimulatedEngine``
(with ``benchmarks/`` on the import path).

Each request gets a response length ``L`` (lognormal, clipped to the request's
``[min_new_tokens, max_new_tokens]``) and takes ``L * step_s(b) / speed`` seconds, where
``step_s(b)`` is the decode-step time at ``b`` concurrent sequences, interpolated from
points measured on the real engine (``benchmarks/cluster_sim.py`` calibrates them), and
``speed`` is the pool's relative hardware speed. Like a continuous-batching server (vLLM,
SGLang), up to ``max_batch_size`` sequences run at once and later ones queue; ``b`` is taken
when a sequence starts (the model ignores the batch changing under it). The tokens are drawn
uniformly from the non-special vocabulary, so each logprob is exactly ``-log(V)``; the output
ends with EOS when ``L`` is below the budget. A weight update keeps the real first load (a
verified full copy) but only *waits* ``sync_s`` for later versions (the pull is simulated).

    generate(requests) ─► per request: L ~ lognormal ─► wait for a slot (max_batch_size)
        ─► sleep L * step_s(active) / speed ─► random tokens, logprobs -log V, version

``AnswerShare`` (a reward, by path ``simulated_engine:AnswerShare``) scores such random
responses with a spread inside each group, so group advantages are not all zero and every
trainer step really changes the weights (an exact-match reward on random tokens is 0 for
almost every sample: zero gradients, versions that do not move).
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import math
import random
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import Field, field_validator

from astraflow.config import ConfigModel
from astraflow.errors import ServiceUnavailableError
from astraflow.raas.engines.base import (
    EngineContext,
    EngineOutput,
    GenerationRequest,
    WeightSource,
    check_prompt,
)
from astraflow.records import NO_VERSION
from astraflow.workflows.length_tail import LengthDistribution

if TYPE_CHECKING:
    import torch

__all__ = ["AnswerShare", "SimulatedEngine", "step_time"]


def step_time(points: Sequence[tuple[int, float]], batch: int) -> float:
    """Decode-step seconds at ``batch`` sequences: linear between calibration points, flat
    outside them."""
    sizes = [b for b, _ in points]
    i = bisect.bisect_left(sizes, batch)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (b0, t0), (b1, t1) = points[i - 1], points[i]
    return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)


class SimulatedEngine:
    """SIMULATION: drawn generation times, random valid tokens (see the module docstring)."""

    class Config(ConfigModel):
        """Options of the ``simulated`` engine (a SIMULATION: no model runs)."""

        lengths: LengthDistribution = Field(default_factory=LengthDistribution)
        """Response lengths (tokens), clipped to each request's min/max new tokens."""
        step_s: list[tuple[int, float]] = Field(
            default_factory=lambda: [(1, 0.002), (64, 0.004)], min_length=1
        )
        """Calibration: (concurrent sequences, seconds per decode step), sorted by size."""
        speed: float = Field(default=1.0, gt=0)
        """Relative hardware speed of this node (1.0: the calibrated engine; 0.3: 30%)."""
        max_batch_size: int = Field(default=64, ge=1)
        """Sequences generated at once; later requests queue."""
        sync_s: float = Field(default=0.0, ge=0)
        """Simulated time of a weight update after the first (real) load."""

        @field_validator("step_s")
        @classmethod
        def _sorted(cls, v: list[tuple[int, float]]) -> list[tuple[int, float]]:
            sizes = [b for b, _ in v]
            if sizes != sorted(set(sizes)) or any(b < 1 or t <= 0 for b, t in v):
                raise ValueError(
                    "step_s must be (batch size >= 1, seconds > 0) points with strictly "
                    f"increasing batch sizes, got {v}"
                )
            return v

    def __init__(self, config: SimulatedEngine.Config, context: EngineContext) -> None:
        self.config = config
        self.context = context
        tok = context.tokenizer
        special = set(tok.all_special_ids)
        self._vocab_size = len(tok)
        self._tokens = np.asarray(
            [i for i in range(self._vocab_size) if i not in special], dtype=np.int32
        )
        if self._tokens.size == 0:
            raise ValueError(f"policy {context.policy!r}: the tokenizer has no ordinary tokens")
        self._eos = tok.eos_token_id
        # distinct per node (each has its own work_dir), reproducible per run seed
        key = f"{context.seed}:{context.policy}:{context.work_dir}"
        self._rng = random.Random(hashlib.blake2b(key.encode(), digest_size=8).hexdigest())
        self._np_rng = np.random.default_rng(self._rng.randrange(2**63))
        self._version = 0 if context.model is not None else NO_VERSION
        self._slots = asyncio.Semaphore(config.max_batch_size)  # binds to a loop on first use
        self._ready = asyncio.Event()
        self._ready.set()
        self._closed = False
        self._active = 0
        self._busy_s = 0.0
        self._busy_since = 0.0
        self._requests = 0
        self._generated = 0

    @property
    def version(self) -> int:
        """Weight version held (-1: none yet)."""
        return self._version

    # ----------------------------------------------------------------- generation

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[EngineOutput]:
        """Each request after its simulated generation time (all concurrently)."""
        if self._closed:
            raise ServiceUnavailableError(
                f"the simulated engine of policy {self.context.policy!r} is closed"
            )
        if self._version < 0:
            raise ServiceUnavailableError(
                f"policy {self.context.policy!r} has no weights loaded yet"
            )
        budgets = [check_prompt(r, self._vocab_size, None) for r in requests]
        return list(
            await asyncio.gather(*(self._one(r, b) for r, b in zip(requests, budgets, strict=True)))
        )

    def draw_length(self, request: GenerationRequest, budget: int) -> int:
        """A response length for ``request``: drawn, then clipped to its min and budget."""
        floor = max(1, min(request.min_new_tokens, budget))
        return max(floor, min(budget, self.config.lengths.draw(self._rng)))

    async def _one(self, request: GenerationRequest, budget: int) -> EngineOutput:
        arrived = time.monotonic()
        length = self.draw_length(request, budget)
        async with self._slots:
            await self._ready.wait()
            version = self._version
            self._enter()
            try:
                batch = min(self._active, self.config.max_batch_size)
                seconds = length * step_time(self.config.step_s, batch) / self.config.speed
                await asyncio.sleep(seconds)
            finally:
                self._leave()
        stop = length < budget and self._eos is not None
        tokens = self._np_rng.choice(self._tokens, size=length).astype(np.int32)
        if stop:
            tokens[-1] = self._eos
        logprobs = np.full(length, -math.log(self._tokens.size), dtype=np.float32)
        self._requests += 1
        self._generated += length
        return EngineOutput(
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason="stop" if stop else "length",
            version=version,
            latency_s=time.monotonic() - arrived,
        )

    def _enter(self) -> None:
        if self._active == 0:
            self._busy_since = time.monotonic()
        self._active += 1

    def _leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._busy_s += time.monotonic() - self._busy_since

    def metrics(self) -> dict[str, float]:
        """Requests served, tokens emitted, and ``busy_s``: seconds with a sequence running."""
        busy = self._busy_s + (time.monotonic() - self._busy_since if self._active else 0.0)
        return {
            "requests": float(self._requests),
            "generated_tokens": float(self._generated),
            "busy_s": busy,
        }

    # ----------------------------------------------------------------- weights

    async def load(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Take a full, verified copy's version (the tensors are not used)."""
        if not tensors:
            raise ServiceUnavailableError(f"policy {self.context.policy!r}: empty weights")
        self._version = version

    async def apply(self, source: WeightSource, policy: str, want: int) -> None:
        """SIMULATED update to ``want``: new sequences wait ``sync_s``, running ones go on."""
        self._ready.clear()
        try:
            await asyncio.sleep(self.config.sync_s)
            self._version = want
        finally:
            self._ready.set()

    async def close(self) -> None:
        """Refuse further requests (running ones finish their sleep)."""
        self._closed = True


class AnswerShare:
    """SIMULATION reward: the share of the response's characters that occur in the task's
    answer (in [0, 1]; graded, so random responses of one group get different rewards)."""

    def __init__(self, config: object, rng: random.Random) -> None:
        self.config = config

    async def __call__(self, response: str, payload: Mapping[str, Any]) -> float:
        """Characters of ``response`` found in ``payload['answer']``, as a share."""
        answer = set(str(payload["answer"]))
        return sum(c in answer for c in response) / len(response) if response else 0.0
