"""A ReAct-style search agent written with the ``openai`` package only (no astraflow imports).

It is what a user writes: ask the model, run the tool calls it makes (keeping, as search
snippets do, the sentence of the best document that shares the most words with the
question), send the whole conversation back, stop at the first reply without a tool call
and score it against the reference answer (token F1). ``examples/openai_agent.yaml`` trains
it with the ``agent`` workflow: ``entry: astraflow.examples.openai_search_agent:run``.

    user question ─► model ─► <tool_call> search(query) ─► snippet ─► model ─► answer
"""

from __future__ import annotations

import json
import string
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the document collection.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]
"""The tools offered to the model (OpenAI function-calling format)."""


def first_messages(question: str) -> list[dict[str, Any]]:
    """The conversation the agent opens with."""
    return [{"role": "user", "content": question}]


_STOP = {"a", "an", "the", "in", "of", "is", "was", "which", "who", "what", "city", "main"}


def snippet(result: str, question: str, query: str) -> str:
    """The sentence of the search result sharing the most words with the question (words
    of the query aside: every sentence of the right document names the city)."""
    body = result.split("\n")[0].split(": ", 1)[-1]
    sentences = [s.strip() + "." for s in body.split(".") if s.strip()]
    if not sentences:
        return result
    asked = set(normalize(question)) - set(normalize(query)) - _STOP
    return max(sentences, key=lambda s: len(asked & set(normalize(s))))


def normalize(text: str) -> list[str]:
    """Lower-cased words without punctuation or articles."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return [w for w in text.split() if w not in {"a", "an", "the"}]


def f1(prediction: str, reference: str) -> float:
    """Token F1 between a prediction and the reference answer."""
    pred, ref = normalize(prediction), normalize(reference)
    common = sum((Counter(pred) & Counter(ref)).values())
    if not pred or not ref or common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


async def run(
    task: Mapping[str, Any],
    client: Any,
    model: str = "policy",
    tools: Mapping[str, Callable[[str], Awaitable[str]]] | None = None,
    max_turns: int = 3,
    max_tokens: int = 96,
    temperature: float = 1.0,
) -> dict[str, float]:
    """Answer ``task['prompt']`` with the search tool; reward: F1 against ``task['answer']``."""
    search = (tools or {}).get("search")
    messages = first_messages(str(task["prompt"]))
    answer, calls = "", 0
    for _ in range(max_turns):
        reply = await client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            max_tokens=max_tokens,
            temperature=temperature,
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = message.content or ""
            break
        for call in message.tool_calls:
            calls += 1
            try:
                query = str(json.loads(call.function.arguments).get("query", ""))
            except (ValueError, AttributeError):
                query = ""
            result = await search(query) if search is not None and query else "no results"
            observation = snippet(result, str(task["prompt"]), query)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": observation})
    reference = str(task["answer"])
    exact = float(normalize(answer) == normalize(reference))
    return {"reward": f1(answer, reference), "exact": exact, "tool_calls": float(calls)}
