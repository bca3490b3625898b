"""Train/eval content splits of the shipped environments (``options={"split": ...}``).

An environment with ``holdout > 0`` keeps that share of its episode contents (goal items,
target products, questions, tasks, starting piles) for ``split: eval`` episodes; ``split:
train`` episodes never draw them. Membership is a hash of the content's key, so it is the same
on every node and in every run. No split given: any content.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["choose", "held_out", "split_of"]

T = TypeVar("T")


def held_out(key: str, share: float) -> bool:
    """Whether content ``key`` belongs to the held-out (eval) share."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:4], "big") < share * 2**32


def split_of(options: Mapping[str, Any] | None) -> str | None:
    """``options['split']``: 'train', 'eval' or None; anything else is an error."""
    split = (options or {}).get("split")
    if split not in (None, "train", "eval"):
        raise ValueError(f"options.split must be 'train' or 'eval', got {split!r}")
    return split


def choose(
    rng: random.Random,
    items: Sequence[T],
    key: Callable[[T], str],
    share: float,
    split: str | None,
) -> T:
    """A random item of ``split``'s share (any item when there is no split or no holdout)."""
    if split is None or share <= 0:
        return rng.choice(items)
    pool = _members(tuple(key(item) for item in items), share, split == "eval")
    if not pool:
        raise ValueError(f"no episode content falls in split {split!r} (holdout {share})")
    return items[rng.choice(pool)]


@functools.lru_cache(maxsize=64)
def _members(keys: tuple[str, ...], share: float, evaluation: bool) -> tuple[int, ...]:
    return tuple(i for i, k in enumerate(keys) if held_out(k, share) == evaluation)
