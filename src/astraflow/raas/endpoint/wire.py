"""The OpenAI wire format the agent endpoint speaks: requests it accepts, errors it returns.

Requests are validated here (unknown top-level fields are ignored, as OpenAI clients send
many; a malformed message is a 400 naming it). Errors travel as OpenAI error objects:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "EndpointError",
    "WireMessage",
]

#: Most choices one request may ask for.
MAX_N = 16


class EndpointError(Exception):
    """A request the endpoint refuses, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # the OpenAI field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class WireFunction(_Lenient):
    """``function`` of a tool call."""

    name: str = Field(min_length=1)
    arguments: str = ""


class WireToolCall(_Lenient):
    """One ``tool_calls`` entry of an assistant message."""

    id: str = ""
    type: Literal["function"] = "function"
    function: WireFunction


class WireMessage(_Lenient):
    """One chat message."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[WireToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def to_chat(self) -> dict[str, Any]:
        """The message as a chat template reads it (only the fields that are set)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class _Sampling(_Lenient):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    """A 64-bit signed integer, as OpenAI's (a larger one would fail the engine's batch)."""
    stream: bool = False
    min_tokens: int = Field(default=0, ge=0)
    """vLLM's extension (``extra_body={"min_tokens": N}``): end-of-turn and stop strings are
    ignored until N tokens are generated; capped at the request's token budget."""

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and (len(v) > 4 or not all(v)):
            raise ValueError("stop takes at most 4 non-empty strings")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[WireMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool = False

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(v or []):
            fn = tool.get("function")
            if tool.get("type") != "function" or not isinstance(fn, dict) or not fn.get("name"):
                raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{name}}}}")
        return v

    def token_budget(self) -> int | None:
        """``max_completion_tokens`` (the newer name) or ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    """``POST /v1/completions`` (one prompt: text or token ids)."""

    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False

    def token_budget(self) -> int | None:
        """``max_tokens``."""
        return self.max_tokens
