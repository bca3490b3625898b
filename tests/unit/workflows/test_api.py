"""The workflow API: prompt encoding, chat deltas and Trajectory token accounting."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from astraflow.models.tokenizers import build_char_tokenizer
from astraflow.records import Task
from astraflow.workflows.api import (
    PolicyHandle,
    SamplingParams,
    Trajectory,
    chat_delta,
    encode_prompt,
    render_chat,
)
from fixtures.workflows import TinyPolicy

CHATML = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789<>/+= "


def _tok(template: str | None = None) -> Any:
    tok = build_char_tokenizer(ALPHABET)
    if template:
        tok.chat_template = template
    return tok


def test_encode_prompt_accepts_text_messages_and_ids() -> None:
    tok = _tok(CHATML)
    assert encode_prompt(tok, "ab") == tok.encode("ab")
    assert encode_prompt(tok, [5, 6]) == [5, 6]
    assert encode_prompt(tok, np.asarray([5, 6], dtype=np.int32).tolist()) == [5, 6]
    ids = encode_prompt(tok, [{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "<user>hi</s><assistant>"
    with pytest.raises(ValueError, match="a prompt is"):
        encode_prompt(tok, [])


def test_chat_delta_does_not_repeat_the_conversation_start() -> None:
    tok = _tok(CHATML)
    user = [{"role": "user", "content": "more"}]
    assert chat_delta(tok, user, generation_prompt=True) == "<user>more</s><assistant>"
    assert render_chat(tok, user, generation_prompt=False) == "<user>more</s>"


async def test_trajectory_masks_context_and_other_policies() -> None:
    solver = TinyPolicy("solver", version=3)
    judge = TinyPolicy("judge", seed=1, version=5)
    tok = solver.tokenizer
    tok.chat_template = CHATML
    assert isinstance(solver, PolicyHandle)
    sampling = SamplingParams(max_new_tokens=3)
    traj = Trajectory(solver)
    traj.add_messages([{"role": "user", "content": "q"}])
    n_prompt = len(traj.token_ids)
    first = await traj.generate(sampling)
    n_first = len(first.token_ids)
    traj.add_messages([{"role": "user", "content": "again"}])
    n_delta = len(traj.token_ids) - n_prompt - n_first
    (foreign,) = await judge.generate("x", sampling)
    traj.add_generation(foreign)  # another policy's words: context
    solver.version = 4
    second = await traj.generate(sampling)
    sample = traj.to_sample(Task(task_id="t", workflow="rlvr"), reward=1.0)
    mask = sample.loss_mask.tolist()
    n_foreign, n_second = len(foreign.token_ids), len(second.token_ids)
    assert mask == [0] * n_prompt + [1] * n_first + [0] * (n_delta + n_foreign) + [1] * n_second
    assert sample.versions[sample.loss_mask == 1].tolist() == [3] * n_first + [4] * n_second
    trained = np.concatenate([first.logprobs, second.logprobs])
    assert np.array_equal(sample.logprobs[sample.loss_mask == 1], trained)
    assert (sample.logprobs[sample.loss_mask == 0] == 0).all()
    assert sample.behaviour_version == 3 and sample.meta["turns"] == 2
    delta = sample.token_ids[n_prompt + n_first : n_prompt + n_first + n_delta].tolist()
    assert tok.decode(delta) == "<user>again</s><assistant>"
    assert second.prompt_ids.tolist() == sample.token_ids[:-n_second].tolist()


async def test_generate_needs_a_prompt_first() -> None:
    traj = Trajectory(TinyPolicy("p"))
    with pytest.raises(ValueError, match="add a prompt"):
        await traj.generate()
