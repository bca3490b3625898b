"""Evaluate versions of a policy on its held-out sets while it trains, and log the figures.

    ┌─► newest version in the store past the next milestone? ──no──► wait every_s (or stop) ─┐
    │        │ yes                                                                            │
    │        ▼                                                                                │
    │   pull it in place (delta chain) → every set: greedy and/or k samples → reward → append  │
    └─────────────────────────────────────────────────────────────────────────────────────────┘

A milestone is any new version, or with ``every_versions: N`` a version past the next multiple
of N. On stop the newest version is evaluated once more if it was not yet, so a run's final
figures are always recorded. ``evaluate_version`` scores one given version (a finished run).

Start-up: until its first evaluation the evaluator looks every ``FIRST_POLL_S``, builds its
model as soon as the policy's assets are out (a fresh trainer publishes them before its
warm-up), and a fresh evaluator (no record of its policy yet) scores version 0 first when the
store still holds it, so every curve starts where training started even when the evaluator
was slower to start than the trainer.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from astraflow.errors import UNCHANGED_BY_FAILED_PULL, NotFoundError
from astraflow.evaluation.config import EvalConfig
from astraflow.evaluation.episodes import LocalPolicy
from astraflow.evaluation.heldout import Decoding, HeldOut
from astraflow.models import compute_dtype
from astraflow.records import NO_VERSION
from astraflow.weights import WeightClient
from astraflow.weights.access import client_token
from astraflow.weights.tensors import torch_dtype
from astraflow.weights.transfer import TransferOptions

__all__ = ["Evaluator"]

log = logging.getLogger(__name__)


#: How many times in a row one check moves on to a newer version when the one it picked was
#: collected before it could be pulled.
_RACES = 5
#: Seconds between looks at the store until the first evaluation.
FIRST_POLL_S = 0.25


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
        self._pulled: dict[str, torch.Tensor] | None = None
        """The published tensors of ``version`` where the model computes in another dtype."""
        self.out = Path(config.out)
        self.out.parent.mkdir(parents=True, exist_ok=True)

    def run(self, stop: threading.Event) -> None:
        """Evaluate milestone versions until ``stop`` is set, then the newest once more."""
        while not stop.is_set():
            self.step()
            first = self.version == NO_VERSION
            stop.wait(min(FIRST_POLL_S, self.config.every_s) if first else self.config.every_s)
        self.step(final=True)

    def step(self, *, final: bool = False) -> dict[str, Any] | None:
        """Evaluate the newest version if it is a milestone (any new one when ``final``);
        return its record."""
        latest = self.client.latest(self.config.policy)
        if latest is None:
            self._build_early()
            return None
        if latest <= self.version:
            return None
        if self.version == NO_VERSION and latest > 0 and not self._recorded():
            first = self._first_version()
            if first is not None:
                return first
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
        self._load(version, manifest.tensors[0].dtype)
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

    def _load(self, version: int, dtype: str) -> None:
        published = torch_dtype(dtype)
        if self.model is None or self.model.dtype != self._compute(published):
            self._build(version)  # first, or built early from assets that named another dtype
        state = self.model.state_dict()
        behind = self.version == NO_VERSION or version < self.version
        have = None if behind else self.version  # an older version: from a full snapshot
        if self.model.dtype == published:
            self._pulled = None
            self.client.pull(self.config.policy, state, have, version)
        else:  # pulls move the published tensors bit for bit: into a copy in their dtype
            held = self._pulled  # the published tensors of self.version, if any
            pulled = held
            if pulled is None or next(iter(pulled.values())).dtype != published:
                entries = self.client.manifest(self.config.policy, version).tensors
                pulled = {e.name: torch.empty(e.shape, dtype=torch_dtype(e.dtype))
                          for e in entries}  # fmt: skip
                have = None
            self._pulled = None  # until the pull has written all of it
            try:
                self.client.pull(self.config.policy, pulled, have, version)
            except UNCHANGED_BY_FAILED_PULL:
                self._pulled = held  # left as it was: the next pull is a delta on it again
                raise
            self._pulled = pulled
            with torch.no_grad():
                for name, tensor in pulled.items():
                    state[name].copy_(tensor)
        self.version = version

    def _compute(self, published: torch.dtype) -> torch.dtype:
        """The dtype the model computes in for weights published in ``published``."""
        return compute_dtype(self.config.dtype, published, "cpu")

    def _recorded(self) -> bool:
        """``out`` already holds a record of this policy (a restarted evaluator)."""
        if not self.out.is_file():
            return False
        with self.out.open() as f:
            return any(json.loads(line).get("policy") == self.config.policy
                       for line in f if line.strip())  # fmt: skip

    def _first_version(self) -> dict[str, Any] | None:
        """Version 0's record, when the store still holds it (``keep_first``; else None: the
        newest instead). ``evaluate_version`` reads its manifest first and writes nothing
        when it is missing."""
        try:
            return self.evaluate_version(0)
        except NotFoundError:
            return None

    def _build_early(self) -> None:
        """Build the model from the assets before any version is out (NotFound: later)."""
        if self.model is None:
            try:
                self._build(None)
            except NotFoundError:
                return

    def _build(self, version: int | None) -> None:
        """The model in the dtype of ``version``'s tensors, else the one the assets name."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        assets = self.client.fetch_assets(
            self.config.policy, Path(self.config.out).parent / f".assets-{self.config.policy}"
        )
        config = AutoConfig.from_pretrained(assets)
        dtype: Any = getattr(config, "dtype", None)
        if version is not None or dtype is None:
            found = self.client.latest(self.config.policy) if version is None else version
            if found is None:
                raise NotFoundError(f"policy {self.config.policy!r}: no version yet")
            dtype = self.client.manifest(self.config.policy, found).tensors[0].dtype
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.removeprefix("torch."))
        dtype = self._compute(dtype)
        tokenizer = AutoTokenizer.from_pretrained(assets)
        tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        self.tokenizer = tokenizer
        self.version, self._pulled = NO_VERSION, None  # a new model holds no version yet
