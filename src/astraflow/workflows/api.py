"""The workflow API: what a workflow author sees, and the token accounting done for them.

A workflow is an async callable ``(task, policies, tools) -> list[Sample]``. It calls named
policies (``await policies["solver"].generate(...)``), maybe tools, over as many turns as it
likes, and returns one group of samples per policy it trains. It never computes masks by hand:
a :class:`Trajectory` records one policy's token stream and knows which tokens that policy
generated (trained, with logprobs and versions) and which it only read (prompt, tool output,
other policies' words: masked out).

    traj = Trajectory(policies["solver"])
    traj.add_messages([{"role": "user", "content": question}])   # context, mask 0
    gen = await traj.generate(sampling)                          # generated, mask 1
    traj.add_text("\\nTool says: 42\\n")                          # context, mask 0
    gen = await traj.generate(sampling)
    sample = traj.to_sample(task, reward=1.0)

Nothing here imports torch or a rollout engine: rollout nodes implement :class:`PolicyHandle`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.records import NO_VERSION, Sample, Task

__all__ = [
    "Generation",
    "Message",
    "NamedPolicy",
    "PolicyHandle",
    "Prompt",
    "SamplingParams",
    "Tool",
    "Trajectory",
    "Workflow",
    "chat_delta",
    "encode_prompt",
    "render_chat",
]

Message = Mapping[str, Any]
"""A chat message: ``{"role": ..., "content": ...}`` (plus tool-call fields when used)."""

Prompt = str | Sequence[Message] | Sequence[int]
"""Raw text, chat messages (rendered with the policy's chat template), or token ids."""

FinishReason = Literal["stop", "length", "abort"]


class SamplingParams(ConfigModel):
    """How to sample one generation."""

    max_new_tokens: int = Field(default=256, ge=1)
    """Upper bound on generated tokens."""
    min_new_tokens: int = Field(default=0, ge=0)
    """EOS and stop strings are ignored until this many tokens are generated (as HF's
    ``min_new_tokens`` / vLLM's ``min_tokens``); logprobs stay those of the full tempered
    distribution. Capped at ``max_new_tokens``; 0: off."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Softmax temperature; 0 (or anything below 1e-5) means greedy. Logprobs are of the
    tempered distribution."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass (1.0: off)."""
    top_k: int = Field(default=0, ge=0)
    """Keep only the k most likely tokens (0: off)."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends after the first one (it is kept in the output)."""
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    """Per-request seed where the engine supports it (a 64-bit signed integer)."""


@dataclass(frozen=True)
class Generation:
    """One completion: the tokens a policy generated, their logprobs and the weights used.

    A generation is produced by one weight version: nodes refresh weights between calls.
    """

    policy: str
    version: int
    """Weight version of ``policy`` that produced every token here."""
    prompt_ids: npt.NDArray[np.int32]
    token_ids: npt.NDArray[np.int32]
    """Generated tokens, including the EOS token when one was produced."""
    logprobs: npt.NDArray[np.float32]
    """Behaviour logprob of each generated token under the tempered distribution."""
    text: str
    """Decoded generated text (special tokens skipped)."""
    finish_reason: FinishReason
    latency_s: float = 0.0
    """Time the engine spent on this request (queueing included)."""
    temperature: float = 1.0
    """Temperature the logprobs are computed at (so the trainer can match it)."""


@runtime_checkable
class PolicyHandle(Protocol):
    """A named policy a workflow can call; implemented by rollout nodes over an engine."""

    @property
    def name(self) -> str:
        """Policy name (the ``policy`` field of the samples it trains)."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The policy's Hugging Face tokenizer (encode, decode, chat template)."""
        ...

    @property
    def version(self) -> int:
        """Weight version currently loaded (-1 before the first load)."""
        ...

    async def generate(
        self, prompt: Prompt, sampling: SamplingParams | None = None, *, n: int = 1
    ) -> list[Generation]:
        """Sample ``n`` completions of ``prompt``; requests from many workflows are batched."""
        ...


class NamedPolicy:
    """Base of a :class:`PolicyHandle` whose name and tokenizer are fixed when it is made (the
    subclass gives ``version`` and ``generate``)."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        self._name = name
        self._tokenizer = tokenizer

    @property
    def name(self) -> str:
        """Policy name (the ``policy`` field of the samples it trains)."""
        return self._name

    @property
    def tokenizer(self) -> Any:
        """The policy's Hugging Face tokenizer."""
        return self._tokenizer


@runtime_checkable
class Tool(Protocol):
    """A tool a workflow may call (calculator, search ...): text in, text out."""

    @property
    def name(self) -> str:
        """Name the model uses to call it."""
        ...

    async def __call__(self, arguments: str) -> str:
        """Run the tool; errors come back as text for the model, not as exceptions."""
        ...


@runtime_checkable
class Workflow(Protocol):
    """Runs one task: calls policies and tools, returns samples with rewards.

    Built as ``cls(config, rng)`` from the workflow registry. It returns, for every policy
    it trains, one group of samples (usually ``task.group_size``), all with ``group_id``
    unique per task. Raising marks the task failed (it is re-queued or failed after N
    attempts); it never crashes the node.
    """

    @property
    def policies(self) -> Sequence[str]:
        """Policy names this workflow calls (the node must host all of them)."""
        ...

    async def __call__(
        self, task: Task, policies: Mapping[str, PolicyHandle], tools: Mapping[str, Tool]
    ) -> list[Sample]:
        """Run ``task`` to completion and return its samples."""
        ...


def render_chat(tokenizer: Any, messages: Sequence[Message], *, generation_prompt: bool) -> str:
    """``messages`` rendered as text by the tokenizer's chat template."""
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=generation_prompt
    )
    if not isinstance(text, str):
        raise TypeError(f"chat template returned {type(text).__name__}, expected text")
    return text


