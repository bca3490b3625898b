"""Exact token capture of an agent's model calls: one token stream per conversation.

An agent resends its whole conversation on every call. ``EpisodeRecorder`` keeps, per
policy, *segments*: token streams (context mask 0, generated mask 1 with behaviour logprobs
and versions) together with the text they stand for. A new call whose rendered prompt
starts with a segment's text *plus the text the model generated last* continues that
segment: the earlier generated tokens are reused as they are and only the new tail of the
rendering is tokenized. Anything else opens a new segment; when the request's messages do
extend a segment's conversation but the text does not (a template that is not append-only,
e.g. one dropping reasoning from history), that is counted as a ``template_break``.

    call ─► prepare(text | ids) ─► continue segment s: s.tokens + encode(new tail)
                                └► new segment:      encode(whole rendering)
         ─► policy.generate(prompt ids) ─► commit(generations) ─► s.tokens += generated

Each segment becomes one sample of its policy (``samples``); all share the task's group.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from astraflow.records import NO_VERSION, Sample, Task
from astraflow.workflows.api import Generation, columns_sample, rollout_info
from astraflow.workflows.chat_format import content_text

__all__ = ["EpisodeRecorder", "Prepared", "normalize_messages"]


def _normal_args(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    """Messages reduced to what a chat template reads (role, text, tool calls, ids)."""
    out: list[tuple[Any, ...]] = []
    for m in messages:
        calls = tuple(
            (
                str(c.get("function", {}).get("name", "")),
                json.dumps(_normal_args(c.get("function", {}).get("arguments")), sort_keys=True),
            )
            for c in (m.get("tool_calls") or [])
        )
        text = content_text(m.get("content")) if m.get("role") != "assistant" or not calls else ""
        out.append((m.get("role"), text, calls, m.get("tool_call_id"), m.get("name")))
    return out


@dataclass
class _Stream:
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def copy(self) -> _Stream:
        return _Stream(
            list(self.token_ids), list(self.loss_mask), list(self.logprobs), list(self.versions)
        )

    def add_context(self, ids: Sequence[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [NO_VERSION] * len(ids)

    def add_generation(self, gen: Generation) -> None:
        n = int(gen.token_ids.shape[0])
        self.token_ids += gen.token_ids.tolist()
        self.loss_mask += [1] * n
        self.logprobs += gen.logprobs.tolist()
        self.versions += [gen.version] * n


@dataclass
class _Segment:
    policy: str
    stream: _Stream
    text: str | None
    """Rendered text the stream stands for, up to the last generation (None: id prompts)."""
    tail: str = ""
    """Text of the last generation, special tokens kept."""
    messages: list[tuple[Any, ...]] = field(default_factory=list)
    """Normalised conversation so far, the last reply included (template-break detection)."""
    turns: int = 0
    stamp: int = 0
    """Bumped on every extension: a call prepared on an older stamp forks instead."""
    gens: list[Generation] = field(default_factory=list)


@dataclass(frozen=True)
class Prepared:
    """A call ready to generate: its prompt ids and where its generations will go."""

    policy: str
    prompt_ids: list[int]
    base: _Segment | None
    stamp: int
    prefix: _Stream
    text: str | None
    messages: list[tuple[Any, ...]]
    continued: bool
    """True when the prompt continues an earlier call's token stream."""
    history: tuple[Generation, ...] = ()
    """Generations already in ``prefix`` (the base segment's, when the call was prepared)."""


