"""Action parsing and observation rendering of the ``env`` workflow."""

from __future__ import annotations

import pytest

from astraflow.workflows.env import plain_turn
from astraflow.workflows.env_turns import ActionConfig, ActionParser


@pytest.mark.parametrize(
    ("config", "reply", "action"),
    [
        ({"type": "raw"}, " go north\n", "go north"),
        ({"type": "raw"}, "\n", None),
        ({"type": "prefix"}, "I think so.\nACTION: take key\nmore", "take key"),
        ({"type": "prefix"}, "ACTION: a\nACTION: b", "b"),
        ({"type": "prefix"}, "no marker here", None),
        ({"type": "regex", "pattern": r"\[(\w+)\]"}, "move [east] now", "east"),
        ({"type": "regex", "pattern": r"\d+"}, "guess 42!", "42"),
        ({"type": "regex", "pattern": r"\d+"}, "none", None),
        (
            {"type": "tool_call"},
            'ok <tool_call>{"name": "act", "arguments": {"action": "look"}}</tool_call>',
            "look",
        ),
        (
            {"type": "tool_call"},
            'think {"name": "act", "arguments": "{\\"action\\": \\"go\\"}"}',
            "go",
        ),
        (
            {"type": "tool_call"},
            '<tool_call>{"name": "act", "arguments": {"x": 1}}</tool_call>',
            None,
        ),
        ({"type": "tool_call"}, "<tool_call>{not json</tool_call>", None),
    ],
)
def test_action_parsing(config: dict[str, str], reply: str, action: str | None) -> None:
    assert ActionParser(ActionConfig.model_validate(config))(reply) == action


def test_stop_strings_are_cut_before_parsing() -> None:
    parser = ActionParser(ActionConfig(type="raw"), stop=("</act>",))
    assert parser("open door</act>") == "open door"


def test_bad_regex_is_named() -> None:
    with pytest.raises(ValueError, match="not a regex"):
        ActionConfig(type="regex", pattern="(")


def test_plain_turns() -> None:
    assert plain_turn("{observation}", "goal 1e 2n >", 0, "play ") == "play goal 1e 2n >"
    assert plain_turn("\nobs {turn}: {observation}", "x", 3, "ignored") == "\nobs 3: x"
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert plain_turn("{observation}", messages, 1) == "a\nb"
