"""The engine protocol: batched generation with exact logprobs, and versioned weights.

An engine serves one policy. It takes token-id prompts and returns, per request, the
generated ids, the logprob of each under the *tempered* distribution
``log_softmax(logits / T)`` (never renormalised by top-p / top-k; greedy requests report
``T = 1``), the finish reason and the weight version that produced every token. Weights
change only between generation batches, never inside one, so one version per output is
exact. ``load`` swaps in full weights; ``apply`` updates them in place from the weight
store (``WeightSource.pull``), from the version the engine holds to ``want``.

    requests ──► generate ──► EngineOutput(tokens, logprobs, finish, version)
    weight store ──► load(tensors, v) | apply(source, policy, want) ──► version
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from astraflow.plugins import PluginSpec, Registry
from astraflow.workflows.api import FinishReason, SamplingParams

if TYPE_CHECKING:
    import torch

    from astraflow.models import ModelSpec

__all__ = [
    "ENGINES",
    "GREEDY_BELOW",
    "Engine",
    "EngineContext",
    "EngineOutput",
    "GenerationRequest",
    "WeightSource",
    "build_engine",
]

#: Temperatures below this sample greedily (as in vLLM): dividing logits by a smaller one can
#: overflow float32, and one row of infinities would fail the draw of the whole batch.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class GenerationRequest:
    """One completion to sample: a token-id prompt and how to sample it."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    """No EOS or stop string ends the output before this many tokens (capped at the budget)."""
    temperature: float = 1.0
    """0 means greedy (logprobs then reported at temperature 1)."""
    top_p: float = 1.0
    top_k: int = 0
    """0: off."""
    stop: tuple[str, ...] = ()
    """Stop strings; the one that ends a generation is kept in its output."""
    seed: int | None = None
    """Per-request seed: the same seed and prompt give the same tokens on the same weights."""

    @classmethod
    def from_sampling(
        cls, prompt_ids: Sequence[int], sampling: SamplingParams, *, seed: int | None = None
    ) -> GenerationRequest:
        """A request for ``prompt_ids`` with the workflow's sampling parameters."""
        return cls(
            prompt_ids=tuple(int(t) for t in prompt_ids),
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=sampling.min_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            stop=tuple(sampling.stop),
            seed=sampling.seed if seed is None else seed,
        )

    @property
    def logprob_temperature(self) -> float:
        """Temperature the reported logprobs are computed at."""
        return self.temperature if self.temperature >= GREEDY_BELOW else 1.0


@dataclass(frozen=True)
class EngineOutput:
    """What an engine produced for one request."""

    token_ids: npt.NDArray[np.int32]
    logprobs: npt.NDArray[np.float32]
    finish_reason: FinishReason
    version: int
    """Weight version that produced every token of this output."""
    latency_s: float = 0.0
    """From the request's arrival at the engine to its completion (queueing included)."""


class WeightSource(Protocol):
    """What an engine needs from the weight store (``astraflow.weights.WeightClient``)."""

    def load(self, policy: str, version: int) -> dict[str, torch.Tensor]:
        """Full, verified tensors of ``policy`` at ``version``."""
        ...

    def pull(
        self,
        policy: str,
        tensors: MutableMapping[str, torch.Tensor],
        have: int | None,
        want: int | None = None,
    ) -> Any:
        """Update ``tensors`` in place from version ``have`` (None: unknown) to ``want``."""
        ...


@dataclass(frozen=True)
class EngineContext:
    """Everything an engine is built from besides its own config."""

    policy: str
    tokenizer: Any
    """The policy's Hugging Face tokenizer."""
    work_dir: Path
    """Scratch directory owned by this engine (model directories, weight files)."""
    model: ModelSpec | None = None
    """The policy's own model; ``None``: architecture from ``assets_dir``, weights via load."""
    assets_dir: Path | None = None
    """HF config + tokenizer files from the weight store (when ``model`` is ``None``)."""
    seed: int = 0


@runtime_checkable
class Engine(Protocol):
    """Generates for one policy and holds one weight version at a time.

    Built as ``cls(config, context)``. All methods are safe to call from the event loop:
    blocking work runs on the engine's own thread or process.
    """

    @property
    def version(self) -> int:
        """Weight version loaded (-1: none yet)."""
        ...

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[EngineOutput]:
        """Sample every request (batched with concurrent calls); one output per request.

        Raises ``ValidationError`` when a prompt is empty, has an id outside the
        vocabulary or does not fit the model's context.
        """
        ...

    async def load(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace all weights with ``tensors`` (between batches) and record ``version``."""
        ...

    async def apply(self, source: WeightSource, policy: str, want: int) -> None:
        """Move the weights from the held version to ``want``; no generation running or
        starting may see a mix of the two (swap between batches, or keep the old weights for
        the rows already decoding)."""
        ...

    def metrics(self) -> dict[str, float]:
        """Counters for the node's stats (``busy_s``: cumulative seconds spent generating)."""
        ...

    async def close(self) -> None:
        """Abort pending requests and free the engine's thread, process and memory."""
        ...


ENGINES: Registry[Engine] = Registry(
    "engine",
    Engine,
    builtin_modules=("astraflow.raas.engines.builtin",),
)
"""Engines by ``type``: transformers (default), vllm, sglang, openai, or ``module:Class``."""


def build_engine(spec: PluginSpec | Mapping[str, Any], context: EngineContext) -> Engine:
    """Build the engine ``spec`` names (``{"type": ..., **its Config}``) for one policy."""
    if not isinstance(spec, PluginSpec):
        spec = PluginSpec.coerce({"type": "transformers", **spec})
    if spec.kwargs.get("process") is True:  # the engine in a child process of its own
        from astraflow.plugins import validate_config
        from astraflow.raas.engines.process import ProcessEngine

        inner = {**spec.kwargs, "process": False}
        validate_config(ENGINES.resolve(spec.type), inner, f"engine {spec.type!r}")  # fail here
        return ProcessEngine({"type": spec.type, **inner}, context)
    return ENGINES.construct(spec, context)


def check_prompt(request: GenerationRequest, vocab_size: int, context_len: int | None) -> int:
    """Validate one prompt; return how many new tokens fit the context.

    Raises:
        ValidationError: empty prompt, id outside ``[0, vocab_size)``, or no room left.
    """
    from astraflow.errors import ValidationError

    ids = request.prompt_ids
    if not ids:
        raise ValidationError("the prompt is empty", field="prompt_ids")
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValidationError(
            f"prompt token id {bad} is outside the vocabulary (size {vocab_size})",
            field="prompt_ids",
        )
    room = request.max_new_tokens
    if context_len is not None:
        room = min(room, context_len - len(ids))
        if room < 1:
            raise ValidationError(
                f"a prompt of {len(ids)} tokens leaves no room in the model's context of "
                f"{context_len} tokens",
                field="prompt_ids",
            )
    return room
