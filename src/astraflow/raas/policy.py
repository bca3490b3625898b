"""``NodePolicy``: a hosted policy as workflows see it (``PolicyHandle``) and as the node does.

Workflows call ``generate`` (text, chat messages or token ids → ``Generation``s); the
engine batches concurrent calls. The node calls ``refresh`` to move the weights to a newer
version; the engine applies it so that no generation sees it mid-way (between batches, or
for the ``transformers`` engine between decode steps, with running rows finishing on the old
weights), so each ``Generation`` carries the one version that produced all its tokens.
Until weights are loaded, ``generate`` waits.

    workflow ─ generate(prompt, n) ─► encode ─► engine.generate ─► Generation(version, ...)
    node ───── refresh(want) ─────► engine.apply (delta, in place) | engine.load (full)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from astraflow.errors import ValidationError
from astraflow.raas.engines.base import Engine, GenerationRequest, WeightSource
from astraflow.records import NO_VERSION
from astraflow.workflows.api import (
    Generation,
    NamedPolicy,
    Prompt,
    SamplingParams,
    encode_prompt,
)

__all__ = ["NodePolicy", "held_versions"]

log = logging.getLogger(__name__)


class NodePolicy(NamedPolicy):
    """One hosted policy: a ``PolicyHandle`` over an engine, plus its refresh state."""

    def __init__(
        self, name: str, tokenizer: Any, engine: Engine, *, frozen: bool, from_store: bool
    ) -> None:
        super().__init__(name, tokenizer)
        self.engine = engine
        self.frozen = frozen
        self.from_store = from_store
        """True when the loaded weights are a weight-store version (deltas apply to them)."""
        self._ready = asyncio.Event()
        self._refresh_lock = asyncio.Lock()
        self.generated_tokens = 0
        self.generations = 0
        self.refresh_s: float | None = None
        """Seconds the last weight refresh took (pull and swap into the engine)."""
        if engine.version >= 0:
            self._ready.set()

    @property
    def version(self) -> int:
        """Weight version loaded (-1 before the first load)."""
        return self.engine.version

    async def generate(
        self, prompt: Prompt, sampling: SamplingParams | None = None, *, n: int = 1
    ) -> list[Generation]:
        """Sample ``n`` completions of ``prompt`` (seeded requests get seeds seed, seed+1 ...)."""
        if n < 1:
            raise ValidationError(f"n must be at least 1, got {n}", field="n")
        params = sampling or SamplingParams()
        try:
            ids = encode_prompt(self._tokenizer, prompt)
        except ValueError as exc:
            raise ValidationError(str(exc), field="prompt") from exc
        if not ids:
            raise ValidationError("the prompt is empty", field="prompt")
        requests = [
            GenerationRequest.from_sampling(
                ids, params, seed=None if params.seed is None else params.seed + i
            )
            for i in range(n)
        ]
        await self._ready.wait()
        outputs = await self.engine.generate(requests)
        prompt_ids = np.asarray(ids, dtype=np.int32)
        texts = self._tokenizer.batch_decode(
            [o.token_ids.tolist() for o in outputs], skip_special_tokens=True
        )
        self.generations += len(outputs)
        self.generated_tokens += sum(int(o.token_ids.shape[0]) for o in outputs)
        return [
            Generation(
                policy=self._name,
                version=o.version,
                prompt_ids=prompt_ids,
                token_ids=o.token_ids,
                logprobs=o.logprobs,
                text=text,
                finish_reason=o.finish_reason,
                latency_s=o.latency_s,
                temperature=requests[0].logprob_temperature,
            )
            for o, text in zip(outputs, texts, strict=True)
        ]

    async def load(self, source: WeightSource, version: int) -> None:
        """Load ``version`` in full from the weight store (first load, or after a failure)."""
        async with self._refresh_lock:
            await self._load_locked(source, version)

    async def refresh(self, source: WeightSource, want: int) -> bool:
        """Move to ``want`` by the cheapest path; False when already there or frozen."""
        if self.frozen:
            return False
        async with self._refresh_lock:
            if want <= self.version and self.from_store:
                return False
            started = time.perf_counter()
            have = self.version
            phases: dict[str, float] = {}
            if self.from_store and have >= 0:
                try:
                    await self.engine.apply(source, self._name, want)
                    phases = getattr(self.engine, "apply_phases", None) or {}
                except Exception:
                    if self.engine.version >= 0:
                        raise  # weights intact: try again later
                    log.warning(
                        "delta refresh left no known version policy=%s: full load", self._name
                    )
                    await self._load_locked(source, want)
            else:
                await self._load_locked(source, want)
            self.refresh_s = time.perf_counter() - started
            log.info(
                "refreshed policy=%s from=%d to=%d seconds=%.3f%s",
                self._name,
                have,
                want,
                self.refresh_s,
                "".join(f" {k}={v:.3f}" for k, v in phases.items()),
            )
            return True

    async def _load_locked(self, source: WeightSource, version: int) -> None:
        load_from = getattr(self.engine, "load_from", None)
        if load_from is not None:  # an engine that reads the store itself (its own process)
            await load_from(source, self._name, version)
        else:
            tensors = await asyncio.to_thread(source.load, self._name, version)
            await self.engine.load(tensors, version)
        self.from_store = True
        self._ready.set()

    async def close(self) -> None:
        """Close the engine (pending requests fail)."""
        await self.engine.close()


def held_versions(policies: Sequence[NodePolicy]) -> dict[str, int]:
    """Version held per policy, as lease and renew requests report it."""
    return {p.name: p.version if p.version >= 0 else NO_VERSION for p in policies}
