"""Code tasks: pull code out of a model's answer and assemble the programs the sandbox runs.

A code task payload follows HumanEval: ``prompt`` (imports, signature and docstring),
``entry_point`` (function name), ``test`` (defines ``check(candidate)``) and, optionally,
``canonical_solution`` (the reference body).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from typing import Any

from astraflow.errors import ValidationError

__all__ = [
    "count_asserts",
    "extract_code",
    "reference_program",
    "solution_program",
    "with_reference_tests",
]

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The code in a model answer: the first fenced block if there is one, else the text."""
    match = _FENCE.search(text)
    return match.group(1) if match else text


def _field(payload: Mapping[str, Any], key: str) -> str:
    value = payload.get(key)
    if not isinstance(value, str) or not value:
        raise ValidationError(f"code task payload needs a non-empty {key!r}", field=key)
    return value


def solution_program(payload: Mapping[str, Any], answer: str) -> str:
    """The model's solution as a program: its own definition, or a body under the prompt.

    An answer that defines the entry point is placed after the prompt (whose imports it may
    rely on, and whose docstring-only definition it replaces); otherwise the answer is the
    function body and is appended to the prompt.
    """
    prompt = _field(payload, "prompt")
    entry = _field(payload, "entry_point")
    code = extract_code(answer)
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        return f"{prompt}\n    pass\n\n{code}\n"
    return f"{prompt}{code}\n"


def reference_program(payload: Mapping[str, Any]) -> str:
    """The task's reference solution as a program."""
    return f"{_field(payload, 'prompt')}{_field(payload, 'canonical_solution')}\n"


def with_reference_tests(payload: Mapping[str, Any], solution: str) -> str:
    """``solution`` followed by the task's reference tests, run against the entry point."""
    test = _field(payload, "test")
    entry = _field(payload, "entry_point")
    return f"{solution}\n\n{test}\n\ncheck({entry})\n"


def count_asserts(code: str) -> int:
    """Top-level and nested ``assert`` statements in ``code``; -1 when it does not parse."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return -1
    return sum(isinstance(node, ast.Assert) for node in ast.walk(tree))