_DELTA_BASE: tuple[Message, ...] = (
    {"role": "user", "content": "x"},
    {"role": "assistant", "content": "y"},
)


def chat_delta(tokenizer: Any, messages: Sequence[Message], *, generation_prompt: bool) -> str:
    """What the chat template adds for ``messages`` after an assistant turn.

    Rendered against a fixed two-turn conversation and cut after its prefix, so system
    preambles and BOS tokens the template puts at the start are not repeated mid-episode.
    """
    prefix = render_chat(tokenizer, _DELTA_BASE, generation_prompt=False)
    full = render_chat(tokenizer, [*_DELTA_BASE, *messages], generation_prompt=generation_prompt)
    if full.startswith(prefix):
        return full[len(prefix) :]
    return render_chat(tokenizer, messages, generation_prompt=generation_prompt)


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: text (the tokenizer's own special tokens), chat, or ids.

    The one place prompts are tokenized: trainers building SFT pairs use it too, so warm-up
    and rollout see identical prompt tokens.
    """
    if isinstance(prompt, str):
        return [int(t) for t in tokenizer.encode(prompt, add_special_tokens=True)]
    items: list[Any] = list(prompt)
    if items and all(isinstance(t, (int, np.integer)) for t in items):
        return [int(t) for t in items]
    if not items or not all(isinstance(m, Mapping) for m in items):
        raise ValueError("a prompt is text, a list of chat messages, or a list of token ids")
    text = render_chat(tokenizer, items, generation_prompt=True)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


@dataclass
class Trajectory:
    """One policy's token stream over a whole episode of turns, with its training mask.

    Everything appended with ``add_*`` is context (mask 0, logprob 0, version -1); tokens
    appended by ``generate`` (or ``add_generation`` for a generation of *this* policy) are
    trained (mask 1, behaviour logprob, version). A generation by another policy added
    here is context too: each policy is trained only on its own tokens.
    """

    policy: PolicyHandle
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    generations: list[Generation] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def add_tokens(self, token_ids: Sequence[int]) -> None:
        """Append context tokens (not trained)."""
        ids = [int(t) for t in token_ids]
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [NO_VERSION] * len(ids)

    def add_prompt(self, prompt: Prompt) -> None:
        """Append a prompt (text, chat messages or ids) tokenized by ``encode_prompt``."""
        self.add_tokens(encode_prompt(self.policy.tokenizer, prompt))

    def add_text(self, text: str) -> None:
        """Append text as context, tokenized by this policy's tokenizer (no special tokens)."""
        self.add_tokens(self.policy.tokenizer.encode(text, add_special_tokens=False))

    def add_messages(self, messages: Sequence[Message], *, generation_prompt: bool = True) -> None:
        """Append chat messages rendered with the policy's chat template (context).

        On a non-empty trajectory only the rendering delta is appended (what the template
        adds after an assistant turn), so a conversation can be extended message by message.
        """
        tok = self.policy.tokenizer
        if self.token_ids:
            text = chat_delta(tok, messages, generation_prompt=generation_prompt)
        else:
            text = render_chat(tok, messages, generation_prompt=generation_prompt)
        self.add_tokens(tok.encode(text, add_special_tokens=False))

    def add_generation(self, gen: Generation) -> None:
        """Append a generation: trained if it is this policy's, context otherwise."""
        if gen.policy != self.policy.name:
            self.add_tokens(gen.token_ids.tolist())
            return
        n = int(gen.token_ids.shape[0])
        self.token_ids += gen.token_ids.tolist()
        self.loss_mask += [1] * n
        self.logprobs += gen.logprobs.tolist()
        self.versions += [gen.version] * n
        self.turns += 1
        self.generations.append(gen)

    async def generate(self, sampling: SamplingParams | None = None) -> Generation:
        """Generate a continuation of the whole stream so far and append it (trained)."""
        if not self.token_ids:
            raise ValueError("add a prompt before generating")
        (gen,) = await self.policy.generate(list(self.token_ids), sampling, n=1)
        self.add_generation(gen)
        return gen

    def to_sample(
        self,
        task: Task,
        reward: float,
        *,
        group_id: str | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Sample:
        """The training sample for this trajectory's policy."""
        info = rollout_info(task, self.turns, self.generations, self.started)
        info.update(meta or {})
        return columns_sample(self.policy.name, task, group_id or task.task_id, self, reward, info)


class TokenColumns(Protocol):
    """The per-token columns a sample is built from (a trajectory, a captured stream)."""

    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def loss_mask(self) -> Sequence[int]: ...
    @property
    def logprobs(self) -> Sequence[float]: ...
    @property
    def versions(self) -> Sequence[int]: ...


def rollout_info(
    task: Task, turns: int, generations: Sequence[Generation], started: float
) -> dict[str, Any]:
    """A sample's common rollout meta: turns, workflow, source, rollout time and, when it
    generated, the last finish reason and temperature and the summed generation latency."""
    info: dict[str, Any] = {
        "turns": turns,
        "workflow": task.workflow,
        "source": task.source,
        "rollout_s": round(time.monotonic() - started, 4),
    }
    if generations:
        last = generations[-1]
        info["finish_reason"] = last.finish_reason
        info["temperature"] = last.temperature
        info["gen_latency_s"] = round(sum(g.latency_s for g in generations), 4)
    return info


def columns_sample(
    policy: str,
    task: Task,
    group_id: str,
    columns: TokenColumns,
    reward: float,
    meta: dict[str, Any],
) -> Sample:
    """The sample of ``policy`` for ``task`` with the given token columns, reward and meta."""
    return Sample(
        policy=policy,
        task_id=task.task_id,
        group_id=group_id,
        token_ids=np.asarray(columns.token_ids, dtype=np.int32),
        loss_mask=np.asarray(columns.loss_mask, dtype=np.uint8),
        logprobs=np.asarray(columns.logprobs, dtype=np.float32),
        versions=np.asarray(columns.versions, dtype=np.int32),
        reward=float(reward),
        meta=meta,
    )
