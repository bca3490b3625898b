"""Synthetic verifiable tasks: arithmetic and string manipulation with tunable difficulty.

Every row is a pure function of ``(family, seed, split, index)``. Train and eval splits are
disjoint *by content* when ``holdout > 0``: a prompt belongs to the eval split exactly when a
hash of its text falls below ``holdout``, and each split only keeps its own prompts. With
``holdout = 0`` the splits differ by seed stream only (disjoint ids, same distribution).

The quickstart task ``add1``: prompt ``a+b=`` with single digits, answer
``str(a+b)``, reward ``synthetic_exact`` (the completion up to EOS equals the answer exactly).
Its SFT warm-up pairs come from :func:`noisy_sft_pairs` (correct with probability p, else an
answer drawn uniformly from the family's answers: 0-18 for ``add1``).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from astraflow.config import ConfigModel
from astraflow.errors import ConfigError
from astraflow.plugins import GENERATOR_SPEC, PluginSpec
from astraflow.workflows.prompts import fill
from astraflow.workflows.tasks import GENERATORS

__all__ = ["Add1", "Arithmetic", "NoisySFT", "StringTasks", "Verify", "noisy_sft_pairs"]

_MAX_TRIES = 1000
_POOL_DRAWS = 2000


def in_holdout(prompt: str, fraction: float) -> bool:
    """Whether ``prompt`` belongs to the held-out (eval) part of its family's prompt space."""
    digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


class SplitConfig(ConfigModel):
    """Size, seed and split shared by the synthetic families."""

    size: int = Field(default=1000, ge=1)
    """Rows produced."""
    seed: int = 0
    """Content seed: the same seed always gives the same rows."""
    split: Literal["train", "eval"] = "train"
    """Which side of the held-out boundary to produce."""
    holdout: float = Field(default=0.1, ge=0.0, lt=1.0)
    """Fraction of the prompt space reserved for eval (0: splits differ by seed only)."""


class _Family:
    """Shared row loop: seeded per index, rejection into the configured split."""

    family = "synthetic"
    config: SplitConfig

    def make(self, rng: random.Random) -> dict[str, Any]:
        """One candidate row (prompt, answer, difficulty) from ``rng``."""
        raise NotImplementedError

    def rows(self) -> Iterator[dict[str, Any]]:
        """``size`` rows of this split."""
        cfg = self.config
        for index in range(cfg.size):
            rng = random.Random(f"{self.family}:{cfg.seed}:{cfg.split}:{index}")
            yield {"id": f"{self.family}-{cfg.split}-{cfg.seed}-{index}", **self._accepted(rng)}

    def _accepted(self, rng: random.Random) -> dict[str, Any]:
        cfg = self.config
        want_eval = cfg.split == "eval"
        for _ in range(_MAX_TRIES):
            row = self.make(rng)
            if cfg.holdout == 0 or in_holdout(row["prompt"], cfg.holdout) == want_eval:
                return {**row, "reward": "synthetic_exact", "family": self.family}
        raise ConfigError(
            f"{self.family}: no {cfg.split} prompt found in {_MAX_TRIES} tries; the prompt space "
            f"is too small for holdout={cfg.holdout} (raise it, or use holdout=0)"
        )

    def answer_pool(self) -> list[str]:
        """The family's distinct answers (sampled), for noisy labels."""
        rng = random.Random(f"{self.family}:{self.config.seed}:pool")
        return sorted({str(self.make(rng)["answer"]) for _ in range(_POOL_DRAWS)})


# --------------------------------------------------------------------------- arithmetic


def _evaluate(numbers: list[int], ops: list[str]) -> int:
    """``n0 op0 n1 op1 ...`` with ``*`` before ``+``/``-``."""
    terms, signs = [numbers[0]], []
    for op, value in zip(ops, numbers[1:], strict=True):
        if op == "*":
            terms[-1] *= value
        else:
            signs.append(op)
            terms.append(value)
    total = terms[0]
    for sign, term in zip(signs, terms[1:], strict=True):
        total = total + term if sign == "+" else total - term
    return total


