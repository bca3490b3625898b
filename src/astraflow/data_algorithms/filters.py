"""Built-in trajectory filters: keep or drop one group (one task, one policy) after rollout.

    dynamic_sampling   drop groups whose rewards are all equal (no advantage signal in GRPO)
    length             drop groups with a sample too long, too short, or cut off by length

A filter drops a whole group, never single samples, so group normalisation stays intact.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import Field, model_validator

from astraflow.config import ConfigModel
from astraflow.data_algorithms import FILTERS
from astraflow.plugins import Configured
from astraflow.records import Sample

__all__ = ["DynamicSamplingFilter", "LengthFilter"]

ConfigT = TypeVar("ConfigT", bound=ConfigModel)


class _Counting(Configured[ConfigT]):
    """A filter whose behaviour is its config; counts checked and dropped groups per reason."""

    def __init__(self, config: ConfigT, rng: random.Random | None = None) -> None:
        super().__init__(config, rng)
        self.checked = 0
        self.dropped: Counter[str] = Counter()

    def _verdict(self, reason: str | None) -> str | None:
        self.checked += 1
        if reason is not None:
            self.dropped[reason.split(":")[0]] += 1
        return reason

    def state_dict(self) -> dict[str, Any]:
        """Counters, so the report survives a restart."""
        return {"checked": self.checked, "dropped": dict(self.dropped)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the counters."""
        self.checked = int(state.get("checked", 0))
        self.dropped = Counter({k: int(v) for k, v in state.get("dropped", {}).items()})

    def metrics(self) -> dict[str, float]:
        """Groups checked and dropped (in total and per reason)."""
        out = {"checked": float(self.checked), "dropped": float(sum(self.dropped.values()))}
        out.update({f"dropped_{k}": float(v) for k, v in self.dropped.items()})
        return out


class DynamicSamplingConfig(ConfigModel):
    """Arguments of the ``dynamic_sampling`` filter."""

    eps: float = Field(default=1e-6, ge=0.0)
    """Rewards whose spread (max - min) is at or below this count as equal."""


@FILTERS.register("dynamic_sampling")
class DynamicSamplingFilter(_Counting[DynamicSamplingConfig]):
    """Drop groups whose rewards are all equal (all correct or all wrong)."""

    Config = DynamicSamplingConfig

    def check(self, policy: str, group: Sequence[Sample]) -> str | None:
        """Drop a zero-variance group."""
        rewards = [s.reward for s in group]
        if max(rewards) - min(rewards) <= self.config.eps:
            return self._verdict(f"zero_variance: all {len(rewards)} rewards are {rewards[0]:g}")
        return self._verdict(None)


class LengthConfig(ConfigModel):
    """Arguments of the ``length`` filter."""

    max_tokens: int | None = Field(default=None, ge=1)
    """Drop the group if a sample has more tokens than this (prompt included)."""
    min_generated: int = Field(default=0, ge=0)
    """Drop the group if a sample has fewer generated (trained) tokens than this."""
    max_generated: int | None = Field(default=None, ge=1)
    """Drop the group if a sample has more generated tokens than this."""
    drop_truncated: bool = False
    """Drop the group if a sample's ``meta['finish_reason']`` is ``'length'``."""

    @model_validator(mode="after")
    def _check(self) -> LengthConfig:
        if self.max_generated is not None and self.min_generated > self.max_generated:
            raise ValueError("min_generated is larger than max_generated")
        return self


@FILTERS.register("length")
class LengthFilter(_Counting[LengthConfig]):
    """Drop groups with a sample outside the configured length bounds."""

    Config = LengthConfig

    def check(self, policy: str, group: Sequence[Sample]) -> str | None:
        """Name the first bound a sample breaks."""
        c = self.config
        for s in group:
            if c.max_tokens is not None and s.num_tokens > c.max_tokens:
                return self._verdict(f"too_long: {s.num_tokens} tokens > {c.max_tokens}")
            if s.num_generated < c.min_generated:
                return self._verdict(
                    f"too_short: {s.num_generated} generated tokens < {c.min_generated}"
                )
            if c.max_generated is not None and s.num_generated > c.max_generated:
                return self._verdict(
                    f"too_long: {s.num_generated} generated tokens > {c.max_generated}"
                )
            if c.drop_truncated and s.meta.get("finish_reason") == "length":
                return self._verdict("truncated: a sample stopped at its length limit")
        return self._verdict(None)
