"""Tools (calculator, search, call syntax), prompt building and reply parsing, code assembly."""

from __future__ import annotations

import pytest

from astraflow.errors import ValidationError, WorkflowError
from astraflow.workflows.code import (
    count_asserts,
    extract_code,
    solution_program,
    with_reference_tests,
)
from astraflow.workflows.prompts import (
    build_prompt,
    fill,
    get_policy,
    parse_choice,
    parse_verdict,
    question_text,
)
from astraflow.workflows.tasks import GENERATORS
from astraflow.workflows.tools import TOOLS, Calculator, SearchTool, parse_tool_call


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("2+3", "5"),
        ("12*(3+4)", "84"),
        ("7/2", "3.5"),
        ("8/2", "4"),
        ("2^10", "1024"),
        ("2**0.5", "1.414213562"),
        ("-(3-5)%4", "2"),
        ("max(3, abs(-7), round(2.6))", "7"),
        ("sqrt(16)", "4"),
    ],
)
def test_calculator_evaluates_arithmetic(expr: str, value: str) -> None:
    assert Calculator().evaluate(expr) == value


@pytest.mark.parametrize(
    ("expr", "error"),
    [
        ("__import__('os').system('true')", "unsupported syntax"),
        ("(1).__class__", "unsupported syntax"),
        ("open('x')", "unsupported syntax"),
        ("[1, 2]", "unsupported syntax"),
        ("'a' * 3", "only numbers"),
        ("1/0", "division by zero"),
        ("9**9**9", "too large"),
        ("10**100000", "exponent too large"),
        ("(-8)**0.5", "only numbers"),
        ("2 +", "not a valid expression"),
        ("1" * 300, "longer than"),
        ("sqrt(-1)", "error"),
    ],
)
def test_calculator_refuses_anything_but_bounded_arithmetic(expr: str, error: str) -> None:
    out = Calculator().evaluate(expr)
    assert out.startswith("error:") and error in out


async def test_tools_from_registry_answer_as_text() -> None:
    calc = TOOLS.build("calculator")
    assert calc.name == "calculator" and await calc("6*7") == "42"
    search = TOOLS.build({"type": "search", "k": 1})
    assert search.name == "search" and await search("???") == "no results"


def test_search_tool_retrieves_the_answering_document() -> None:
    tool = SearchTool()
    rows = list(GENERATORS.build({"type": "search_qa", "size": 60}).rows())
    hits = sum(f"[{row['doc_id']}]" in tool.search(row["prompt"]) for row in rows)
    assert hits / len(rows) > 0.9  # each question names its city; BM25 finds the document


def test_parse_tool_call_syntax() -> None:
    call = parse_tool_call("think <tool>calculator: 2 + 3 </tool>")
    assert call is not None and (call.name, call.arguments) == ("calculator", "2 + 3")
    last = parse_tool_call("<tool>a: 1</tool> <tool>search: x y</tool>")
    assert last is not None and last.name == "search"
    assert parse_tool_call("<tool>calculator 2+3</tool>") is None  # no colon
    assert parse_tool_call("<tool>calculator: 2+3") is None  # not closed


def test_build_prompt_text_chat_and_messages() -> None:
    payload = {"prompt": "1+1=", "answer": "2"}
    assert build_prompt(payload) == "1+1="
    assert build_prompt(payload, template="Q: {prompt} (answer {answer})") == "Q: 1+1= (answer 2)"
    assert build_prompt(payload, system="Be brief. ") == "Be brief. 1+1="
    assert build_prompt(payload, system="S", chat=True) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "1+1="},
    ]
    msgs = {"messages": [{"role": "user", "content": "hi"}]}
    assert build_prompt(msgs, system="S") == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
    ]
    assert question_text(msgs) == "hi" and question_text(payload) == "1+1="
    with pytest.raises(ValidationError, match="needs field 'missing'"):
        fill("{missing}", payload)
    with pytest.raises(ValidationError, match="'prompt' text or 'messages'"):
        build_prompt({"answer": "2"})
    with pytest.raises(ValidationError, match="list of"):
        build_prompt({"messages": ["not a message"]})


def test_parse_verdict_and_choice() -> None:
    assert parse_verdict("Yes, it is right") is True
    assert parse_verdict("no.") is False
    assert parse_verdict("nothing") is None  # 'no' must be a word
    assert parse_choice("I pick (2)", 3) == 1
    assert parse_choice("7", 3) is None
    assert parse_choice("none", 3) is None


def test_get_policy_names_what_the_node_hosts() -> None:
    with pytest.raises(WorkflowError, match="needs policy 'b'; this node hosts: a"):
        get_policy({"a": object()}, "b", "rlvr")  # type: ignore[dict-item]


def test_code_assembly() -> None:
    payload = {
        "prompt": "import math\ndef f(x):\n    '''doc'''\n",
        "entry_point": "f",
        "test": "def check(c):\n    assert c(4) == 2\n",
    }
    body = solution_program(payload, "    return int(math.sqrt(x))")
    assert body.startswith(payload["prompt"]) and body.endswith("return int(math.sqrt(x))\n")
    full = solution_program(payload, "Here:\n```python\ndef f(x):\n    return 2\n```\nDone.")
    assert "def f(x):\n    return 2" in full and "Done" not in full
    assert with_reference_tests(payload, "S").endswith("check(f)\n")
    assert extract_code("no fence") == "no fence"
    assert count_asserts("assert f(1) == 1\nassert f(2)") == 2
    assert count_asserts("x = (") == -1
