"""Generated programming tasks: one-line Python functions from a short spec, hidden tests.

``pyfunc`` rows follow HumanEval (``prompt``, ``entry_point``, ``test``, ``canonical_solution``;
reward ``code_tests``), small enough for a tiny character-level model::

    prompt    def f(x):\\n    # times 3 plus 5\\n    return       (the model writes the rest)
    solution  x*3+5                                              (any passing body counts)
    test      def check(candidate):\\n    assert candidate(0) == 5\\n    ...   (hidden)

Families: integers (add, subtract, times, modulo, times-plus, add-times), strings (reverse,
first/last k, repeat, length) and lists (max, min, sum, sorted, length, first, last, sum-plus).
The prompt space is a few hundred specs; ``holdout`` reserves a hash-chosen share of them for
the eval split, so held-out tasks are specs never seen in training (new combinations of a known
operation and known digits). Rows are sampled with replacement, as in ``synthetic``.

Warm-up rows for the other roles of the code workflows, over the same specs (the templates
must be the workflow's own):

- ``pyfunc_select``: a ``solver_selector`` prompt with ``candidates`` numbered answers (some
  right, some drawn from other specs' solutions) → the number of a right one (noisy label).
- ``pyfunc_tests``: a ``solver_testgen`` prompt → ``assert f(A) == B`` (``B`` the spec's
  output, or with probability ``1 - correct_prob`` another spec's: a wrong test).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Annotated, Any

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.plugins import GENERATOR_SPEC, PluginSpec
from astraflow.workflows.multi_policy import SELECTOR_TEMPLATE
from astraflow.workflows.prompts import fill
from astraflow.workflows.tasks import GENERATORS
from astraflow.workflows.tasks.synthetic import SplitConfig, _Family
from astraflow.workflows.testgen import TESTGEN_TEMPLATE

__all__ = ["SPECS", "PyFunc", "PyFuncSelect", "PyFuncTests"]

_INTS = (0, 1, 2, 5, 7, -3)
_STRS = ("abc", "hello", "xy", "python", "a")
_LISTS = ((3, 1, 2), (5,), (-1, 4, 4, 0), (2, 9, 7, 1, 6))
_ARG = {"int": "x", "str": "s", "list": "xs"}
_INPUTS: dict[str, tuple[Any, ...]] = {"int": _INTS, "str": _STRS, "list": _LISTS}
#: The one input each warm-up test is written for, per argument type.
_TEST_INPUTS: dict[str, tuple[Any, ...]] = {
    "int": (0, 1, 2),
    "str": ("ab", "abc"),
    "list": ((1, 2), (3, 1, 2)),
}


def _specs() -> list[tuple[str, str, str]]:
    """Every spec: (argument type, spec words, reference body)."""
    d = range(1, 10)
    out = [("int", f"add {k}", f"x+{k}") for k in d]
    out += [("int", f"subtract {k}", f"x-{k}") for k in d]
    out += [("int", f"times {k}", f"x*{k}") for k in d if k > 1]
    out += [("int", f"modulo {k}", f"x%{k}") for k in d if k > 1]
    out += [("int", f"times {a} plus {b}", f"x*{a}+{b}") for a in d if a > 1 for b in d]
    out += [("int", f"add {a} then times {b}", f"(x+{a})*{b}") for a in d for b in d if b > 1]
    out += [("str", "reverse", "s[::-1]"), ("str", "length", "len(s)")]
    out += [("str", f"first {k}", f"s[:{k}]") for k in d]
    out += [("str", f"last {k}", f"s[-{k}:]") for k in d]
    out += [("str", f"repeat {k}", f"s*{k}") for k in d if k > 1]
    out += [
        ("list", name, body)
        for name, body in (
            ("max", "max(xs)"),
            ("min", "min(xs)"),
            ("sum", "sum(xs)"),
            ("sorted", "sorted(xs)"),
            ("length", "len(xs)"),
            ("first", "xs[0]"),
            ("last", "xs[-1]"),
        )
    ]
    out += [("list", f"sum plus {k}", f"sum(xs)+{k}") for k in d]
    return out


SPECS: tuple[tuple[str, str, str], ...] = tuple(_specs())
"""(argument type, spec words, reference body) of every ``pyfunc`` task."""


def _function(kind: str, body: str) -> Callable[[Any], Any]:
    """The reference function (trusted: bodies come from ``SPECS``)."""
    fn: Callable[[Any], Any] = eval(f"lambda {_ARG[kind]}: {body}")
    return fn


def _literal(kind: str, value: Any) -> str:
    return repr(list(value)) if kind == "list" else repr(value)


def _test(kind: str, body: str) -> str:
    fn = _function(kind, body)
    lines = [
        f"    assert candidate({_literal(kind, x)}) == {fn(list(x) if kind == 'list' else x)!r}"
        for x in _INPUTS[kind]
    ]
    return "def check(candidate):\n" + "\n".join(lines) + "\n"


def _prompt(kind: str, words: str) -> str:
    return f"def f({_ARG[kind]}):\n    # {words}\n    return "


class PyFuncConfig(SplitConfig):
    """Config of ``pyfunc``."""

    holdout: float = Field(default=0.2, ge=0.0, lt=1.0)
    """Share of the specs reserved for the eval split (by a hash of the prompt)."""
    kinds: list[str] = Field(default_factory=lambda: ["int", "str", "list"], min_length=1)
    """Argument types to draw specs from: int, str, list."""


@GENERATORS.register("pyfunc")
class PyFunc(_Family):
    """One-line Python functions from a spec (``def f(x): # add 3``), with hidden tests."""

    Config = PyFuncConfig
    family = "pyfunc"

    def __init__(self, config: PyFuncConfig, rng: random.Random | None = None) -> None:
        unknown = sorted(set(config.kinds) - set(_ARG))
        if unknown:
            from astraflow.errors import ConfigError

            raise ConfigError(f"pyfunc: unknown kinds {unknown}; known: {sorted(_ARG)}")
        self.config: PyFuncConfig = config
        self.specs = [s for s in SPECS if s[0] in config.kinds]

    def make(self, rng: random.Random) -> dict[str, Any]:
        """One task."""
        kind, words, body = rng.choice(self.specs)
        return {
            "prompt": _prompt(kind, words),
            "answer": body,
            "canonical_solution": body,
            "entry_point": "f",
            "test": _test(kind, body),
            "kind": kind,
            "difficulty": len(words.split()),
        }

    def rows(self) -> Iterator[dict[str, Any]]:
        """``size`` rows of this split, scored by the sandbox (``code_tests``)."""
        for row in super().rows():
            yield {**row, "reward": "code_tests"}


class _RoleConfig(ConfigModel):
    task: Annotated[PluginSpec, GENERATOR_SPEC] = Field(
        default_factory=lambda: PluginSpec(type="pyfunc")
    )
    """The ``pyfunc`` tasks the rows are about (its split and size apply)."""
    correct_prob: float = Field(default=0.5, ge=0.0, le=1.0)
    """Probability that a row's label is right."""
    seed: int = 0
    """Seed of the labels."""


class PyFuncSelectConfig(_RoleConfig):
    """Config of ``pyfunc_select``."""

    template: str = SELECTOR_TEMPLATE
    """The selector's prompt, fields {question} and {candidates}: the workflow's template."""
    candidates: int = Field(default=4, ge=2, le=9)
    """Candidates per row (the solver's group size)."""
    right_prob: float = Field(default=0.5, ge=0.0, le=1.0)
    """Probability that a candidate is a right solution (at least one always is)."""


class _Role:
    config: Any

    def __init__(self, config: Any, rng: random.Random | None = None) -> None:
        self.config = config
        task = GENERATORS.build(config.task, seed=config.seed)
        if not isinstance(task, PyFunc):
            from astraflow.errors import ConfigError

            raise ConfigError(f"{type(self).__name__} needs a pyfunc task, got {config.task.type}")
        self.task = task
        self.pool = task.answer_pool()

    #: Prefix of the rows' ids and of each row's label seed.
    key = ""

    def rows(self) -> Iterator[dict[str, Any]]:
        """One row per task row, each labelled with its own seeded draw."""
        for row in self.task.rows():
            rng = random.Random(f"{self.key}:{self.config.seed}:{row['id']}")
            yield {"id": f"{self.key}-{row['id']}", **self.labelled(row, rng)}

    def labelled(self, row: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        """The warm-up row (prompt, completion, correct) for one task row."""
        raise NotImplementedError


@GENERATORS.register("pyfunc_select")
class PyFuncSelect(_Role):
    """Selector warm-up rows: numbered candidates → the number of a right one."""

    Config = PyFuncSelectConfig
    key = "select"

    def labelled(self, row: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        """Numbered candidates (at least one right) and the number picked."""
        cfg = self.config
        wrong = [a for a in self.pool if a != row["answer"]]
        right = [rng.random() < cfg.right_prob for _ in range(cfg.candidates)]
        if not any(right):
            right[rng.randrange(cfg.candidates)] = True
        answers = [row["answer"] if ok else rng.choice(wrong) for ok in right]
        text = "\n".join(f"({i + 1}) {a}" for i, a in enumerate(answers))
        good = [i for i, ok in enumerate(right) if ok]
        labelled = rng.random() < cfg.correct_prob
        pick = rng.choice(good) if labelled else rng.randrange(len(right))
        return {
            "prompt": fill(cfg.template, {"question": row["prompt"], "candidates": text}),
            "completion": str(pick + 1),
            "correct": right[pick],
        }


class PyFuncTestsConfig(_RoleConfig):
    """Config of ``pyfunc_tests``."""

    template: str = TESTGEN_TEMPLATE
    """The test generator's prompt (payload fields): the workflow's ``testgen_template``."""


@GENERATORS.register("pyfunc_tests")
class PyFuncTests(_Role):
    """Test-writer warm-up rows: a task → ``assert f(A) == B`` (right with ``correct_prob``)."""

    Config = PyFuncTestsConfig
    key = "tests"

    def labelled(self, row: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        """One assert on a drawn input, right with ``correct_prob``."""
        cfg = self.config
        kind = row["kind"]
        x = rng.choice(_TEST_INPUTS[kind])
        arg = list(x) if kind == "list" else x
        body = row["answer"]
        if rng.random() >= cfg.correct_prob:
            body = rng.choice([s[2] for s in SPECS if s[0] == kind and s[2] != body])
        expected = _function(kind, body)(arg)
        return {
            "prompt": fill(cfg.template, row),
            "completion": f"assert f({_literal(kind, x)}) == {expected!r}",
            "correct": expected == _function(kind, row["answer"])(arg),
        }