class ArithmeticConfig(SplitConfig):
    """Config of ``arithmetic``."""

    min_digits: int = Field(default=1, ge=1, le=18)
    """Fewest digits per operand."""
    max_digits: int = Field(default=2, ge=1, le=18)
    """Most digits per operand."""
    min_operands: int = Field(default=2, ge=2, le=8)
    """Fewest operands."""
    max_operands: int = Field(default=2, ge=2, le=8)
    """Most operands."""
    operators: str = Field(default="+", pattern=r"^[-+*]+$")
    """Operators to draw from, e.g. '+-*'."""

    @model_validator(mode="after")
    def _ranges(self) -> ArithmeticConfig:
        if self.min_digits > self.max_digits or self.min_operands > self.max_operands:
            raise ValueError("min_digits/min_operands must not exceed max_digits/max_operands")
        return self


@GENERATORS.register("arithmetic")
class Arithmetic(_Family):
    """Expressions like ``12+7*3=`` with the integer answer; difficulty grows with size."""

    Config = ArithmeticConfig
    family = "arithmetic"

    def __init__(self, config: ArithmeticConfig, rng: random.Random | None = None) -> None:
        self.config: ArithmeticConfig = config

    def make(self, rng: random.Random) -> dict[str, Any]:
        """One expression."""
        cfg = self.config
        count = rng.randint(cfg.min_operands, cfg.max_operands)
        digits = [rng.randint(cfg.min_digits, cfg.max_digits) for _ in range(count)]
        numbers = [rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1) for d in digits]
        ops = [rng.choice(cfg.operators) for _ in range(count - 1)]
        expr = "".join(f"{n}{op}" for n, op in zip(numbers, [*ops, ""], strict=True))
        difficulty = max(digits) + (count - 2) + ("*" in ops)
        return {
            "prompt": f"{expr}=",
            "answer": str(_evaluate(numbers, ops)),
            "difficulty": difficulty,
        }


