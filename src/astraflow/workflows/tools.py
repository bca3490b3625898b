"""Tools a workflow can offer a model, and the tool-call syntax the model writes.

A call is ``<tool>NAME: ARGUMENTS</tool>``; the workflow stops generation at ``</tool>``,
runs the tool and appends ``<result>OUTPUT</result>`` as context (never trained on). Tools
never raise on bad input: errors come back as text the model can read.

    calculator   arithmetic on numbers: + - * / // % ** (or ^), parentheses, abs round min
                 max sqrt; evaluated from the syntax tree, never with eval
    search       BM25 over the local document collection (``workflows.corpus``)
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.plugins import Registry
from astraflow.workflows.api import Tool
from astraflow.workflows.corpus import build_corpus

__all__ = ["TOOLS", "Calculator", "SearchTool", "ToolCall", "parse_tool_call"]

TOOLS: Registry[Tool] = Registry(
    "tool",
    Tool,
    ("astraflow.workflows.tools",),
)


@dataclass(frozen=True)
class ToolCall:
    """A parsed tool call."""

    name: str
    arguments: str


def parse_tool_call(
    text: str, open_tag: str = "<tool>", close_tag: str = "</tool>"
) -> ToolCall | None:
    """The last complete ``<tool>name: arguments</tool>`` in ``text``, or None."""
    pattern = re.escape(open_tag) + r"\s*([A-Za-z_][\w.-]*)\s*:(.*?)" + re.escape(close_tag)
    calls = re.findall(pattern, text, re.DOTALL)
    if not calls:
        return None
    name, arguments = calls[-1]
    return ToolCall(str(name), str(arguments).strip())


# --------------------------------------------------------------------------- calculator

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.BitXor: operator.pow,  # calculators write 2^3 for a power
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its result is out of bounds."""


class _Evaluator:
    def __init__(self, max_bits: int) -> None:
        self.max_bits = max_bits

    def check(self, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalculatorError("only numbers are allowed")
        if isinstance(value, int) and value.bit_length() > self.max_bits:
            raise CalculatorError("number too large")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("result is not finite")
        return value

    def eval(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return self.eval(node.body)
        if isinstance(node, ast.Constant):
            return self.check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self.check(_UNARY[type(node.op)](self.eval(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self.eval(node.left), self.eval(node.right)
            if isinstance(node.op, (ast.Pow, ast.BitXor)):
                self.check_power(left, right)
            return self.check(_BINARY[type(node.op)](left, right))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCTIONS
            and not node.keywords
        ):
            args = [self.eval(a) for a in node.args]
            return self.check(_FUNCTIONS[node.func.id](*args))
        raise CalculatorError(f"unsupported syntax: {type(node).__name__}")

    def check_power(self, base: Any, exponent: Any) -> None:
        if abs(exponent) > 10_000:
            raise CalculatorError("exponent too large")
        if abs(base) > 1 and exponent > 0 and exponent * math.log2(abs(base)) > self.max_bits:
            raise CalculatorError("number too large")


def _format(value: Any) -> str:
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".10g")
    return str(value)


@TOOLS.register("calculator")
class Calculator:
    """Evaluates arithmetic expressions safely (syntax-tree walk, bounded numbers)."""

    class Config(ConfigModel):
        max_chars: int = Field(default=200, ge=1)
        """Longest expression accepted."""
        max_bits: int = Field(default=256, ge=8)
        """Largest integer result, in bits."""

    name = "calculator"

    def __init__(self, config: Config | None = None, rng: random.Random | None = None) -> None:
        self.config = config or Calculator.Config()

    def evaluate(self, expression: str) -> str:
        """The value of ``expression`` as text, or ``error: …``."""
        expr = expression.strip()
        if len(expr) > self.config.max_chars:
            return f"error: expression longer than {self.config.max_chars} characters"
        try:
            tree = ast.parse(expr, mode="eval")
            return _format(_Evaluator(self.config.max_bits).eval(tree))
        except SyntaxError:
            return "error: not a valid expression"
        except ZeroDivisionError:
            return "error: division by zero"
        except (CalculatorError, ValueError, TypeError, OverflowError) as exc:
            return f"error: {exc}"

    async def __call__(self, arguments: str) -> str:
        """Evaluate (cheap: runs inline)."""
        return self.evaluate(arguments)


# --------------------------------------------------------------------------- search


@TOOLS.register("search")
class SearchTool:
    """BM25 search over the local document collection; returns the best documents."""

    class Config(ConfigModel):
        seed: int = 0
        """Seed of the collection (the QA task source must use the same)."""
        size: int = Field(default=200, ge=1)
        """Documents in the collection."""
        k: int = Field(default=2, ge=1)
        """Documents returned per query."""
        max_chars: int = Field(default=600, ge=20)
        """Longest output."""

    name = "search"

    def __init__(self, config: Config | None = None, rng: random.Random | None = None) -> None:
        self.config = config or SearchTool.Config()
        self.corpus = build_corpus(self.config.seed, self.config.size)

    def search(self, query: str) -> str:
        """The best documents for ``query``, as text."""
        docs = self.corpus.search(query, self.config.k)
        if not docs:
            return "no results"
        text = "\n".join(f"[{d.doc_id}] {d.title}: {d.text}" for d in docs)
        return text[: self.config.max_chars]

    async def __call__(self, arguments: str) -> str:
        """Search (cheap: runs inline)."""
        return self.search(arguments)