class EpisodeRecorder:
    """Every call of one episode, as token streams per policy (thread- and task-safe)."""

    def __init__(self) -> None:
        self._segments: list[_Segment] = []
        self._lock = threading.Lock()
        self.calls = 0
        self.continued = 0
        self.template_breaks = 0
        self.started = time.monotonic()

    def prepare(
        self,
        policy: str,
        tokenizer: Any,
        *,
        text: str | None = None,
        ids: Sequence[int] | None = None,
        messages: list[tuple[Any, ...]] | None = None,
    ) -> Prepared:
        """The prompt ids of a call given as rendered ``text`` or as token ``ids``."""
        with self._lock:
            base = self._match(policy, text, ids)
            if base is not None:
                prefix = base.stream.copy()
                if text is not None:
                    assert base.text is not None
                    rest = text[len(base.text) + len(base.tail) :]
                    prefix.add_context(_encode(tokenizer, rest) if rest else [])
                else:
                    assert ids is not None
                    prefix.add_context([int(t) for t in ids[len(base.stream.token_ids) :]])
                self.continued += 1
            else:
                prefix = _Stream()
                prefix.add_context(
                    _encode(tokenizer, text) if text is not None else [int(t) for t in ids or ()]
                )
                if messages and self._extends_conversation(policy, messages):
                    self.template_breaks += 1
            self.calls += 1
            return Prepared(
                policy,
                list(prefix.token_ids),
                base,
                base.stamp if base is not None else 0,
                prefix,
                text,
                list(messages or []),
                base is not None,
                tuple(base.gens) if base is not None else (),
            )

    def commit(
        self, prepared: Prepared, gens: Sequence[Generation], replies: Sequence[Any], decoded: Any
    ) -> None:
        """Append each generation to its stream (the first extends the base, others fork).

        ``replies`` are the normalised assistant messages returned per generation;
        ``decoded`` maps token ids to text with special tokens kept.
        """
        with self._lock:
            for i, gen in enumerate(gens):
                stream = prepared.prefix.copy()
                stream.add_generation(gen)
                base = prepared.base
                reuse = i == 0 and base is not None and base.stamp == prepared.stamp
                seg = base if reuse and base is not None else None
                if seg is None:
                    seg = _Segment(prepared.policy, stream, prepared.text)
                    seg.gens = list(prepared.history)
                    seg.turns = len(seg.gens)
                    self._segments.append(seg)
                seg.stream, seg.text = stream, prepared.text
                seg.tail = decoded(gen.token_ids.tolist()) if prepared.text is not None else ""
                seg.messages = [*prepared.messages, *replies[i : i + 1]]
                seg.turns += 1
                seg.stamp += 1
                seg.gens.append(gen)

    def _match(self, policy: str, text: str | None, ids: Sequence[int] | None) -> _Segment | None:
        best: _Segment | None = None
        best_len = -1
        for seg in self._segments:
            if seg.policy != policy:
                continue
            if text is not None and seg.text is not None:
                known = seg.text + seg.tail
                ok = text.startswith(known)
                size = len(known)
            elif ids is not None and seg.text is None:
                size = len(seg.stream.token_ids)
                ok = [int(t) for t in ids[:size]] == seg.stream.token_ids
            else:
                continue
            if ok and size > best_len:
                best, best_len = seg, size
        return best

    def _extends_conversation(self, policy: str, messages: list[tuple[Any, ...]]) -> bool:
        return any(
            seg.policy == policy and seg.messages and messages[: len(seg.messages)] == seg.messages
            for seg in self._segments
        )

    @property
    def segments(self) -> int:
        """Token streams recorded (one sample each)."""
        return len(self._segments)

    def samples(
        self, task: Task, reward: float, *, group_id: str, meta: Mapping[str, Any] | None = None
    ) -> list[Sample]:
        """One sample per segment, in order, each with the episode's reward."""
        out = []
        with self._lock:
            per_policy: dict[str, int] = {}
            for seg in self._segments:
                per_policy[seg.policy] = per_policy.get(seg.policy, 0) + 1
            for index, seg in enumerate(self._segments):
                out.append(self._sample(task, seg, index, reward, group_id, per_policy, meta))
        return out

    def _sample(
        self,
        task: Task,
        seg: _Segment,
        index: int,
        reward: float,
        group_id: str,
        per_policy: Mapping[str, int],
        meta: Mapping[str, Any] | None,
    ) -> Sample:
        info = rollout_info(task, seg.turns, seg.gens, self.started)
        info.update(
            segment=index,
            segments=per_policy[seg.policy],
            template_breaks=self.template_breaks,
            calls=self.calls,
        )
        info.update(meta or {})
        return columns_sample(seg.policy, task, group_id, seg.stream, reward, info)


def _encode(tokenizer: Any, text: str) -> list[int]:
    fast = getattr(tokenizer, "is_fast", False)
    backend = getattr(tokenizer, "backend_tokenizer", None) if fast else None
    if backend is not None:  # the same Rust tokenizer, without the Python wrapper's cost
        return list(backend.encode(text, add_special_tokens=False).ids)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
