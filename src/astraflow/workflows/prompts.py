"""Prompts from task payloads, and parsing of the short replies judges and selectors give.

A payload carries either ``prompt`` (text, formatted through a template) or ``messages``
(chat). Workflows decide whether text prompts are sent raw (char-level models, base models)
or as a user message through the policy's chat template (``chat: true``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from astraflow.errors import ValidationError, WorkflowError
from astraflow.workflows.api import Message, PolicyHandle, Prompt, Trajectory

__all__ = [
    "add_user_turn",
    "build_prompt",
    "fill",
    "get_policy",
    "parse_choice",
    "parse_verdict",
    "question_text",
]


def fill(template: str, values: Mapping[str, Any]) -> str:
    """``template.format_map(values)``, with a missing key named in the error."""
    try:
        return template.format_map(dict(values))
    except KeyError as exc:
        raise ValidationError(
            f"prompt template needs field {exc.args[0]!r}, which the task payload lacks",
            field=str(exc.args[0]),
        ) from exc
    except (ValueError, IndexError) as exc:
        raise ValidationError(f"bad prompt template {template!r}: {exc}", field="template") from exc


def _messages(payload: Mapping[str, Any]) -> list[Message] | None:
    raw = payload.get("messages")
    if raw is None:
        return None
    if not isinstance(raw, Sequence) or not all(
        isinstance(m, Mapping) and "role" in m and "content" in m for m in raw
    ):
        raise ValidationError(
            "payload 'messages' must be a list of {role, content}", field="messages"
        )
    return [dict(m) for m in raw]


def question_text(payload: Mapping[str, Any]) -> str:
    """The task's question as plain text: ``prompt``, or the last user message."""
    messages = _messages(payload)
    if messages is not None:
        users = [str(m["content"]) for m in messages if m["role"] == "user"]
        if users:
            return users[-1]
    prompt = payload.get("prompt")
    if not isinstance(prompt, str):
        raise ValidationError("task payload needs 'prompt' text or 'messages'", field="prompt")
    return prompt


def build_prompt(
    payload: Mapping[str, Any],
    *,
    template: str | None = None,
    system: str | None = None,
    chat: bool = False,
) -> Prompt:
    """The prompt a policy sees for this task.

    ``messages`` payloads stay chat (``system`` prepended unless one is there); a text
    ``prompt`` is formatted with ``template`` (payload fields by name) and, with ``chat``,
    becomes a user message; otherwise ``system`` is prepended as plain text.
    """
    messages = _messages(payload)
    if messages is not None:
        if system and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system})
        return messages
    if not isinstance(payload.get("prompt"), str):
        raise ValidationError("task payload needs 'prompt' text or 'messages'", field="prompt")
    text = fill(template, payload) if template else str(payload["prompt"])
    if chat:
        head: list[Message] = [{"role": "system", "content": system}] if system else []
        return [*head, {"role": "user", "content": text}]
    return f"{system}{text}" if system else text


def add_user_turn(traj: Trajectory, text: str, *, chat: bool) -> None:
    """Append a follow-up from the user: a chat turn, or plain text for raw prompts."""
    if chat:
        traj.add_messages([{"role": "user", "content": text}])
    else:
        traj.add_text(text)


def get_policy(policies: Mapping[str, PolicyHandle], name: str, workflow: str) -> PolicyHandle:
    """The named policy handle, or a ``WorkflowError`` naming what the node hosts."""
    try:
        return policies[name]
    except KeyError:
        hosted = ", ".join(sorted(policies)) or "none"
        raise WorkflowError(
            f"workflow {workflow!r} needs policy {name!r}; this node hosts: {hosted}"
        ) from None


_VERDICT = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_NUMBER = re.compile(r"\d+")


def parse_verdict(text: str) -> bool | None:
    """A judge's verdict: the first 'yes' or 'no' in the reply, else None."""
    match = _VERDICT.search(text)
    return None if match is None else match.group(1).lower() == "yes"


def parse_choice(text: str, n: int) -> int | None:
    """A selector's pick: the first number in the reply, as a 0-based index (None if none
    or out of 1..n)."""
    match = _NUMBER.search(text)
    if match is None:
        return None
    value = int(match.group())
    return value - 1 if 1 <= value <= n else None
