"""Chat rendering and tool-call parsing for OpenAI-style messages, per model family.

``ChatFormat`` turns a conversation (OpenAI chat messages, optional ``tools``) into the text a
policy reads, and a policy's generated text back into ``content`` + ``tool_calls``:

    messages, tools ─► render ─► text ─► tokens          (HF chat template, or SIMPLE)
    generated text  ─► parse  ─► content, tool_calls      (hermes: <tool_call>{json}</tool_call>)

A tokenizer with a real chat template renders with ``apply_chat_template``. Tokenizers with
none, or only the role-less template of the shipped char tokenizer, use the SIMPLE template:
one ``role: content`` line per message, an assistant turn closed by the EOS token, tool calls
written exactly as the hermes parser reads them, so a canonical reply renders back to the very
text the model generated (the template is append-only).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from astraflow.models.tokenizers import ROLELESS_CHAT_TEMPLATE as _CHAR_TEMPLATE

__all__ = [
    "ChatFormat",
    "ParsedReply",
    "ToolCallOut",
    "content_text",
    "parse_hermes",
    "render_simple",
]

TemplateKind = Literal["auto", "hf", "simple"]

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCallOut:
    """One parsed tool call, as an OpenAI ``tool_calls`` entry carries it."""

    id: str
    name: str
    arguments: str
    """JSON text of the arguments object (canonical ``json.dumps`` spacing)."""

    def to_openai(self) -> dict[str, Any]:
        """The ``tool_calls`` entry of a chat completion message."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedReply:
    """A generation split into what the agent reads: content and tool calls."""

    content: str | None
    tool_calls: tuple[ToolCallOut, ...] = ()
    malformed: int = 0
    """``<tool_call>`` blocks that were not valid calls (kept in ``content`` as text)."""


def content_text(content: Any) -> str:
    """The text of a message's ``content``: a string, None, or a list of text parts.

    Raises ``ValueError`` for anything else (images, audio: not served here).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ValueError("only text content parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError("a text content part needs a string 'text'")
            parts.append(text)
        return "".join(parts)
    raise ValueError("content must be a string, null or a list of text parts")


def _call_block(name: str, arguments: str) -> str:
    """The canonical hermes block for one call (``arguments``: JSON text of an object)."""
    return (
        '<tool_call>{"name": ' + json.dumps(name) + ', "arguments": ' + arguments + "}</tool_call>"
    )


def _arguments_text(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments)


def render_simple(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    eos: str,
    *,
    generation_prompt: bool,
) -> str:
    """The SIMPLE template: ``role: text`` lines; assistant turns end with ``eos``.

    ``tools: a, b`` heads the conversation when tools are offered (names only: tiny models
    learn the call format from demonstrations, not from schemas).
    """
    out = []
    if tools:
        names = [str(t.get("function", {}).get("name", "")) for t in tools]
        out.append("tools: " + ", ".join(names) + "\n")
    for message in messages:
        role = str(message.get("role", ""))
        text = content_text(message.get("content"))
        if role == "assistant":
            calls = message.get("tool_calls") or []
            for call in calls:
                fn = call.get("function", {})
                text += _call_block(str(fn.get("name", "")), _arguments_text(fn.get("arguments")))
            out.append(f"assistant: {text}{eos}\n")
        else:
            out.append(f"{role}: {text}\n")
    if generation_prompt:
        out.append("assistant: ")
    return "".join(out)


def parse_hermes(text: str) -> ParsedReply:
    """Split ``text`` into content and ``<tool_call>{"name", "arguments"}</tool_call>`` calls.

    A block that is not a JSON object with a string ``name`` and an object (or JSON-object
    string) ``arguments`` stays in the content as text and counts as malformed.
    """
    calls: list[ToolCallOut] = []
    kept: list[str] = []
    malformed = 0
    last = 0
    for match in _HERMES.finditer(text):
        call = _hermes_call(match.group(1))
        if call is None:
            malformed += 1
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return ParsedReply(content or None, tuple(calls), malformed)


def _hermes_call(body: str) -> ToolCallOut | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCallOut(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(args))


_PARSERS = {"hermes": parse_hermes}


class ChatFormat:
    """How one policy's tokenizer renders chats and how its replies are parsed."""

    def __init__(
        self, tokenizer: Any, *, template: TemplateKind = "auto", tool_parser: str = "hermes"
    ) -> None:
        if tool_parser not in _PARSERS:
            raise ValueError(f"unknown tool parser {tool_parser!r}; known: {sorted(_PARSERS)}")
        own = getattr(tokenizer, "chat_template", None)
        has_real = isinstance(own, str) and own.strip() != "" and own != _CHAR_TEMPLATE
        if template == "hf" and not has_real:
            raise ValueError("the tokenizer has no chat template of its own")
        self.tokenizer = tokenizer
        self.kind: Literal["hf", "simple"] = (
            "hf" if template == "hf" or (template == "auto" and has_real) else "simple"
        )
        self._parse = _PARSERS[tool_parser]

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        generation_prompt: bool = True,
    ) -> str:
        """The text of ``messages`` (and ``tools``) as the policy reads it."""
        if self.kind == "simple":
            eos = str(self.tokenizer.eos_token or "")
            return render_simple(messages, tools, eos, generation_prompt=generation_prompt)
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation_prompt}
        if tools:
            kwargs["tools"] = [dict(t) for t in tools]
        text = self.tokenizer.apply_chat_template([dict(m) for m in messages], **kwargs)
        if not isinstance(text, str):
            raise TypeError(f"chat template returned {type(text).__name__}, expected text")
        return text

    def parse(self, text: str) -> ParsedReply:
        """Content and tool calls of a generated text (special tokens already removed)."""
        return self._parse(text)
