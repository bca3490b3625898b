"""The generated code tasks (``pyfunc``) and the warm-up rows of the code workflows' roles."""

from __future__ import annotations

import re
from typing import Any

import pytest

from astraflow.errors import ConfigError
from astraflow.workflows.code import reference_program, solution_program, with_reference_tests
from astraflow.workflows.prompts import parse_choice
from astraflow.workflows.tasks import GENERATORS


def _rows(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(GENERATORS.build(spec).rows())


def _passes(program: str) -> bool:
    """Run a generated (trusted) program in-process: True when every assert holds."""
    try:
        exec(compile(program, "<task>", "exec"), {})
    except AssertionError:
        return False
    return True


def test_pyfunc_rows_are_humaneval_shaped_and_their_tests_judge_solutions() -> None:
    rows = _rows({"type": "pyfunc", "size": 300})
    assert rows == _rows({"type": "pyfunc", "size": 300})
    assert {r["kind"] for r in rows} == {"int", "str", "list"}
    for row in rows:
        assert row["reward"] == "code_tests" and row["entry_point"] == "f"
        assert row["prompt"].startswith("def f(") and row["prompt"].endswith("return ")
        # the reference passes its hidden tests, written as an answer or as the full program
        assert _passes(with_reference_tests(row, reference_program(row)))
        assert _passes(with_reference_tests(row, solution_program(row, row["answer"])))
    by_answer = {r["answer"]: r for r in rows}
    # an equivalent body passes, a near miss fails: the tests judge behaviour, not text
    times = next(r for a, r in by_answer.items() if re.fullmatch(r"x\*\d\+\d", a))
    a, b = times["answer"][2], times["answer"][4]
    assert _passes(with_reference_tests(times, solution_program(times, f"{b}+{a}*x")))
    assert not _passes(with_reference_tests(times, solution_program(times, f"x*{a}-{b}")))


def test_pyfunc_eval_specs_are_never_trained_on() -> None:
    train = {r["prompt"] for r in _rows({"type": "pyfunc", "size": 4000})}
    held = {r["prompt"] for r in _rows({"type": "pyfunc", "size": 1000, "split": "eval"})}
    assert train.isdisjoint(held)
    assert 20 <= len(held) <= 60 and len(train) > 150
    ints = _rows({"type": "pyfunc", "size": 50, "kinds": ["int"]})
    assert {r["kind"] for r in ints} == {"int"}
    with pytest.raises(ConfigError, match="unknown kinds"):
        GENERATORS.build({"type": "pyfunc", "kinds": ["float"]})


def test_selector_warmup_rows_number_the_candidates_and_label_a_right_one() -> None:
    spec = {"type": "pyfunc", "size": 400}
    tasks = _rows(spec)
    rows = _rows({"type": "pyfunc_select", "task": spec, "candidates": 4, "correct_prob": 0.8,
                  "template": "{question}\n{candidates}\npick: "})  # fmt: skip
    assert len(rows) == len(tasks)
    for task, row in zip(tasks, rows, strict=True):
        assert row["prompt"].startswith(task["prompt"] + "\n(1) ")
        assert row["prompt"].endswith("\n(4) " + row["prompt"].split("\n(4) ")[1])
        lines = row["prompt"].split("\n")[-5:-1]
        answers = [line.split(") ", 1)[1] for line in lines]
        assert task["answer"] in answers  # at least one candidate is right
        pick = parse_choice(row["completion"], 4)
        assert pick is not None and row["correct"] == (answers[pick] == task["answer"])
    rate = sum(r["correct"] for r in rows) / len(rows)
    assert 0.8 < rate < 0.95  # right labels (0.8) plus random picks that hit a right one


def test_test_writer_warmup_rows_are_asserts_right_with_the_given_probability() -> None:
    spec = {"type": "pyfunc", "size": 400}
    tasks = _rows(spec)
    rows = _rows({"type": "pyfunc_tests", "task": spec, "correct_prob": 0.5,
                  "template": "{prompt}\n# test\n"})  # fmt: skip
    for task, row in zip(tasks, rows, strict=True):
        assert row["prompt"] == task["prompt"] + "\n# test\n"
        assert row["completion"].startswith("assert f(")
        holds = _passes(f"{reference_program(task)}\n{row['completion']}\n")
        assert holds == row["correct"]
    rate = sum(r["correct"] for r in rows) / len(rows)
    assert 0.45 < rate < 0.75  # 0.5 right, plus wrong specs that agree on the input
    with pytest.raises(ConfigError, match="needs a pyfunc task"):
        GENERATORS.build({"type": "pyfunc_tests", "task": {"type": "add1"}})
