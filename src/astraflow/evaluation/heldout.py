"""One held-out set: its tasks, prompts and reward, scored greedily and/or with k samples.

    rows ─► prompts ─┬─► greedy: one completion per task ─► reward ─► accuracy
                     └─► sampled: k completions per task ─► reward ─► avg@k, pass@j

``env`` workflows play whole episodes instead of completions (success is the score). The
sampled pass draws from a forked torch RNG seeded by ``(seed, version)``, so a version's
figures are reproducible and the process's own RNG is left alone.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from astraflow.evaluation.config import ScoringSettings
from astraflow.evaluation.episodes import LocalPolicy, episode_means, play_episodes
from astraflow.evaluation.metrics import default_pass_at, sampled_metrics
from astraflow.models.padding import left_padded
from astraflow.plugins import PluginSpec, validate_config
from astraflow.progress import Tracker, track
from astraflow.workflows.api import encode_prompt
from astraflow.workflows.prompts import build_prompt
from astraflow.workflows.registry import WORKFLOWS, SingleRoleConfig
from astraflow.workflows.rewards import RewardResolver
from astraflow.workflows.tasks import GENERATORS

__all__ = ["Decoding", "HeldOut", "generate"]


@dataclass(frozen=True)
class Decoding:
    """How completions are generated (shared by every set of an evaluator)."""

    max_new_tokens: int | None
    """Generation bound (None: the workflow's)."""
    batch_size: int
    """Prompts per generation batch."""
    env_temperature: float
    """Temperature of the greedy pass of ``env`` episodes."""


class HeldOut:
    """A held-out task set and how it is scored; ``prefix`` keys its metrics."""

    def __init__(
        self,
        prefix: str,
        generator: PluginSpec,
        workflow: PluginSpec,
        scoring: ScoringSettings,
        *,
        seed: int,
        decoding: Decoding,
    ) -> None:
        self.prefix = prefix
        self.scoring = scoring
        self.seed = seed
        self.decoding = decoding
        self.rows = list(GENERATORS.build(generator, seed=seed).rows())
        self.pass_at = scoring.pass_at or default_pass_at(scoring.k)
        where = f"eval workflow{f' of set {prefix!r}' if prefix else ''}"
        self.env_spec: dict[str, Any] | None = None
        if workflow.type == "env":
            validate_config(WORKFLOWS.resolve("env"), workflow.kwargs, where)
            self.env_spec = {"type": workflow.type, **workflow.kwargs}
            return
        config = validate_config(WORKFLOWS.resolve(workflow.type), workflow.kwargs, where)
        if not isinstance(config, SingleRoleConfig):
            raise TypeError("evaluation supports single-role workflows (rlvr, tool_calling)")
        self.workflow = config
        self.rewards = RewardResolver(config.reward, seed=seed)
        self.max_new_tokens = decoding.max_new_tokens or config.sampling.max_new_tokens

    @property
    def generations(self) -> int:
        """Completions (or episodes) one evaluation makes."""
        return len(self.rows) * (int(self.scoring.greedy) + self.scoring.k)

    def evaluate(self, policy: LocalPolicy, description: str) -> dict[str, float]:
        """Every figure of this set for the model behind ``policy``, keys prefixed."""
        figures: dict[str, float] = {}
        with track(description, total=self.generations) as bar:
            if self.scoring.greedy:
                figures |= self._greedy(policy, bar)
            if self.scoring.k:
                figures |= self._sampled(policy, bar)
        figures["n"] = len(self.rows)
        if self.scoring.k:
            figures["k"] = self.scoring.k
        return {f"{self.prefix}/{k}" if self.prefix else k: v for k, v in figures.items()}

    def _greedy(self, policy: LocalPolicy, bar: Tracker) -> dict[str, float]:
        if self.env_spec is not None:
            temperature = self.decoding.env_temperature
            played = play_episodes(
                self.env_spec, self.rows, policy, temperature=temperature, seed=self.seed
            )
            bar.advance(len(self.rows))
            return episode_means(played)
        texts = self._complete(policy, self._prompts(policy.tokenizer), None, bar)
        scores = asyncio.run(self._score(texts, self.rows))
        return {"accuracy": math.fsum(scores) / max(1, len(scores))}

    def _sampled(self, policy: LocalPolicy, bar: Tracker) -> dict[str, float]:
        k, scoring = self.scoring.k, self.scoring
        rows = [row for row in self.rows for _ in range(k)]
        seed = self.seed * 1_000_003 + policy.version
        if self.env_spec is not None:
            played = play_episodes(
                self.env_spec, rows, policy, temperature=scoring.sample_temperature, seed=seed
            )
            bar.advance(len(rows))
            flat = [e["success"] for e in played]
        else:
            prompts = [p for p in self._prompts(policy.tokenizer) for _ in range(k)]
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                texts = self._complete(policy, prompts, scoring, bar)
            flat = asyncio.run(self._score(texts, rows))
        per_task = [flat[i : i + k] for i in range(0, len(flat), k)]
        threshold = 1.0 if self.env_spec is not None else scoring.success_threshold
        return sampled_metrics(per_task, threshold=threshold, pass_at=self.pass_at)

    def _prompts(self, tokenizer: Any) -> list[list[int]]:
        cfg = self.workflow.prompt
        return [
            list(
                encode_prompt(
                    tokenizer,
                    build_prompt(row, template=cfg.template, system=cfg.system, chat=cfg.chat),
                )
            )
            for row in self.rows
        ]

    def _complete(
        self,
        policy: LocalPolicy,
        prompts: list[list[int]],
        sampling: ScoringSettings | None,
        bar: Tracker,
    ) -> list[str]:
        texts: list[str] = []
        size = self.decoding.batch_size
        for start in range(0, len(prompts), size):
            chunk = prompts[start : start + size]
            texts += generate(policy.model, policy.tokenizer, chunk, self.max_new_tokens, sampling)
            bar.advance(len(chunk))
        return texts

    async def _score(self, texts: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> list[float]:
        return list(
            await asyncio.gather(
                *(self.rewards.score(t, row) for t, row in zip(texts, rows, strict=True))
            )
        )


@torch.inference_mode()
def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: ScoringSettings | None,
) -> list[str]:
    """Left-padded batch generation: greedy without ``sampling``, else at its temperature."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask = left_padded(prompts, pad)
    width = ids.shape[1]
    decode: dict[str, Any] = {"do_sample": False}
    if sampling is not None:
        decode = {
            "do_sample": True,
            "temperature": sampling.sample_temperature,
            "top_p": sampling.top_p,
            "top_k": 0,
        }
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
        **decode,
    )
    return [tokenizer.decode(row[width:], skip_special_tokens=True) for row in out.tolist()]
