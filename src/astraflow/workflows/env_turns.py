"""Turn rendering and action parsing for the ``env`` workflow (and its SFT warm-up).

Rendering: with ``chat`` the first observation becomes a user message after the optional
system prompt and each later one a user turn rendered by the chat template (only the delta);
without it (character models, base models) observations are appended as plain text through
``observation_template`` and the policy's raw text is the action — the same strings
:func:`plain_transcript` builds for warm-up pairs, so SFT and RL see identical tokens.

Parsing (``action.type``): ``raw`` (the reply, stripped), ``prefix`` (text after the last
``ACTION:`` on its line), ``regex`` (group 1, else the whole match, of ``pattern``),
``tool_call`` (a JSON ``{"name", "arguments": {"action": ...}}`` object, optionally inside
``<tool_call>`` tags). A reply that does not parse is an invalid action.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Literal

from pydantic import model_validator

from astraflow.config import ConfigModel
from astraflow.envs.protocol import Message, Observation

__all__ = ["ActionConfig", "ActionParser", "observation_messages", "observation_text"]


class ActionConfig(ConfigModel):
    """How the action is read from a policy's reply."""

    type: Literal["raw", "prefix", "regex", "tool_call"] = "raw"
    """raw: the whole reply; prefix: after ``prefix``; regex: ``pattern``; tool_call: JSON."""
    prefix: str = "ACTION:"
    """Marker before the action (type prefix)."""
    pattern: str | None = None
    """Regular expression (type regex): group 1, or the whole match."""
    argument: str = "action"
    """Argument of the tool call that holds the action (type tool_call)."""

    @model_validator(mode="after")
    def _pattern(self) -> ActionConfig:
        if self.type == "regex":
            if not self.pattern:
                raise ValueError("action type 'regex' needs 'pattern'")
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise ValueError(f"action pattern {self.pattern!r} is not a regex: {exc}") from exc
        return self


_TOOL_TAGS = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class ActionParser:
    """Reads actions out of replies; ``None`` when a reply holds none."""

    def __init__(self, config: ActionConfig, stop: Sequence[str] = ()) -> None:
        self.config = config
        self.stop = tuple(s for s in stop if s)
        self._regex = re.compile(config.pattern) if config.pattern else None

    def _strip_stop(self, text: str) -> str:
        for s in self.stop:
            if text.endswith(s):
                return text[: -len(s)]
        return text

    def __call__(self, reply: str) -> str | None:
        """The action in ``reply``."""
        text = self._strip_stop(reply)
        kind = self.config.type
        if kind == "raw":
            action = text.strip()
        elif kind == "prefix":
            at = text.rfind(self.config.prefix)
            if at < 0:
                return None
            action = text[at + len(self.config.prefix) :].split("\n", 1)[0].strip()
        elif kind == "regex":
            assert self._regex is not None
            match = self._regex.search(text)
            if match is None:
                return None
            action = (match.group(1) if match.groups() else match.group(0)).strip()
        else:
            action = self._tool_call(text) or ""
        return action or None

    def _tool_call(self, text: str) -> str | None:
        tagged = _TOOL_TAGS.search(text)
        body = tagged.group(1) if tagged else text[text.find("{") :] if "{" in text else ""
        try:
            call, _ = json.JSONDecoder().raw_decode(body.strip())
        except ValueError:
            return None
        args = call.get("arguments") if isinstance(call, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        value = args.get(self.config.argument) if isinstance(args, dict) else None
        return value if isinstance(value, str) else None


def observation_text(obs: Observation) -> str:
    """An observation as plain text (chat messages: their contents, one per line)."""
    if isinstance(obs, str):
        return obs
    return "\n".join(str(m.get("content", "")) for m in obs)


def observation_messages(obs: Observation) -> list[Message]:
    """An observation as chat messages (text: one user message)."""
    if isinstance(obs, str):
        return [{"role": "user", "content": obs}]
    return [dict(m) for m in obs]
