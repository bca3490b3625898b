"""Task generators: deterministic per seed, correct answers, disjoint held-out sets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from astraflow.errors import ConfigError, PluginError
from astraflow.workflows.corpus import build_corpus
from astraflow.workflows.tasks import GENERATORS, TaskGenerator
from astraflow.workflows.tasks.synthetic import noisy_sft_pairs
from astraflow.workflows.tools import Calculator


def _rows(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(GENERATORS.build(spec).rows())


def test_registry_lists_every_builtin() -> None:
    assert {
        "add1", "arithmetic", "string", "noisy_sft", "reasoning_gym", "gsm_symbolic",
        "humaneval", "search_qa", "hf", "gsm8k",
    } <= set(GENERATORS.names())  # fmt: skip
    assert isinstance(GENERATORS.build("add1"), TaskGenerator)
    with pytest.raises(PluginError, match="unknown key 'digits'"):
        GENERATORS.build({"type": "add1", "digits": 3})


def test_add1_is_the_quickstart_task() -> None:
    rows = _rows({"type": "add1", "size": 300})
    for row in rows:
        a, b = row["prompt"].removesuffix("=").split("+")
        assert len(a) == len(b) == 1 and row["prompt"].endswith("=")
        assert row["answer"] == str(int(a) + int(b))
        assert row["reward"] == "synthetic_exact" and row["difficulty"] == 1
    assert len({r["id"] for r in rows}) == 300
    assert len({r["prompt"] for r in rows}) > 80  # covers most of the 100 prompts


def test_generators_are_deterministic_per_seed() -> None:
    for spec in (
        {"type": "arithmetic", "size": 50, "max_digits": 3, "operators": "+-*", "max_operands": 3},
        {"type": "string", "size": 50},
        {"type": "gsm_symbolic", "size": 5},
    ):
        assert _rows({**spec, "seed": 1}) == _rows({**spec, "seed": 1})
        assert _rows({**spec, "seed": 1}) != _rows({**spec, "seed": 2})
    # the injected plug-in rng does not change content: a restarted service regenerates rows
    assert list(GENERATORS.build("add1", seed=1).rows()) == list(
        GENERATORS.build("add1", seed=2).rows()
    )


def test_arithmetic_answers_and_difficulty() -> None:
    rows = _rows(
        {"type": "arithmetic", "size": 200, "max_digits": 3, "operators": "+-*", "max_operands": 4}
    )
    calculator = Calculator()  # an independent evaluator (syntax tree, Python precedence)
    for row in rows:
        assert row["answer"] == calculator.evaluate(row["prompt"].removesuffix("="))
    easy = _rows({"type": "arithmetic", "size": 50, "max_digits": 1})
    hard = _rows(
        {"type": "arithmetic", "size": 50, "min_digits": 3, "max_digits": 3, "max_operands": 3}
    )
    assert max(r["difficulty"] for r in easy) < min(r["difficulty"] for r in hard)


def test_string_tasks_answers() -> None:
    for row in _rows({"type": "string", "size": 100, "letters": "abc"}):
        body = row["prompt"].removesuffix("=")
        if row["op"] == "reverse":
            assert row["answer"] == body.split(" ")[1][::-1]
        elif row["op"] == "sort":
            assert row["answer"] == "".join(sorted(body.split(" ")[1]))
        else:
            _, letter, _, word = body.split(" ")
            assert row["answer"] == str(word.count(letter))


@pytest.mark.parametrize("spec", [{"type": "arithmetic", "max_digits": 2}, {"type": "string"}])
def test_held_out_split_is_disjoint_by_content(spec: dict[str, Any]) -> None:
    train = _rows({**spec, "size": 400, "holdout": 0.2})
    held = _rows({**spec, "size": 100, "holdout": 0.2, "split": "eval"})
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in held})
    assert {r["id"] for r in train}.isdisjoint({r["id"] for r in held})


def test_add1_eval_split_by_seed_stream_and_tiny_space_error() -> None:
    train, held = (
        _rows({"type": "add1", "size": 50}),
        _rows({"type": "add1", "size": 50, "split": "eval"}),
    )
    assert {r["id"] for r in train}.isdisjoint({r["id"] for r in held})
    assert [r["prompt"] for r in train] != [r["prompt"] for r in held]
    with pytest.raises(ConfigError, match="too small"):
        _rows({"type": "add1", "size": 5, "split": "eval", "holdout": 0.000001})


def test_noisy_sft_pairs_are_correct_with_the_given_probability() -> None:
    gen = GENERATORS.build({"type": "add1", "size": 3000})
    pairs = list(noisy_sft_pairs(gen, 0.3, seed=0))
    assert pairs == list(noisy_sft_pairs(gen, 0.3, seed=0))
    wrong = [p for p in pairs if not p["correct"]]
    assert {int(p["completion"]) for p in wrong} <= set(range(19))
    assert len({p["completion"] for p in wrong}) == 19  # uniform over 0..18
    rate = sum(p["correct"] for p in pairs) / len(pairs)
    assert 0.30 < rate < 0.37  # 0.3 + 0.7 / 19 ≈ 0.337 expected
    assert all(p["correct"] == (p["completion"] == p["answer"]) for p in pairs)
    via_registry = _rows({"type": "noisy_sft", "task": {"type": "add1", "size": 20}})
    assert [p["completion"] for p in via_registry] == [p["completion"] for p in pairs[:20]]
    with pytest.raises(ConfigError, match="synthetic generator"):
        GENERATORS.build({"type": "noisy_sft", "task": {"type": "humaneval"}})


def test_reasoning_gym_rows_and_disjoint_eval_ids() -> None:
    train = _rows({"type": "gsm_symbolic", "size": 4})
    held = _rows({"type": "gsm_symbolic", "size": 4, "split": "eval"})
    assert {r["id"] for r in train}.isdisjoint({r["id"] for r in held})
    assert [r["prompt"] for r in train] != [r["prompt"] for r in held]
    for row in train:
        assert row["reward"] == "math" and row["answer"] and row["prompt"]
        json.dumps(row)  # rows travel as JSON task payloads
    chain = _rows({"type": "reasoning_gym", "dataset": "chain_sum", "size": 3})
    assert chain[0]["reward"] == "reasoning_gym" and chain[0]["dataset"] == "chain_sum"
    with pytest.raises(ConfigError, match="no_such_set"):
        _rows({"type": "reasoning_gym", "dataset": "no_such_set", "size": 1})


def test_humaneval_rows() -> None:
    rows = _rows({"type": "humaneval"})
    assert len(rows) == 164 and rows[0]["id"] == "HumanEval/0" and rows[-1]["id"] == "HumanEval/163"
    assert {"prompt", "entry_point", "test", "canonical_solution"} <= set(rows[0])
    assert [r["id"] for r in _rows({"type": "humaneval", "start": 10, "limit": 2})] == [
        "HumanEval/10",
        "HumanEval/11",
    ]


def test_search_qa_rows_are_answered_by_their_document() -> None:
    corpus = build_corpus(0, 200)
    docs = {d.doc_id: d for d in corpus.documents}
    train, held = _rows({"type": "search_qa"}), _rows({"type": "search_qa", "split": "eval"})
    assert len(train) + len(held) == len(corpus.questions) == 1000
    assert {r["doc_id"] for r in train}.isdisjoint({r["doc_id"] for r in held})
    for row in train[:50]:
        assert row["answer"] in docs[row["doc_id"]].text
    assert build_corpus(1, 50).documents != build_corpus(0, 50).documents


def test_hf_source_loads_local_data_and_fails_clearly_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "gsm.jsonl"
    data.write_text(
        "\n".join(json.dumps({"question": f"q{i}", "answer": f"work\n#### {i}"}) for i in range(3))
    )
    local = {"type": "hf", "path": "json", "data_files": str(data), "cache_dir": str(tmp_path)}
    rows = _rows({**local, "answer_after": "####"})
    assert [r["answer"] for r in rows] == ["0", "1", "2"] and rows[0]["reward"] == "math"
    with pytest.raises(ConfigError, match="no column 'problem'"):
        _rows({**local, "prompt_field": "problem"})
    # offline (as every test must be): a hub dataset fails at once with a clear error
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="offline mode is on.*needs the network"):
        _rows({"type": "gsm8k", "limit": 1})


def test_generators_and_workflows_do_not_import_torch() -> None:
    code = (
        "import sys\nfrom astraflow.workflows.tasks import GENERATORS\n"
        "for name in ('add1', 'string', 'search_qa'):\n"
        "    list(GENERATORS.build(name).rows())\n"
        "from astraflow.workflows.registry import WORKFLOWS\n"
        "for name in WORKFLOWS.names():\n"
        "    WORKFLOWS.build(name)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_search_agent_sft_demos_draw_their_own_answers() -> None:
    spec = {
        "type": "search_agent_sft",
        "questions": {"corpus_size": 20, "split": "train"},
        "search": {"k": 1, "size": 20},
    }
    one = _rows(spec)
    assert [r["id"].rsplit("-", 1)[1] for r in one[:2]] == ["call", "answer"]
    many = _rows({**spec, "demos": 4})
    assert len(many) == 4 * len(one)
    # every demonstration is an episode: the call, then an answer after the same snippet
    for first, again in zip(many[0::8], many[2::8], strict=True):
        assert first["completion"] == again["completion"] and first["correct"]
    answers: dict[str, set[str]] = {}
    for row in many[1::2]:
        answers.setdefault(row["prompt"], set()).add(row["completion"])
        assert row["correct"] or row["completion"] in row["prompt"].rsplit("tool: ", 1)[1]
    assert len(answers) == len(one) // 2
    # several answers per question: nothing to memorise as the one reply to a question
    assert sum(len(a) > 1 for a in answers.values()) > len(answers) // 3
    # the first draw per question is the single-demonstration answer
    assert [r["completion"] for r in many[1::8]] == [r["completion"] for r in one[1::2]]
