"""Evaluate versions of a policy on its held-out sets while it trains, and log the figures.

    ┌─► newest version in the store past the next milestone? ──no──► wait every_s (or stop) ─┐
    │        │ yes                                                                            │
    │        ▼                                                                                │
    │   pull it in place (delta chain) → every set: greedy and/or k samples → reward → append  │
    └─────────────────────────────────────────────────────────────────────────────────────────┘

A milestone is any new version, or with ``every_versions: N`` a version past the next multiple
of N. On stop the newest version is evaluated once more if it was not yet, so a run's final
figures are always recorded. ``evaluate_version`` scores one given version (a finished run).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from astraflow.errors import NotFoundError
from astraflow.evaluation.config import EvalConfig
from astraflow.evaluation.episodes import LocalPolicy
from astraflow.evaluation.heldout import Decoding, HeldOut
from astraflow.records import NO_VERSION
from astraflow.weights import WeightClient
from astraflow.weights.access import client_token
from astraflow.weights.transfer import TransferOptions

__all__ = ["Evaluator"]

log = logging.getLogger(__name__)


#: How many times in a row one check moves on to a newer version when the one it picked was
#: collected before it could be pulled.
_RACES = 5


class Evaluator:
    """Held-out figures (greedy accuracy, avg@k, pass@k) of the versions it evaluates."""

    def __init__(self, config: EvalConfig) -> None:
        self.config = config
        torch.set_num_threads(config.threads)
        decoding = Decoding(config.max_new_tokens, config.batch_size, config.temperature)
        self.sets = [
            HeldOut("", config.generator, config.workflow, config, seed=config.seed,
                    decoding=decoding),
            *(HeldOut(s.name, s.generator, s.workflow or config.workflow, s,
                      seed=config.seed, decoding=decoding) for s in config.sets),
        ]  # fmt: skip
        self.client = WeightClient(config.weights, options=TransferOptions(token=client_token()))
        self.version = NO_VERSION
        self.model: Any = None
        self.tokenizer: Any = None
        self.out = Path(config.out)
        self.out.parent.mkdir(parents=True, exist_ok=True)

    def run(self, stop: threading.Event) -> None:
        """Evaluate milestone versions until ``stop`` is set, then the newest once more."""
        while not stop.is_set():
            self.step()
            stop.wait(self.config.every_s)
        self.step(final=True)

    def step(self, *, final: bool = False) -> dict[str, Any] | None:
        """Evaluate the newest version if it is a milestone (any new one when ``final``);
        return its record."""
        latest = self.client.latest(self.config.policy)
        if latest is None or latest <= self.version:
            return None
        every = self.config.every_versions
        if (
            not final
            and every is not None
            and self.version != NO_VERSION
            and latest // every <= self.version // every
        ):
            return None
        for _ in range(_RACES):
            try:
                return self.evaluate_version(latest)
            except NotFoundError as exc:
                # collected between ``latest`` and the pull (the trainer outran a slow start):
                # the newest one instead, never a crash of the evaluator
                newest = self.client.latest(self.config.policy)
                if newest is None or newest <= latest:
                    raise
                log.info("eval policy=%s: v%d is gone (%s); v%d instead",
                         self.config.policy, latest, exc, newest)  # fmt: skip
                latest = newest
        log.warning("eval policy=%s: each version was collected before it could be pulled; "
                    "trying again at the next check", self.config.policy)  # fmt: skip
        return None

    def evaluate_version(self, version: int) -> dict[str, Any]:
        """Pull ``version``, score every set, append the record to ``out`` and return it.

        Raises ``NotFoundError`` naming the policy and version when the store lacks it."""
        policy = self.config.policy
        try:
            manifest = self.client.manifest(policy, version)
        except NotFoundError as exc:
            latest = self.client.latest(policy)
            raise NotFoundError(
                f"policy {policy!r} has no version {version} in {self.config.weights} "
                f"(latest: {latest}): {exc}"
            ) from exc
        self._load(version)
        started = time.monotonic()
        handle = LocalPolicy(policy, self.model, self.tokenizer, version, self.config.seed)
        figures: dict[str, float] = {}
        for held in self.sets:
            name = f"eval {policy} v{version}{f' {held.prefix}' if held.prefix else ''}"
            figures |= held.evaluate(handle, name)
        record = {
            "policy": policy,
            "version": version,
            "created_at": manifest.created_at,
            **figures,
            "eval_s": round(time.monotonic() - started, 3),
            "time": time.time(),
        }
        with self.out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        shown = " ".join(f"{k}={v:.3f}" for k, v in figures.items() if "@" in k or "acc" in k)
        log.info("eval policy=%s version=%d %s", policy, version, shown)
        return record

    def _load(self, version: int) -> None:
        if self.model is None:
            self._build(version)
        state = self.model.state_dict()
        behind = self.version == NO_VERSION or version < self.version
        have = None if behind else self.version  # an older version: from a full snapshot
        self.client.pull(self.config.policy, state, have, version)
        self.version = version

    def _build(self, version: int) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        assets = self.client.fetch_assets(
            self.config.policy, Path(self.config.out).parent / f".assets-{self.config.policy}"
        )
        self.tokenizer = AutoTokenizer.from_pretrained(assets)
        self.tokenizer.padding_side = "left"
        entry = self.client.manifest(self.config.policy, version).tensors[0]
        dtype: torch.dtype = getattr(torch, entry.dtype)
        self.model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(assets), dtype=dtype
        ).eval()
