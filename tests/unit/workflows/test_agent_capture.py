"""Token capture and chat formats of the agent endpoint, without HTTP."""

from __future__ import annotations

import json

import numpy as np
import pytest

from astraflow.errors import WorkflowError
from astraflow.records import Task
from astraflow.workflows.agent import reward_of
from astraflow.workflows.api import Generation
from astraflow.workflows.capture import EpisodeRecorder, normalize_messages
from astraflow.workflows.chat_format import ChatFormat, parse_hermes
from fixtures.workflows import TinyPolicy


def _gen(tok: object, text: str, *, version: int = 3, eos: bool = True) -> Generation:
    ids = tok.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    if eos:
        ids = [*ids, tok.eos_token_id]  # type: ignore[attr-defined]
    n = len(ids)
    return Generation(
        policy="policy",
        version=version,
        prompt_ids=np.zeros(1, dtype=np.int32),
        token_ids=np.asarray(ids, dtype=np.int32),
        logprobs=-np.arange(1, n + 1, dtype=np.float32) / 7,
        text=text,
        finish_reason="stop",
    )


def test_hermes_parser_reads_calls_and_keeps_malformed_ones_as_text() -> None:
    good = parse_hermes('look <tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>')
    assert good.content == "look" and good.malformed == 0
    (call,) = good.tool_calls
    assert call.name == "search" and json.loads(call.arguments) == {"q": "x"}
    as_string = parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert json.loads(as_string.tool_calls[0].arguments) == {"a": 1}
    bad_calls = (
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        "<tool_call>{",
    )
    for bad in bad_calls:
        parsed = parse_hermes(bad)
        assert parsed.tool_calls == () and parsed.content == bad


def test_simple_template_renders_a_canonical_reply_back_to_the_generated_text() -> None:
    policy = TinyPolicy("policy")
    fmt = ChatFormat(policy.tokenizer)
    assert fmt.kind == "simple"
    call = '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
    parsed = fmt.parse(call)
    reply = {"role": "assistant", "content": parsed.content,
             "tool_calls": [c.to_openai() for c in parsed.tool_calls]}  # fmt: skip
    first = fmt.render([{"role": "user", "content": "q"}])
    again = fmt.render([{"role": "user", "content": "q"}, reply], generation_prompt=False)
    assert again == first + call + "<eos>\n"


def test_recorder_continues_streams_and_forks_choices() -> None:
    tok = TinyPolicy("policy").tokenizer
    fmt = ChatFormat(tok)
    rec = EpisodeRecorder()
    msgs = [{"role": "user", "content": "hi"}]
    p1 = rec.prepare("policy", tok, text=fmt.render(msgs), messages=normalize_messages(msgs))
    g1, g2 = _gen(tok, "one"), _gen(tok, "two")
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    replies = normalize_messages([{"role": "assistant", "content": t} for t in ("one", "two")])
    rec.commit(p1, [g1, g2], replies, decode)  # n = 2: two branches
    assert rec.segments == 2
    msgs2 = [*msgs, {"role": "assistant", "content": "two"}, {"role": "user", "content": "ok"}]
    p2 = rec.prepare("policy", tok, text=fmt.render(msgs2), messages=normalize_messages(msgs2))
    assert p2.continued and p2.prompt_ids[: len(p1.prompt_ids)] == p1.prompt_ids
    g3 = _gen(tok, "three", version=4)
    rec.commit(p2, [g3], normalize_messages([{"role": "assistant", "content": "three"}]), decode)
    task = Task(task_id="t", workflow="agent")
    samples = rec.samples(task, 0.5, group_id="t")
    assert [s.meta["turns"] for s in samples] == [1, 2] and rec.template_breaks == 0
    second = samples[1]
    assert second.token_ids.tolist() == p2.prompt_ids + g3.token_ids.tolist()
    trained = second.loss_mask == 1
    assert np.array_equal(second.logprobs[trained], np.r_[g2.logprobs, g3.logprobs])
    assert sorted(set(second.versions[trained].tolist())) == [3, 4]


def test_recorder_continues_token_id_prompts() -> None:
    tok = TinyPolicy("policy").tokenizer
    rec = EpisodeRecorder()
    p1 = rec.prepare("policy", tok, ids=[5, 6, 7])
    g = _gen(tok, "ab")
    rec.commit(p1, [g], [None], lambda ids: "")
    p2 = rec.prepare("policy", tok, ids=[5, 6, 7, *g.token_ids.tolist(), 9])
    assert p2.continued and p2.prompt_ids[-1] == 9
    p3 = rec.prepare("policy", tok, ids=[5, 9])
    assert not p3.continued


@pytest.mark.parametrize("bad", [None, "x", float("nan"), {"score": 1.0}, True])
def test_agent_results_must_carry_a_finite_reward(bad: object) -> None:
    with pytest.raises(WorkflowError):
        reward_of(bad)
    assert reward_of({"reward": 1, "calls": 2, "note": "x"}) == (1.0, {"calls": 2.0})
