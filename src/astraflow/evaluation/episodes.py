"""Held-out evaluation of the ``env`` workflow: whole episodes played by the evaluated model.

The episodes run through :class:`~astraflow.workflows.env.EnvWorkflow` itself (same
rendering, parsing, limits and reward as in training), with a local policy handle over the
evaluator's model that batches the concurrent episodes' turns into one ``generate`` call.
Greedy by default; with a temperature the policy samples (torch's RNG seeded per evaluation).
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from astraflow.models.padding import left_padded
from astraflow.records import Task
from astraflow.workflows.api import (
    Generation,
    NamedPolicy,
    Prompt,
    SamplingParams,
    encode_prompt,
)
from astraflow.workflows.env import EnvWorkflow, EnvWorkflowConfig

__all__ = ["LocalPolicy", "episode_means", "play_episodes"]


class LocalPolicy(NamedPolicy):
    """A policy handle over an in-process model; turns of concurrent episodes are batched."""

    def __init__(self, name: str, model: Any, tokenizer: Any, version: int, seed: int) -> None:
        super().__init__(name, tokenizer)
        self.model = model
        self._version = version
        self._pending: list[tuple[list[int], SamplingParams, asyncio.Future[Generation]]] = []
        self._flush: asyncio.Task[None] | None = None
        self._gen = torch.Generator().manual_seed(seed)

    @property
    def version(self) -> int:
        """Version being evaluated."""
        return self._version

    async def generate(
        self, prompt: Prompt, sampling: SamplingParams | None = None, *, n: int = 1
    ) -> list[Generation]:
        """Queue ``n`` requests; they are decoded with whatever else is queued."""
        ids = encode_prompt(self._tokenizer, prompt)
        params = sampling or SamplingParams()
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(n)]
        self._pending += [(ids, params, f) for f in futures]
        if self._flush is None:
            self._flush = asyncio.ensure_future(self._run())
        return list(await asyncio.gather(*futures))

    async def _run(self) -> None:
        await asyncio.sleep(0.005)  # let the other episodes' turns join this batch
        batch, self._pending, self._flush = self._pending, [], None
        by_params: dict[SamplingParams, list[Any]] = {}
        for item in batch:
            by_params.setdefault(item[1], []).append(item)
        for params, items in by_params.items():
            try:
                gens = self._decode([i[0] for i in items], params)
            except Exception as exc:  # hand the failure to every waiting episode
                for _, _, fut in items:
                    fut.set_exception(exc)
                continue
            for (_, _, fut), gen in zip(items, gens, strict=True):
                fut.set_result(gen)

    @torch.inference_mode()
    def _decode(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        tok = self._tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        ids, mask = left_padded(prompts, pad)
        width = ids.shape[1]
        greedy = params.temperature == 0
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None if greedy else (params.top_k or 0),
            max_new_tokens=params.max_new_tokens,
            pad_token_id=pad,
            eos_token_id=tok.eos_token_id,
        )
        rows = out.tolist()
        return [self._generation(p, r[width:], params) for p, r in zip(prompts, rows, strict=True)]

    def _generation(self, prompt: list[int], row: list[int], params: SamplingParams) -> Generation:
        tok = self._tokenizer
        tokens: list[int] = []
        reason = "length"
        for t in row:
            tokens.append(int(t))
            if t == tok.eos_token_id:
                reason = "stop"
                break
            text = tok.decode(tokens, skip_special_tokens=True)
            if any(s and s in text for s in params.stop):
                reason = "stop"
                break
        return Generation(
            policy=self._name,
            version=self._version,
            prompt_ids=np.asarray(prompt, dtype=np.int32),
            token_ids=np.asarray(tokens, dtype=np.int32),
            logprobs=np.zeros(len(tokens), dtype=np.float32),
            text=tok.decode(tokens, skip_special_tokens=True),
            finish_reason="stop" if reason == "stop" else "length",
            temperature=params.temperature or 1.0,
        )


def play_episodes(
    spec: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    policy: LocalPolicy,
    *,
    temperature: float,
    seed: int,
) -> list[dict[str, float]]:
    """Play one episode per row; per episode: ``success``, ``return``, ``turns``,
    ``invalid_actions``."""
    data = {k: v for k, v in spec.items() if k != "type"}
    config = EnvWorkflowConfig.model_validate(data)
    sampling = config.sampling.model_copy(update={"temperature": temperature})
    workflow = EnvWorkflow(config.model_copy(update={"sampling": sampling}), random.Random(seed))
    torch.manual_seed(seed)

    async def play() -> list[Any]:
        tasks = [
            Task(task_id=f"eval-{i}", workflow="env", payload=dict(row), group_size=1)
            for i, row in enumerate(rows)
        ]
        return await asyncio.gather(*(workflow(t, {config.policy: policy}, {}) for t in tasks))

    samples = [group[0] for group in asyncio.run(play())]
    keys = ("success", "return", "turns", "invalid_actions")
    return [{key: float(s.meta[key]) for key in keys} for s in samples]


def episode_means(played: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Figures of played episodes: success rate (``accuracy``), mean return, turns and invalid
    actions."""
    return {
        "accuracy": statistics.fmean(e["success"] for e in played),
        "return": statistics.fmean(e["return"] for e in played),
        "turns": statistics.fmean(e["turns"] for e in played),
        "invalid_actions": statistics.fmean(e["invalid_actions"] for e in played),
    }
