"""The endpoint's rules, no HTTP: a validated request of a session → recorded generations.

    chat request ─► model → policy handle (404) ─► budget (400) ─► render (template)
        ─► recorder.prepare (continue a stream or open a segment) ─► handle.generate
        ─► parse tool calls ─► recorder.commit ─► chat.completion

Generation goes through the session's ``PolicyHandle`` (the node's ``NodePolicy``), so
endpoint calls are batched by the engine with every other request on the node.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from astraflow.errors import ServiceUnavailableError, ValidationError
from astraflow.raas.endpoint.wire import ChatRequest, CompletionRequest, EndpointError
from astraflow.workflows.agent import AgentSession
from astraflow.workflows.api import Generation, PolicyHandle, SamplingParams
from astraflow.workflows.capture import Prepared, normalize_messages
from astraflow.workflows.chat_format import ParsedReply

__all__ = ["chat_completion", "list_models", "text_completion"]


def list_models(session: AgentSession) -> dict[str, Any]:
    """``GET /v1/models``: the policies this session may call."""
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "astraflow"}
            for name in session.policies
        ],
    }


def _handle(session: AgentSession, model: str) -> PolicyHandle:
    handle = session.policies.get(model)
    if handle is None:
        hosted = ", ".join(sorted(session.policies))
        raise EndpointError(
            404,
            f"The model {model!r} does not exist on this endpoint (models: {hosted})",
            param="model",
            code="model_not_found",
        )
    return handle


def _budget(session: AgentSession, asked: int | None, param: str) -> int:
    limit = session.config.max_tokens_limit
    if asked is not None and asked > limit:
        raise EndpointError(
            400, f"{param} is {asked}, above this endpoint's limit of {limit}", param=param
        )
    return asked if asked is not None else min(session.config.max_tokens, limit)


def _sampling(req: ChatRequest | CompletionRequest, budget: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=budget,
        min_new_tokens=min(req.min_tokens, budget),
        temperature=req.temperature,
        top_p=req.top_p,
        stop=req.stop_strings(),
        seed=req.seed,
    )


async def _generate(
    handle: PolicyHandle, prepared: Prepared, sampling: SamplingParams, n: int
) -> list[Generation]:
    try:
        return await handle.generate(prepared.prompt_ids, sampling, n=n)
    except ValidationError as exc:
        raise EndpointError(
            400, str(exc), param="messages", code="context_length_exceeded"
        ) from exc
    except ServiceUnavailableError as exc:
        raise EndpointError(503, str(exc), type="server_error", code="unavailable") from exc


def _strip_stop(text: str, stops: Sequence[str]) -> str:
    for stop in stops:
        if stop and text.endswith(stop):
            return text[: -len(stop)]
    return text


def _decoder(handle: PolicyHandle) -> Any:
    """Token ids -> text with special tokens kept (the Rust tokenizer itself when there is
    one: the same text without the Python wrapper's cost)."""
    tok = handle.tokenizer
    backend = getattr(tok, "backend_tokenizer", None) if getattr(tok, "is_fast", False) else None
    if backend is not None:
        return lambda ids: str(backend.decode(ids, skip_special_tokens=False))

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    return decode


def _reply_text(
    handle: PolicyHandle, gen: Generation, stops: Sequence[str], decode: Any = None
) -> str:
    """The generated text the agent reads: special tokens kept (so the text renders back to
    the same tokens), the final end-of-turn token and a final stop string removed."""
    ids = gen.token_ids.tolist()
    tok = handle.tokenizer
    if ids and gen.finish_reason == "stop" and ids[-1] in tok.all_special_ids:
        ids = ids[:-1]
    return _strip_stop((decode or _decoder(handle))(ids), stops)


def _finish(gen: Generation, reply: ParsedReply) -> str:
    if reply.tool_calls:
        return "tool_calls"
    return "length" if gen.finish_reason == "length" else "stop"


def _logprobs(handle: PolicyHandle, gen: Generation) -> dict[str, Any]:
    tok = handle.tokenizer
    content = []
    for tid, lp in zip(gen.token_ids.tolist(), gen.logprobs.tolist(), strict=True):
        piece = str(tok.decode([tid], skip_special_tokens=False))
        content.append(
            {"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}
        )
    return {"content": content}


def _reply(
    prefix: str,
    kind: str,
    model: str,
    prepared: Prepared,
    gens: Sequence[Generation],
    choices: list[dict[str, Any]],
) -> dict[str, Any]:
    """An OpenAI completion object: id, kind, model, version fingerprint, choices, usage."""
    done = sum(int(g.token_ids.shape[0]) for g in gens)
    prompt = len(prepared.prompt_ids)
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": f"{model}@v{min(g.version for g in gens)}",
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": done,
            "total_tokens": prompt + done,
        },
    }


