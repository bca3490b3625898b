"""Evaluate each new version of a policy on a held-out set, greedily, and log accuracy.

    ┌─► latest version in the store > last evaluated? ──no──► wait every_s (or stop) ─┐
    │        │ yes                                                                      │
    │        ▼                                                                          │
    │   pull it in place (delta chain) → greedy generate all prompts → reward → append  │
    └───────────────────────────────────────────────────────────────────────────────────┘

On stop the newest version is evaluated once more if it was not yet, so a run's final
accuracy is always recorded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from astraflow.evaluation.config import EvalConfig
from astraflow.evaluation.episodes import LocalPolicy, evaluate_episodes
from astraflow.models.padding import left_padded
from astraflow.plugins import validate_config
from astraflow.records import NO_VERSION
from astraflow.weights import WeightClient
from astraflow.weights.access import client_token
from astraflow.weights.transfer import TransferOptions
from astraflow.workflows.api import encode_prompt
from astraflow.workflows.prompts import build_prompt
from astraflow.workflows.registry import WORKFLOWS, SingleRoleConfig
from astraflow.workflows.rewards import RewardResolver
from astraflow.workflows.tasks import GENERATORS

__all__ = ["Evaluator"]

log = logging.getLogger(__name__)


class Evaluator:
    """Greedy held-out accuracy of every version it sees."""

    def __init__(self, config: EvalConfig) -> None:
        self.config = config
        torch.set_num_threads(config.threads)
        spec = config.workflow
        self.env_spec = {"type": spec.type, **spec.kwargs} if spec.type == "env" else None
        self.figures: dict[str, float] = {}
        self.rows = list(GENERATORS.build(config.generator, seed=config.seed).rows())
        self.client = WeightClient(config.weights, options=TransferOptions(token=client_token()))
        self.version = NO_VERSION
        self.model: Any = None
        self.tokenizer: Any = None
        self.out = Path(config.out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        if self.env_spec is not None:
            validate_config(WORKFLOWS.resolve("env"), spec.kwargs, "eval workflow")
            return
        wf_config = validate_config(WORKFLOWS.resolve(spec.type), spec.kwargs, "eval workflow")
        if not isinstance(wf_config, SingleRoleConfig):
            raise TypeError("evaluation supports single-role workflows (rlvr, tool_calling)")
        self.workflow = wf_config
        self.rewards = RewardResolver(wf_config.reward, seed=config.seed)
        self.max_new_tokens = config.max_new_tokens or wf_config.sampling.max_new_tokens

    def run(self, stop: threading.Event) -> None:
        """Evaluate new versions until ``stop`` is set, then once more if behind."""
        while not stop.is_set():
            self.step()
            stop.wait(self.config.every_s)
        self.step()

    def step(self) -> dict[str, Any] | None:
        """Evaluate the newest version if it is new; return its record."""
        latest = self.client.latest(self.config.policy)
        if latest is None or latest <= self.version:
            return None
        self._load(latest)
        started = time.monotonic()
        accuracy = self.evaluate()
        manifest = self.client.manifest(self.config.policy, latest)
        record = {
            "policy": self.config.policy,
            "version": latest,
            "created_at": manifest.created_at,
            "accuracy": accuracy,
            **self.figures,
            "n": len(self.rows),
            "eval_s": round(time.monotonic() - started, 3),
            "time": time.time(),
        }
        with self.out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        log.info("eval policy=%s version=%d accuracy=%.3f", self.config.policy, latest, accuracy)
        return record

    def _load(self, version: int) -> None:
        if self.model is None:
            self._build()
        state = self.model.state_dict()
        have = None if self.version == NO_VERSION else self.version
        self.client.pull(self.config.policy, state, have, version)
        self.version = version

    def _build(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        assets = self.client.fetch_assets(
            self.config.policy, Path(self.config.out).parent / f".assets-{self.config.policy}"
        )
        self.tokenizer = AutoTokenizer.from_pretrained(assets)
        self.tokenizer.padding_side = "left"
        manifest_dtype = self._published_dtype()
        self.model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(assets), dtype=manifest_dtype
        ).eval()

    def _published_dtype(self) -> torch.dtype:
        latest = self.client.latest(self.config.policy)
        assert latest is not None
        entry = self.client.manifest(self.config.policy, latest).tensors[0]
        dtype: torch.dtype = getattr(torch, entry.dtype)
        return dtype

    @torch.inference_mode()
    def evaluate(self) -> float:
        """Mean reward of greedy completions over the held-out rows (``env``: success rate of
        one whole episode per row)."""
        if self.env_spec is not None:
            policy = LocalPolicy(
                self.config.policy, self.model, self.tokenizer, self.version, self.config.seed
            )
            self.figures = evaluate_episodes(
                self.env_spec,
                self.rows,
                policy,
                temperature=self.config.temperature,
                seed=self.config.seed,
            )
            return self.figures.pop("accuracy")
        prompt_cfg = self.workflow.prompt
        prompts = [
            list(
                encode_prompt(
                    self.tokenizer,
                    build_prompt(
                        row, template=prompt_cfg.template, system=prompt_cfg.system,
                        chat=prompt_cfg.chat,
                    ),
                )
            )
            for row in self.rows
        ]  # fmt: skip
        texts: list[str] = []
        for start in range(0, len(prompts), self.config.batch_size):
            texts += self._generate(prompts[start : start + self.config.batch_size])
        scores = asyncio.run(self._score(texts))
        return float(sum(scores) / max(1, len(scores)))

    def _generate(self, prompts: list[list[int]]) -> list[str]:
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        ids, mask = left_padded(prompts, pad)
        width = ids.shape[1]
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=self.max_new_tokens,
            pad_token_id=pad,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        return [
            self.tokenizer.decode(row[width:], skip_special_tokens=True) for row in out.tolist()
        ]

    async def _score(self, texts: list[str]) -> list[float]:
        return list(
            await asyncio.gather(
                *(self.rewards.score(t, row) for t, row in zip(texts, self.rows, strict=True))
            )
        )