class Add1Config(ConfigModel):
    """Config of ``add1``: only size, seed, split and holdout."""

    size: int = Field(default=1000, ge=1)
    """Rows produced."""
    seed: int = 0
    """Content seed."""
    split: Literal["train", "eval"] = "train"
    """Which split."""
    holdout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Eval fraction of the 100 prompts; 0 (default): eval differs by seed stream only."""


@GENERATORS.register("add1")
class Add1(Arithmetic):
    """The quickstart task: single-digit ``a+b=``."""

    Config = Add1Config  # type: ignore[assignment]  # a narrowed config of arithmetic
    family = "add1"

    def __init__(self, config: Add1Config, rng: random.Random | None = None) -> None:
        super().__init__(ArithmeticConfig(max_digits=1, **config.model_dump()))


# --------------------------------------------------------------------------- strings


StringOp = Literal["reverse", "sort", "count"]
_STRING_OPS: tuple[StringOp, ...] = ("reverse", "sort", "count")


class StringConfig(SplitConfig):
    """Config of ``string``."""

    ops: list[StringOp] = Field(default_factory=lambda: list(_STRING_OPS), min_length=1)
    """Operations to draw from."""
    min_length: int = Field(default=3, ge=1)
    """Shortest word."""
    max_length: int = Field(default=6, ge=1)
    """Longest word."""
    letters: str = Field(default="abcdefgh", min_length=2)
    """Letters words are made of."""


@GENERATORS.register("string")
class StringTasks(_Family):
    """``reverse abc=`` → ``cba``, ``sort cab=`` → ``abc``, ``count a in abca=`` → ``2``."""

    Config = StringConfig
    family = "string"

    def __init__(self, config: StringConfig, rng: random.Random | None = None) -> None:
        if config.min_length > config.max_length:
            raise ConfigError("string: min_length must not exceed max_length")
        self.config: StringConfig = config

    def make(self, rng: random.Random) -> dict[str, Any]:
        """One string task."""
        cfg = self.config
        op = rng.choice(cfg.ops)
        word = "".join(
            rng.choice(cfg.letters) for _ in range(rng.randint(cfg.min_length, cfg.max_length))
        )
        if op == "reverse":
            prompt, answer = f"reverse {word}=", word[::-1]
        elif op == "sort":
            prompt, answer = f"sort {word}=", "".join(sorted(word))
        else:
            letter = rng.choice(cfg.letters)
            prompt, answer = f"count {letter} in {word}=", str(word.count(letter))
        return {"prompt": prompt, "answer": answer, "difficulty": len(word), "op": op}


# --------------------------------------------------------------------------- SFT warm-up


def noisy_sft_pairs(generator: Any, correct_prob: float, seed: int = 0) -> Iterator[dict[str, Any]]:
    """SFT pairs from a synthetic generator whose labels are correct with ``correct_prob``.

    Wrong labels are drawn uniformly from the family's answers (they may hit the right one
    by chance; ``correct`` says which rows are right). The completion has no EOS: the trainer
    appends it, and tokenizes the prompt with ``workflows.api.encode_prompt``.
    """
    if not 0.0 <= correct_prob <= 1.0:
        raise ConfigError(f"correct_prob must be in [0, 1], got {correct_prob}")
    pool = generator.answer_pool()
    for row in generator.rows():
        rng = random.Random(f"sft:{seed}:{row['id']}")
        label = row["answer"] if rng.random() < correct_prob else rng.choice(pool)
        yield {
            "id": row["id"],
            "prompt": row["prompt"],
            "completion": label,
            "answer": row["answer"],
            "correct": label == row["answer"],
        }


class NoisySFTConfig(ConfigModel):
    """Config of ``noisy_sft``."""

    task: Annotated[PluginSpec, GENERATOR_SPEC] = Field(
        default_factory=lambda: PluginSpec(type="add1")
    )
    """The synthetic generator whose rows are labelled."""
    correct_prob: float = Field(default=0.3, ge=0.0, le=1.0)
    """Probability that a label is the right answer (0.3: the quickstart's noisy warm-up)."""
    seed: int = 0
    """Seed of the label noise."""


@GENERATORS.register("noisy_sft")
class NoisySFT:
    """Rows ``{prompt, completion, correct}`` for an SFT warm-up with noisy labels."""

    Config = NoisySFTConfig

    def __init__(self, config: NoisySFTConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self.task = GENERATORS.build(config.task, seed=config.seed)
        if not hasattr(self.task, "answer_pool"):
            raise ConfigError(f"noisy_sft needs a synthetic generator, got {config.task.type!r}")

    def rows(self) -> Iterable[dict[str, Any]]:
        """Labelled rows."""
        return noisy_sft_pairs(self.task, self.config.correct_prob, self.config.seed)


# --------------------------------------------------------------------------- verification


class VerifyConfig(ConfigModel):
    """Config of ``verify``."""

    task: Annotated[PluginSpec, GENERATOR_SPEC] = Field(
        default_factory=lambda: PluginSpec(type="add1")
    )
    """The synthetic generator whose answers are judged (its split and size apply)."""
    template: str = "{question}{answer}?"
    """Judging prompt, fields {question} and {answer}: the same as the verifier's template."""
    correct_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """Share of rows whose proposed answer is the right one (others: a wrong one)."""
    label_correct_prob: float = Field(default=1.0, ge=0.0, le=1.0)
    """Probability that ``completion`` (the SFT label) is the true verdict (else flipped)."""
    yes: str = "yes"
    """Verdict for a right answer."""
    no: str = "no"
    """Verdict for a wrong answer."""
    seed: int = 0
    """Seed of the proposed answers and the label noise."""


@GENERATORS.register("verify")
class Verify:
    """Judging rows for a verifier: ``{question}{answer}?`` → ``yes`` / ``no``.

    ``answer`` is the true verdict (reward ``synthetic_exact``: held-out verifier accuracy);
    ``completion`` is a label that is right with ``label_correct_prob`` (SFT warm-up).
    """

    Config = VerifyConfig

    def __init__(self, config: VerifyConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self.task: Any = GENERATORS.build(config.task, seed=config.seed)
        if not hasattr(self.task, "answer_pool"):
            raise ConfigError(f"verify needs a synthetic generator, got {config.task.type!r}")

    def rows(self) -> Iterator[dict[str, Any]]:
        """One judging row per task row."""
        cfg = self.config
        pool = self.task.answer_pool()
        for row in self.task.rows():
            rng = random.Random(f"verify:{cfg.seed}:{row['id']}")
            right = rng.random() < cfg.correct_fraction
            wrong = [a for a in pool if a != row["answer"]]
            proposed = row["answer"] if right or not wrong else rng.choice(wrong)
            truth = cfg.yes if proposed == row["answer"] else cfg.no
            flip = rng.random() >= cfg.label_correct_prob
            yield {
                "id": f"verify-{row['id']}",
                "prompt": fill(cfg.template, {"question": row["prompt"], "answer": proposed}),
                "answer": truth,
                "completion": (cfg.no if truth == cfg.yes else cfg.yes) if flip else truth,
                "reward": "synthetic_exact",
                "family": "verify",
            }
