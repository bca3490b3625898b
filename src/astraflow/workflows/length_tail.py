"""``long_tail``: run any workflow with a long-tailed distribution of response lengths.

For benchmarks that need the straggler problem of real RL (a few very long responses per
batch) on tasks whose answers are short. Every generation of the chosen policies gets its
own length ``L`` drawn from a lognormal distribution and is sampled with
``min_new_tokens = max_new_tokens = L``: the engine generates exactly ``L`` real tokens (EOS
is not drawn before), which are trained like any others. The answer comes first and ends at
the first ``answer_end`` string; what follows is filler up to the drawn length. The wrapped
workflow sees (scores, shows other policies) only the answer; the samples keep every token.

    task ─► wrapped workflow ─► handle.generate(prompt, sampling, n)        (a proxy handle)
                                   │ n draws L_i = clip(round(median * exp(sigma * z)))
                                   ▼
                                policy.generate(prompt, sampling with min = max = L_i, n=1)
                                   │ (all n at once: the engine batches them)
                                   ▼
                                Generation(text = text up to answer_end) ─► wrapped workflow

Lengths are a pure function of ``(seed, task_id, call order)``: a task (and a retry of it)
gets the same lengths whatever node or mode runs it, so two runs do identical work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from typing import Annotated

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.plugins import WORKFLOW_SPEC, PluginSpec
from astraflow.records import Name, Sample, Task, ordered_fields
from astraflow.workflows.api import (
    Generation,
    NamedPolicy,
    PolicyHandle,
    Prompt,
    SamplingParams,
    Tool,
)
from astraflow.workflows.registry import POLICY_ROLE, WORKFLOWS

__all__ = ["LengthDistribution", "LongTail", "LongTailConfig"]


class LengthDistribution(ConfigModel):
    """A lognormal distribution of response lengths in tokens, clipped to a range."""

    median: float = Field(default=16.0, gt=0)
    """Median length (tokens)."""
    sigma: float = Field(default=1.0, ge=0)
    """Lognormal shape: 0 gives every response the median length; 1.5 is a heavy tail."""
    min_tokens: int = Field(default=1, ge=1)
    """Shortest length drawn (room for the answer)."""
    max_tokens: int = Field(default=256, ge=1)
    """Longest length drawn (the context must hold prompt + this)."""

    _range = ordered_fields("min_tokens", "max_tokens", verb="must not exceed")

    def draw(self, rng: random.Random) -> int:
        """One length."""
        length = round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))
        return max(self.min_tokens, min(self.max_tokens, length))

    def mean(self) -> float:
        """Mean of the unclipped distribution (``median * exp(sigma^2 / 2)``)."""
        return self.median * math.exp(self.sigma**2 / 2)


class LongTailConfig(ConfigModel):
    """Config of ``long_tail``."""

    workflow: Annotated[PluginSpec, WORKFLOW_SPEC] = Field(
        default_factory=lambda: PluginSpec(type="rlvr")
    )
    """The wrapped workflow (``{type: rlvr, ...}``, ``{type: solver_verifier, ...}``)."""
    lengths: LengthDistribution = Field(default_factory=LengthDistribution)
    """Distribution of the response lengths."""
    policies: Annotated[list[Name] | None, POLICY_ROLE] = None
    """Policies whose generations get drawn lengths (default: every policy it calls)."""
    answer_end: str = Field(default=" ", min_length=1)
    """The answer is the text before the first occurrence of this; the rest is filler."""


class _TailHandle(NamedPolicy):
    """A policy handle that gives each generation its drawn length (the wrapped policy's name
    and tokenizer)."""

    def __init__(
        self, inner: PolicyHandle, lengths: LengthDistribution, rng: random.Random, end: str
    ) -> None:
        super().__init__(inner.name, inner.tokenizer)
        self._inner = inner
        self._lengths = lengths
        self._rng = rng
        self._end = end

    @property
    def version(self) -> int:
        """The wrapped policy's weight version."""
        return self._inner.version

    async def generate(
        self, prompt: Prompt, sampling: SamplingParams | None = None, *, n: int = 1
    ) -> list[Generation]:
        """``n`` generations, each exactly as long as its drawn length."""
        base = sampling or SamplingParams()
        draws = [self._lengths.draw(self._rng) for _ in range(n)]
        calls = [
            self._inner.generate(
                prompt,
                base.model_copy(
                    update={
                        "min_new_tokens": length,
                        "max_new_tokens": length,
                        "seed": None if base.seed is None else base.seed + i,
                    }
                ),
                n=1,
            )
            for i, length in enumerate(draws)
        ]
        gens = [g for group in await asyncio.gather(*calls) for g in group]
        return [dataclasses.replace(g, text=g.text.split(self._end, 1)[0]) for g in gens]


@WORKFLOWS.register("long_tail")
class LongTail:
    """Runs the wrapped workflow with drawn response lengths (see the module docstring)."""

    Config = LongTailConfig

    def __init__(self, config: LongTailConfig, rng: random.Random) -> None:
        self.config = config
        self.seed = rng.randrange(2**31)
        self.inner = WORKFLOWS.build(config.workflow, seed=self.seed)

    @property
    def policies(self) -> Sequence[str]:
        """The wrapped workflow's policies."""
        return self.inner.policies

    async def __call__(
        self, task: Task, policies: Mapping[str, PolicyHandle], tools: Mapping[str, Tool]
    ) -> list[Sample]:
        """Run the wrapped workflow with length-drawing handles for the chosen policies."""
        chosen = set(self.config.policies if self.config.policies is not None else policies)
        handles: dict[str, PolicyHandle] = {}
        for name, handle in policies.items():
            if name in chosen:
                rng = random.Random(f"long_tail:{self.seed}:{task.task_id}:{name}")
                handle = _TailHandle(handle, self.config.lengths, rng, self.config.answer_end)
            handles[name] = handle
        return await self.inner(task, handles, tools)
