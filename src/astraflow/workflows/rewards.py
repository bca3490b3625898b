"""Rewards: score a response against its task payload, in [0, 1], without blocking the loop.

A reward is ``await reward(response, payload) -> float`` built from the ``REWARDS`` registry
as ``cls(config, rng)``. A workflow's config names one (``reward: math``), or leaves it unset
to use the name each task row carries in ``payload["reward"]`` (generators set it), via
:class:`RewardResolver`.

| name | checks | payload keys |
|---|---|---|
| ``synthetic_exact`` | completion (up to EOS) == answer, exactly | answer |
| ``exact_match`` | SQuAD-normalised equality with any gold answer | answer, aliases |
| ``qa_f1`` | SQuAD token F1, best over gold answers | answer, aliases |
| ``math`` | math-verify in a worker process with a timeout | answer |
| ``code_tests`` | the task's tests pass in the sandbox | prompt, entry_point, test |
| ``reasoning_gym`` | the dataset's own ``score_answer`` | dataset, answer, metadata |
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import re
import string
from collections.abc import Mapping
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.errors import PluginError, RewardError, ValidationError
from astraflow.plugins import Configured, PluginSpec, Registry
from astraflow.workflows.code import solution_program, with_reference_tests
from astraflow.workflows.mathcheck import as_gold, shared_pool
from astraflow.workflows.sandbox import Sandbox, SandboxConfig

__all__ = [
    "REWARDS",
    "Reward",
    "RewardResolver",
    "ScoredWorkflow",
    "extract_tagged",
    "normalize_answer",
    "token_f1",
]

log = logging.getLogger(__name__)


@runtime_checkable
class Reward(Protocol):
    """Scores one response to a task; 1.0 is fully correct."""

    async def __call__(self, response: str, payload: Mapping[str, Any]) -> float:
        """The reward of ``response`` for the task described by ``payload``."""
        ...


REWARDS: Registry[Reward] = Registry(
    "reward",
    Reward,
    ("astraflow.workflows.rewards",),
)


def extract_tagged(text: str, tag: str | None) -> str:
    """The content of the last ``<tag>…</tag>`` in ``text``, or ``text`` when there is none."""
    if not tag:
        return text
    found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, re.DOTALL)
    return str(found[-1]).strip() if found else text


def _golds(payload: Mapping[str, Any]) -> list[str]:
    if "answer" not in payload:
        raise ValidationError("task payload has no 'answer' to score against", field="answer")
    aliases = payload.get("aliases") or []
    return [str(payload["answer"]), *(str(a) for a in aliases)]


# --------------------------------------------------------------------------- text answers


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token-overlap F1 of two answers after normalisation."""
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(pred_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


class _TagConfig(ConfigModel):
    answer_tag: str | None = "answer"
    """Score the content of the last ``<answer>…</answer>`` when the response has one."""


@REWARDS.register("synthetic_exact")
class SyntheticExact:
    """1.0 when the completion (decoded up to EOS) equals ``payload['answer']`` exactly."""

    class Config(ConfigModel):
        strip: bool = False
        """Ignore surrounding whitespace (off: the quickstart's reward is exact)."""

    def __init__(self, config: Config, rng: random.Random) -> None:
        self.config = config

    async def __call__(self, response: str, payload: Mapping[str, Any]) -> float:
        """Exact string match."""
        answer = _golds(payload)[0]
        if self.config.strip:
            return float(response.strip() == answer.strip())
        return float(response == answer)


@REWARDS.register("exact_match")
class ExactMatch(Configured[_TagConfig]):
    """1.0 when the normalised answer equals any normalised gold answer."""

    Config = _TagConfig

    async def __call__(self, response: str, payload: Mapping[str, Any]) -> float:
        """SQuAD exact match."""
        pred = normalize_answer(extract_tagged(response, self.config.answer_tag))
        return float(any(pred == normalize_answer(g) for g in _golds(payload)))


@REWARDS.register("qa_f1")
class QAF1(Configured[_TagConfig]):
    """Token F1 against the best-matching gold answer."""

    Config = _TagConfig

    async def __call__(self, response: str, payload: Mapping[str, Any]) -> float:
        """SQuAD F1."""
        pred = extract_tagged(response, self.config.answer_tag)
        return max(token_f1(pred, g) for g in _golds(payload))


# --------------------------------------------------------------------------- math and code


@REWARDS.register("math")
class MathReward:
    """math-verify equivalence of the response's final answer with the gold answer.

    A check that runs past ``timeout_s`` scores 0 (the response is pathological).
    """

    class Config(ConfigModel):
        timeout_s: float = Field(default=5.0, gt=0)
        """Per-check limit, enforced by killing the worker process."""
        workers: int = Field(default=1, ge=1)
        """Worker processes (shared by every math reward with the same settings)."""

    def __init__(self, config: Config, rng: random.Random) -> None:
        self.config = config

    async def __call__(self, response: str, payload: Mapping[str, Any]) -> float:
        """1.0 when equivalent."""
        pool = shared_pool(self.config.workers, self.config.timeout_s)
        try:
            return float(await pool.verify(as_gold(_golds(payload)[0]), response))
        except TimeoutError:
            log.warning("math reward timed out after %ss: scoring 0", self.config.timeout_s)
            return 0.0


@REWARDS.register("code_tests")
class CodeTests:
    """1.0 when the solution passes the task's tests in the sandbox, else 0.0."""

    class Config(ConfigModel):
        sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
        """Limits of each sandboxed run."""

    def __init__(self, config: Config, rng: random.Random) -> None:
        self.config = config
        self.sandbox = Sandbox(config.sandbox)

    async def __call__(self, response: str, payload: Mapping[str, Any]) -> float:
        """Run the tests."""
        program = with_reference_tests(payload, solution_program(payload, response))
        result = await self.sandbox.run(program)
        return float(result.passed)


@REWARDS.register("reasoning_gym")
class ReasoningGymScore(Configured[_TagConfig]):
    """The reasoning-gym dataset's own ``score_answer`` (partial credit where it gives it)."""

    Config = _TagConfig

    async def __call__(self, response: str, payload: Mapping[str, Any]) -> float:
        """Score with the dataset named in ``payload['dataset']``."""
        import reasoning_gym

        name = payload.get("dataset")
        if not isinstance(name, str):
            raise ValidationError("reasoning_gym reward needs payload['dataset']", field="dataset")
        entry = {
            "question": payload.get("prompt", ""),
            "answer": _golds(payload)[0],
            "metadata": payload.get("metadata", {}),
        }
        score = reasoning_gym.get_score_answer_fn(name)(
            extract_tagged(response, self.config.answer_tag), entry
        )
        return float(score)


# --------------------------------------------------------------------------- resolution


class RewardResolver:
    """The reward a workflow applies: a fixed one from config, or the one each task names."""

    def __init__(self, spec: PluginSpec | str | Mapping[str, Any] | None, *, seed: int = 0):
        self._seed = seed
        self._fixed = REWARDS.build(spec, seed=seed) if spec is not None else None
        self._by_name: dict[str, Reward] = {}

    def reward_for(self, payload: Mapping[str, Any]) -> Reward:
        """The reward that scores this task."""
        if self._fixed is not None:
            return self._fixed
        name = payload.get("reward")
        if not isinstance(name, str):
            raise ValidationError(
                "the workflow names no reward and the task has no 'reward' field", field="reward"
            )
        if name not in self._by_name:
            try:
                self._by_name[name] = REWARDS.build(name, seed=self._seed)
            except PluginError as exc:
                raise ValidationError(
                    f"task names an unknown reward: {exc}", field="reward"
                ) from exc
        return self._by_name[name]

    async def score(self, response: str, payload: Mapping[str, Any]) -> float:
        """Score one response; raise ``RewardError`` if the reward fails or is not finite."""
        reward = self.reward_for(payload)
        try:
            value = float(await reward(response, payload))
        except (RewardError, ValidationError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a reward bug fails this task, never the node
            raise RewardError(f"reward {type(reward).__name__} failed: {exc}") from exc
        if not math.isfinite(value):
            raise RewardError(f"reward {type(reward).__name__} returned {value}")
        return value

    async def score_all(self, responses: list[str], payload: Mapping[str, Any]) -> list[float]:
        """Score several responses to the same task concurrently."""
        return list(await asyncio.gather(*(self.score(r, payload) for r in responses)))


class _NamesReward(Protocol):
    @property
    def reward(self) -> PluginSpec | str | None:
        """The reward the workflow applies (None: each task's ``payload['reward']``)."""
        ...


RewardConfigT = TypeVar("RewardConfigT", bound=_NamesReward)


class ScoredWorkflow(Generic[RewardConfigT]):
    """Base of a workflow that scores with its config's ``reward``: keeps the config and a
    :class:`RewardResolver` seeded from the build RNG."""

    def __init__(self, config: RewardConfigT, rng: random.Random) -> None:
        self.config = config
        self.rewards = RewardResolver(config.reward, seed=rng.randrange(2**31))
