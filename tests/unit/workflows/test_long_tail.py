"""``long_tail`` (drawn response lengths of real generated tokens, answer-then-filler) and the
``verify`` generator (judging rows for a verifier), over a real engine and tiny model."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from astraflow.errors import ConfigError
from astraflow.records import Task
from astraflow.workflows.registry import WORKFLOWS
from astraflow.workflows.tasks import GENERATORS
from fixtures.models import tiny_spec


@pytest.fixture
async def policy(tmp_path: Path) -> Any:
    from astraflow.models import build_tokenizer
    from astraflow.raas.engines.base import EngineContext, build_engine
    from astraflow.raas.policy import NodePolicy

    spec = tiny_spec()
    tok = build_tokenizer(spec)
    ctx = EngineContext(policy="policy", tokenizer=tok, work_dir=tmp_path, model=spec, seed=2)
    handle = NodePolicy("policy", tok, build_engine({"type": "transformers"}, ctx), frozen=False,
                        from_store=False)  # fmt: skip
    yield handle
    await handle.close()


def _task(task_id: str = "add1/7@e0", group: int = 6) -> Task:
    payload = {"prompt": "3+4=", "answer": "7", "reward": "synthetic_exact"}
    return Task(task_id=task_id, workflow="tail", payload=payload, group_size=group)


def _workflow(**lengths: Any) -> Any:
    spec = {"median": 10, "sigma": 1.0, "min_tokens": 2, "max_tokens": 30, **lengths}
    return WORKFLOWS.build(
        {"type": "long_tail", "lengths": spec,
         "workflow": {"type": "rlvr", "sampling": {"max_new_tokens": 3}}},
        seed=4,
    )  # fmt: skip


async def test_every_sample_is_exactly_its_drawn_length_and_repeats_per_task(policy: Any) -> None:
    wf = _workflow()
    first = await wf(_task(), {"policy": policy}, {})
    lengths = [int(s.loss_mask.sum()) for s in first]
    assert len(first) == 6 and len(set(lengths)) > 1, "each generation its own length"
    assert all(2 <= n <= 30 for n in lengths)
    assert max(lengths) > 3, "far past the wrapped workflow's max_new_tokens"
    assert all(s.meta["finish_reason"] == "length" for s in first), "no EOS before the end"
    again = await wf(_task(), {"policy": policy}, {})
    assert [int(s.loss_mask.sum()) for s in again] == lengths, "same task, same lengths"
    other = await wf(_task("add1/8@e0"), {"policy": policy}, {})
    assert [int(s.loss_mask.sum()) for s in other] != lengths


async def test_the_wrapped_workflow_sees_and_scores_only_the_answer(policy: Any) -> None:
    from astraflow.workflows.length_tail import LengthDistribution, _TailHandle

    tok = policy.tokenizer
    handle = _TailHandle(policy, LengthDistribution(median=12, sigma=0.0), random.Random(0), " ")
    for gen in await handle.generate(tok.encode("3+4="), n=4):
        full = tok.decode(gen.token_ids.tolist(), skip_special_tokens=True)
        assert len(gen.token_ids) == 12 and gen.text == full.split(" ", 1)[0]

    def cut(sample: Any) -> str:
        ids = sample.token_ids[sample.loss_mask == 1].tolist()
        return str(tok.decode(ids, skip_special_tokens=True).split(" ", 1)[0])

    wf = WORKFLOWS.build(
        {"type": "long_tail", "lengths": {"median": 12, "sigma": 0.0},
         "workflow": {"type": "rlvr", "sampling": {"seed": 7}}},
        seed=4,
    )  # fmt: skip
    first = await wf(_task(), {"policy": policy}, {})
    answer = cut(first[0])  # seeded: the same tokens again; make the first answer the right one
    task = _task()
    task = task.model_copy(update={"payload": {**task.payload, "answer": answer}})
    again = await wf(task, {"policy": policy}, {})
    assert [cut(s) for s in again] == [cut(s) for s in first]
    assert again[0].reward == 1.0, "filler after the answer does not count"
    assert [s.reward for s in again] == [float(cut(s) == answer) for s in again]


def test_length_tail_config_problems_are_named() -> None:
    with pytest.raises(Exception, match="min_tokens"):
        _workflow(min_tokens=50, max_tokens=10)
    with pytest.raises(Exception, match="answer_end"):
        WORKFLOWS.build({"type": "long_tail", "answer_end": ""})


def test_verify_rows_judge_a_proposed_answer() -> None:
    spec = {"type": "verify", "task": {"type": "add1", "size": 400}, "label_correct_prob": 0.8}
    rows = list(GENERATORS.build(spec).rows())
    assert len(rows) == 400
    right = 0
    for row in rows:
        question, proposed = row["prompt"][:-1].split("=")
        a, b = question.split("+")
        truth = "yes" if int(proposed) == int(a) + int(b) else "no"
        assert row["prompt"].endswith("?") and row["answer"] == truth
        right += row["completion"] == truth
    assert 0.7 < right / 400 < 0.9, "labels right with label_correct_prob"
    assert 0.4 < sum(r["answer"] == "yes" for r in rows) / 400 < 0.6
    assert rows == list(GENERATORS.build(spec).rows()), "a pure function of the config"
    clean = GENERATORS.build({**spec, "label_correct_prob": 1.0, "template": "{answer}|{question}"})
    first = next(iter(clean.rows()))
    assert first["completion"] == first["answer"] and "|" in first["prompt"]
    with pytest.raises(ConfigError, match="synthetic generator"):
        GENERATORS.build({"type": "verify", "task": {"type": "humaneval"}})
