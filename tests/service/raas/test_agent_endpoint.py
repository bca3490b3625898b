"""The node's OpenAI-compatible endpoint with unmodified ``openai`` SDK agents (loopback HTTP).

An SDK agent doing 4 turns with tool calls is trained on exactly the tokens and logprobs the
policy produced, with context tokens equal to the chat template's rendering; a template that
is not append-only yields segments; 64 concurrent agents do not see each other's tokens; bad
requests get OpenAI-style 4xx errors.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from typing import Any

import httpx
import numpy as np
import pytest

from astraflow.errors import WorkflowError
from astraflow.raas.endpoint import AgentEndpoint
from astraflow.workflows.agent import AgentConfig, AgentSession
from astraflow.workflows.chat_format import ChatFormat
from fixtures import agents
from fixtures.workflows import (
    TinyPolicy,
    agent_task,
    agent_workflow,
    check_accounting,
    record_generations,
)

pytest.importorskip("openai")

CALL = '<tool_call>{"name": "search", "arguments": {"query": "q%d"}}</tool_call>'


def _tool_script(prompt: str) -> str | None:
    turn = prompt.count("assistant: ")
    return CALL % turn if turn < 4 else "42"


@pytest.mark.parametrize("transport", ["in_process", "loopback"])
async def test_sdk_agent_with_tool_calls_is_trained_on_exact_tokens(
    endpoint: AgentEndpoint, transport: str
) -> None:
    policy = TinyPolicy("policy", script=_tool_script)
    wf = agent_workflow(endpoint, "fixtures.agents:tool_agent", transport=transport)
    task = agent_task(f"t-tools-{transport}", prompt="where is x?", answer="42")
    samples = await wf(task, {"policy": policy}, {})
    assert len(samples) == 1, "an append-only template keeps the episode in one stream"
    sample = samples[0]
    assert sample.reward == 1.0
    assert sample.meta["turns"] == 4 and sample.meta["template_breaks"] == 0
    matched = check_accounting(sample, policy)  # every trained run: a generation, bit for bit
    assert matched == policy.generations and len(matched) == 4
    # context tokens are the chat template's rendering of what the agent sent
    last_request = agents.TRANSCRIPTS[f"t-tools-{transport}/"][-1]
    rendered = ChatFormat(policy.tokenizer).render(last_request, agents.TOOLS)
    context = policy.tokenizer.encode(rendered, add_special_tokens=False)
    last = matched[-1]
    assert sample.token_ids.tolist() == context + last.token_ids.tolist()
    tool_texts = [m["content"] for m in last_request if m["role"] == "tool"]
    assert tool_texts == ["found 1q", "found 2q", "found 3q"]
    # every episode's SDK client went through the node's one shared HTTP client
    shared = endpoint.http_client(transport)  # type: ignore[arg-type]
    assert endpoint.http_client(transport) is shared and not shared.is_closed  # type: ignore[arg-type]
    await endpoint.stop()
    assert shared.is_closed, "the endpoint closes its shared clients when it stops"


async def test_node_engine_tokens_and_logprobs_are_captured_bit_for_bit(
    endpoint: AgentEndpoint, node_policy: Any
) -> None:
    produced = record_generations(node_policy)
    wf = agent_workflow(endpoint, "fixtures.agents:chat_agent")
    task = agent_task("t-engine", prompt="1+2=", turns=4, max_tokens=5)
    (sample,) = await wf(task, {"policy": node_policy}, {})
    assert sample.meta["turns"] == 4 and sample.meta["agent.turns"] == 4.0
    runs = [(i, g) for i, g in enumerate(produced)]
    assert len(runs) == 4
    trained = np.flatnonzero(sample.loss_mask)
    got = np.concatenate([g.token_ids for g in produced])
    assert np.array_equal(sample.token_ids[trained], got)
    assert np.array_equal(sample.logprobs[trained], np.concatenate([g.logprobs for g in produced]))
    for gen in produced:  # each call's prompt is the stream so far, reused, never re-encoded
        start = len(gen.prompt_ids)
        assert np.array_equal(sample.token_ids[:start], gen.prompt_ids)
        assert np.array_equal(sample.token_ids[start : start + len(gen.token_ids)], gen.token_ids)
        assert (sample.versions[start : start + len(gen.token_ids)] == gen.version).all()


async def test_not_append_only_template_yields_segments(endpoint: AgentEndpoint) -> None:
    policy = TinyPolicy("policy", script=lambda p: "<think>hmm</think>ok")
    wf = agent_workflow(endpoint, "fixtures.agents:chat_agent")
    # a template that drops reasoning from history (as Qwen3's does): not append-only
    drop = (
        "{% for m in messages %}{{ m['role'] }}: "
        "{{ m['content'].split('</think>')[-1] if m['role'] == 'assistant' else m['content'] }}"
        "{% if m['role'] == 'assistant' %}<eos>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    policy.tokenizer.chat_template = drop
    task = agent_task("t-segments", prompt="hi", turns=3, max_tokens=20)
    samples = await wf(task, {"policy": policy}, {})
    assert len(samples) == 3
    assert [s.meta["segment"] for s in samples] == [0, 1, 2]
    assert all(s.meta["segments"] == 3 and s.meta["template_breaks"] == 2 for s in samples)
    assert len({s.group_id for s in samples}) == 1
    for sample in samples:
        assert len(check_accounting(sample, policy)) == 1
    totals = endpoint.metrics()  # reported by the node with its stats
    assert totals["template_breaks"] == 2 and totals["segments"] == 3


async def test_64_concurrent_agents_see_only_their_own_tokens(
    endpoint: AgentEndpoint, node_policy: Any
) -> None:
    wf = agent_workflow(endpoint, "fixtures.agents:chat_agent")
    tasks = [agent_task(f"c{i}", prompt=f"ep{i}", turns=2, max_tokens=4) for i in range(64)]
    results = await asyncio.gather(*(wf(t, {"policy": node_policy}, {}) for t in tasks))
    assert node_policy.engine.metrics()["mean_batch_size"] > 4, "calls are batched together"
    fmt = ChatFormat(node_policy.tokenizer)
    tok = node_policy.tokenizer
    for task, samples in zip(tasks, results, strict=True):
        (sample,) = samples
        assert sample.task_id == task.task_id and sample.meta["turns"] == 2
        # the stream is this episode's own conversation: its prompt, then its own replies
        first, last = agents.TRANSCRIPTS[f"{task.task_id}/"]
        assert first == [{"role": "user", "content": task.payload["prompt"]}]
        head = tok.encode(fmt.render(first), add_special_tokens=False)
        assert sample.token_ids[: len(head)].tolist() == head
        end = int(np.flatnonzero(sample.loss_mask)[-1]) + 1
        trained_start = int(np.flatnonzero(sample.loss_mask == 1)[0])
        assert trained_start == len(head)
        assert end == len(sample.token_ids)
        text = tok.decode(sample.token_ids.tolist())
        assert text.count(f"user: {task.payload['prompt']}") == 2
        runs = np.flatnonzero(np.diff(np.r_[0, sample.loss_mask]) == 1)
        before_last = tok.decode(sample.token_ids[: runs[-1]].tolist())
        assert before_last == fmt.render(last), "context = the template's rendering"


async def test_min_tokens_holds_off_the_end_of_turn(
    endpoint: AgentEndpoint, node_policy: Any
) -> None:
    import openai

    cfg = AgentConfig(entry="fixtures.agents:chat_agent", max_tokens_limit=64)
    fmt = ChatFormat(node_policy.tokenizer)
    session = endpoint.open(AgentSession("", {"policy": node_policy}, {"policy": fmt}, cfg))
    client = openai.AsyncOpenAI(
        base_url=session.base_url,
        api_key=session.api_key,
        max_retries=0,
        http_client=endpoint.http_client("in_process"),
    )
    hi = [{"role": "user", "content": "1+2="}]
    plain = await client.chat.completions.create(model="policy", messages=hi, max_tokens=24, seed=7)
    text = plain.choices[0].message.content
    assert text and plain.usage is not None and plain.usage.completion_tokens == 24
    # a stop string met at the first token ends the turn there (seeded: the same draws) ...
    stop = text[0]
    ended = await client.chat.completions.create(
        model="policy", messages=hi, max_tokens=24, seed=7, stop=[stop]
    )
    assert ended.usage is not None and ended.usage.completion_tokens == 1
    # ... unless min_tokens holds it off: the same 24 tokens as without the stop string
    held = await client.chat.completions.create(
        model="policy",
        messages=hi,
        max_tokens=24,
        seed=7,
        stop=[stop],
        extra_body={"min_tokens": 24},
    )
    assert held.usage is not None and held.usage.completion_tokens == 24
    assert held.choices[0].message.content == text
    # capped at the budget, never an error; a negative one is refused before anything runs
    capped = await client.chat.completions.create(
        model="policy", messages=hi, max_tokens=5, extra_body={"min_tokens": 50}
    )
    assert capped.usage is not None and capped.usage.completion_tokens == 5
    calls = session.recorder.calls
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(
            model="policy", messages=hi, max_tokens=5, extra_body={"min_tokens": -1}
        )
    assert bad.value.param == "min_tokens"
    assert session.recorder.calls == calls
    endpoint.close(session)
    await client.close()


async def test_agent_given_a_bare_base_url(endpoint: AgentEndpoint) -> None:
    policy = TinyPolicy("policy", script=lambda p: "hello")
    wf = agent_workflow(endpoint, "fixtures.agents:url_agent", client="base_url")
    (sample,) = await wf(agent_task("t-url", prompt="hi"), {"policy": policy}, {})
    assert sample.reward == 1.0 and len(check_accounting(sample, policy)) == 1


async def test_agent_that_raises_fails_the_task(endpoint: AgentEndpoint) -> None:
    wf = agent_workflow(endpoint, "fixtures.agents:failing_agent")
    with pytest.raises(WorkflowError, match="crashed"):
        await wf(agent_task("t-fail"), {"policy": TinyPolicy("policy")}, {})
    assert endpoint.metrics()["sessions"] == 0


@pytest.mark.parametrize("transport", ["in_process", "loopback"])
async def test_bad_requests_get_openai_errors(endpoint: AgentEndpoint, transport: str) -> None:
    import openai

    policy = TinyPolicy("policy")
    cfg = AgentConfig(entry="fixtures.agents:chat_agent", max_tokens_limit=64)
    session = endpoint.open(
        AgentSession("", {"policy": policy}, {"policy": ChatFormat(policy.tokenizer)}, cfg)
    )
    # in process: the shared client the agent workflow gives its agents; loopback: an agent's
    # own SDK client over HTTP
    http = endpoint.http_client("in_process") if transport == "in_process" else None
    client = openai.AsyncOpenAI(
        base_url=session.base_url, api_key=session.api_key, max_retries=0, http_client=http
    )
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as nf:
        await client.chat.completions.create(model="judge", messages=hi, max_tokens=2)
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as big:
        await client.chat.completions.create(model="policy", messages=hi, max_tokens=10_000)
    assert big.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(
            model="policy", messages=[{"role": "wizard", "content": "x"}], max_tokens=2
        )
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": [{"type": "image_url"}]}]
        )
    root_url = session.base_url.split("/e/")[0] + "/v1"
    bad = openai.AsyncOpenAI(base_url=root_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # a key that names no episode
        await bad.models.list()
    await bad.close()
    models = await client.models.list()
    assert [m.id for m in models.data] == ["policy"]
    root = session.base_url.split("/e/")[0] + "/v1"  # the key in a header instead of the URL
    async with httpx.AsyncClient(base_url=root) as raw:
        auth = {"Authorization": f"Bearer {session.api_key}"}
        r = await raw.get("/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await raw.get("/models", headers=auth)
        assert r.status_code == 200
        for body in (
            b"{not json",
            b'{"model": "policy", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # nesting
            # a lone UTF-16 surrogate: valid JSON to json.loads, no text to a tokenizer
            b'{"model": "policy", "messages": [{"role": "user", "content": "\\ud800"}]}',
        ):
            r = await raw.post("/chat/completions", content=body, headers=auth)
            assert r.status_code == 400, (body[:60], r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
        r = await raw.post("/chat/completions", json={"model": "policy"}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # nothing of the refused requests was recorded
    assert session.recorder.calls == 0
    reply = await client.chat.completions.create(model="policy", messages=hi, max_tokens=3)
    assert reply.usage is not None and reply.usage.completion_tokens == len(
        policy.generations[0].token_ids
    )
    endpoint.close(session)
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(model="policy", messages=hi, max_tokens=2)
    await client.close()


async def test_hostile_sampling_fields_fail_only_their_own_request(
    endpoint: AgentEndpoint, node_policy: Any
) -> None:
    """On the real engine: a seed past 64 bits is a 400 naming ``seed``; a temperature so
    small that the tempered logits overflow float32 is sampled greedily; neither fails the
    engine batch that a well-formed request from another episode shares with it."""
    cfg = AgentConfig(entry="fixtures.agents:chat_agent", max_tokens_limit=64)
    fmt = {"policy": ChatFormat(node_policy.tokenizer)}
    hostile = endpoint.open(AgentSession("", {"policy": node_policy}, fmt, cfg))
    honest = endpoint.open(AgentSession("", {"policy": node_policy}, fmt, cfg))
    root = hostile.base_url.split("/e/")[0] + "/v1"

    def call(session: AgentSession, **fields: Any) -> Any:
        body = {"model": "policy", "messages": [{"role": "user", "content": "1+2="}],
                "max_tokens": 4, **fields}  # fmt: skip
        auth = {"Authorization": f"Bearer {session.api_key}"}
        return raw.post("/chat/completions", json=body, headers=auth)

    async with httpx.AsyncClient(base_url=root, timeout=60) as raw:
        greedy = await call(honest, temperature=0)
        assert greedy.status_code == 200, greedy.text
        replies = await asyncio.gather(
            call(hostile, seed=2**64),
            call(hostile, temperature=1e-40),
            *(call(honest, temperature=1.0, seed=s) for s in range(4)),
        )
    too_big, tiny = replies[:2]
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "seed"
    assert tiny.status_code == 200, tiny.text
    text = tiny.json()["choices"][0]["message"]["content"]
    assert text == greedy.json()["choices"][0]["message"]["content"]
    assert all(r.status_code == 200 for r in replies[2:]), [r.text for r in replies[2:]]
    endpoint.close(hostile)
    endpoint.close(honest)


async def test_an_oversize_body_is_refused_before_it_is_read(endpoint: AgentEndpoint) -> None:
    """A 413 by ``Content-Length`` alone, and one for a chunked body once it passes the cap:
    the node never holds more than the cap of a client's body."""
    from astraflow.raas.endpoint.app import MAX_BODY_BYTES

    policy = TinyPolicy("policy")
    cfg = AgentConfig(entry="fixtures.agents:chat_agent")
    session = endpoint.open(
        AgentSession("", {"policy": policy}, {"policy": ChatFormat(policy.tokenizer)}, cfg)
    )
    root = session.base_url.split("/e/")[0] + "/v1"
    auth = {"Authorization": f"Bearer {session.api_key}"}
    sent = 0

    async def chunks() -> Any:  # four times the cap
        nonlocal sent
        for _ in range(4 * MAX_BODY_BYTES // (1 << 20)):
            sent += 1 << 20
            yield b" " * (1 << 20)

    # headers only: the answer must come without the server waiting for the body
    host, port = endpoint.host, int(root.split(":")[2].split("/")[0])
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {session.api_key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n{{".encode()
    )
    await writer.drain()
    status = await asyncio.wait_for(reader.readline(), 30)
    assert status.split()[1] == b"413", status
    writer.close()
    # chunked (no length): read only up to the cap, however much more the client sends
    tracemalloc.start()
    try:
        async with httpx.AsyncClient(base_url=root, timeout=60) as raw:
            r = await raw.post("/chat/completions", content=chunks(), headers=auth)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert r.status_code == 413, r.text
    assert sent == 4 * MAX_BODY_BYTES
    assert peak < 2 * MAX_BODY_BYTES, f"{peak} bytes held for a body capped at {MAX_BODY_BYTES}"
    assert session.recorder.calls == 0
    endpoint.close(session)