async def chat_completion(session: AgentSession, req: ChatRequest) -> dict[str, Any]:
    """``POST /v1/chat/completions`` for ``session``: generate, record, reply."""
    handle = _handle(session, req.model)
    budget = _budget(session, req.token_budget(), "max_tokens")
    fmt = session.formats[req.model]
    messages = [m.to_chat() for m in req.messages]
    try:
        text = fmt.render(messages, req.tools)
        normal = normalize_messages(messages)
    except Exception as exc:  # a template or content error is the request's fault
        raise EndpointError(400, f"cannot render messages: {exc}", param="messages") from exc
    recorder = session.recorder
    prepared = recorder.prepare(req.model, handle.tokenizer, text=text, messages=normal)
    gens = await _generate(handle, prepared, _sampling(req, budget), req.n)
    parse = req.tools and req.tool_choice != "none"
    stops = req.stop_strings()
    decode = _decoder(handle)
    replies: list[ParsedReply] = []
    for gen in gens:
        body = _reply_text(handle, gen, stops, decode)
        replies.append(fmt.parse(body) if parse else ParsedReply(body or None))
    recorder.commit(prepared, gens, [normalize_messages([_message(r)])[0] for r in replies], decode)
    choices = []
    for i, (gen, reply) in enumerate(zip(gens, replies, strict=True)):
        choice: dict[str, Any] = {
            "index": i,
            "message": _message(reply),
            "finish_reason": _finish(gen, reply),
            "logprobs": _logprobs(handle, gen) if req.logprobs else None,
        }
        choices.append(choice)
    return _reply("chatcmpl", "chat.completion", req.model, prepared, gens, choices)


def _message(reply: ParsedReply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in reply.tool_calls]
    return message


async def text_completion(session: AgentSession, req: CompletionRequest) -> dict[str, Any]:
    """``POST /v1/completions`` for ``session``: one prompt, text or token ids."""
    handle = _handle(session, req.model)
    budget = _budget(session, req.token_budget(), "max_tokens")
    if req.echo:
        raise EndpointError(400, "echo is not supported", param="echo")
    recorder = session.recorder
    if isinstance(req.prompt, str):
        prepared = recorder.prepare(req.model, handle.tokenizer, text=req.prompt)
    else:
        vocab = len(handle.tokenizer)
        if any(t < 0 or t >= vocab for t in req.prompt):
            raise EndpointError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        prepared = recorder.prepare(req.model, handle.tokenizer, ids=req.prompt)
    gens = await _generate(handle, prepared, _sampling(req, budget), req.n)
    decode = _decoder(handle)
    recorder.commit(prepared, gens, [None] * len(gens), decode)
    stops = req.stop_strings()
    choices = [
        {
            "index": i,
            "text": _reply_text(handle, gen, stops, decode),
            "finish_reason": "length" if gen.finish_reason == "length" else "stop",
            "logprobs": None,
        }
        for i, gen in enumerate(gens)
    ]
    return _reply("cmpl", "text_completion", req.model, prepared, gens, choices)
