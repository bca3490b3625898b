"""Rewards: text matching, math through its worker process, code, registry resolution."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from astraflow.errors import PluginError, RewardError, ValidationError
from astraflow.workflows.mathcheck import MathVerifyPool, as_gold
from astraflow.workflows.rewards import (
    REWARDS,
    RewardResolver,
    extract_tagged,
    normalize_answer,
    token_f1,
)


async def test_synthetic_exact_is_exact() -> None:
    reward = REWARDS.build("synthetic_exact")
    payload = {"answer": "7"}
    assert await reward("7", payload) == 1.0
    assert await reward("7 ", payload) == 0.0
    assert await reward("77", payload) == 0.0
    assert await reward("", payload) == 0.0
    lenient = REWARDS.build({"type": "synthetic_exact", "strip": True})
    assert await lenient(" 7\n", payload) == 1.0


def test_squad_normalisation_and_f1() -> None:
    assert normalize_answer("The  Quick, brown FOX!") == "quick brown fox"
    assert token_f1("the brown fox", "quick brown fox") == pytest.approx(0.8)
    assert token_f1("Mara Quell", "mara quell") == 1.0
    assert token_f1("nothing", "else") == 0.0
    assert token_f1("", "") == 1.0 and token_f1("a", "x") == 0.0  # "a" normalises to nothing


async def test_exact_match_and_f1_use_answer_tags_and_aliases() -> None:
    em, f1 = REWARDS.build("exact_match"), REWARDS.build("qa_f1")
    payload = {"answer": "Varnholt", "aliases": ["the city of Varnholt"]}
    assert await em("I think <answer>varnholt.</answer>", payload) == 1.0
    assert await em("City of Varnholt", payload) == 1.0  # via the alias
    assert await em("Varn", payload) == 0.0
    assert await f1("<answer>Varnholt city</answer>", {"answer": "Varnholt"}) == pytest.approx(
        2 / 3
    )
    assert extract_tagged("<answer>a</answer> then <answer> b </answer>", "answer") == "b"
    assert extract_tagged("no tags", "answer") == "no tags"


async def test_missing_answer_is_a_validation_error() -> None:
    with pytest.raises(ValidationError, match="answer"):
        await REWARDS.build("exact_match")("x", {})


def test_math_verify_in_worker_process_with_timeout() -> None:
    # under a second: less than a worker's start (python, math-verify, sympy: ~1 s here, more
    # under load), which must not count against the first check
    pool = MathVerifyPool(workers=1, timeout_s=0.5)
    try:
        assert pool.verify_sync(as_gold("288"), "so the answer is \\boxed{288}")
        assert pool.verify_sync(as_gold("1/2"), "\\boxed{0.5}")
        assert not pool.verify_sync(as_gold("288"), "\\boxed{289}")
        with pytest.raises(TimeoutError):
            pool.verify_sync(as_gold("5"), "\\boxed{9^{9^{9^{9}}}}")  # sympy would run for ages
        assert pool.timeouts == 1
        assert pool.verify_sync(as_gold("4"), "4")  # a fresh worker took over, its start free
        assert pool.timeouts == 1
    finally:
        pool.close()
    with pytest.raises(RewardError, match="closed"):
        pool.verify_sync("$1$", "1")


async def test_math_reward_scores_timeouts_zero() -> None:
    reward = REWARDS.build({"type": "math", "timeout_s": 1.0})
    assert await reward("\\boxed{42}", {"answer": 42}) == 1.0
    assert await reward("\\boxed{9^{9^{9^{9}}}}", {"answer": "5"}) == 0.0


def test_the_shared_math_pool_stops_its_workers_when_the_process_exits() -> None:
    """A process that used the shared pool exits without leaving its worker running or its
    pipes open (Python's development mode reports both as ``ResourceWarning``)."""
    program = (
        "from astraflow.workflows.mathcheck import shared_pool\n"
        "print(shared_pool().verify_sync('$2$', '2'), flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-c", program],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
    assert "ResourceWarning" not in done.stderr, done.stderr


def test_as_gold_wraps_plain_answers_only() -> None:
    assert as_gold("72") == "$72$"
    assert as_gold("\\boxed{(1,2)}") == "\\boxed{(1,2)}"
    assert as_gold("$x$") == "$x$"


async def test_code_tests_reward_runs_in_sandbox() -> None:
    reward = REWARDS.build({"type": "code_tests", "sandbox": {"time_limit_s": 2}})
    payload = {
        "prompt": "def inc(x):\n",
        "entry_point": "inc",
        "test": "def check(candidate):\n    assert candidate(1) == 2\n",
    }
    assert await reward("    return x + 1\n", payload) == 1.0
    assert await reward("```python\ndef inc(x):\n    return x + 1\n```", payload) == 1.0
    assert await reward("    return x\n", payload) == 0.0
    assert await reward("    while True:\n        pass\n", payload) == 0.0
    with pytest.raises(ValidationError, match="entry_point"):
        await reward("x", {"prompt": "p", "test": "t"})


async def test_reasoning_gym_reward_uses_the_datasets_scorer() -> None:
    from astraflow.workflows.tasks import GENERATORS

    row = next(
        iter(GENERATORS.build({"type": "reasoning_gym", "dataset": "chain_sum", "size": 1}).rows())
    )
    reward = REWARDS.build("reasoning_gym")
    assert await reward(row["answer"], row) == 1.0
    assert await reward(f"<answer>{row['answer']}</answer>", row) == 1.0
    assert await reward("nonsense", row) == 0.0


async def test_resolver_uses_the_task_reward_and_names_problems() -> None:
    resolver = RewardResolver(None)
    assert await resolver.score("3", {"answer": "3", "reward": "synthetic_exact"}) == 1.0
    with pytest.raises(ValidationError, match="no 'reward' field"):
        await resolver.score("3", {"answer": "3"})
    with pytest.raises(ValidationError, match="unknown reward"):
        await resolver.score("3", {"answer": "3", "reward": "nope"})
    fixed = RewardResolver("qa_f1")
    assert await fixed.score("x y", {"answer": "x", "reward": "synthetic_exact"}) == pytest.approx(
        2 / 3
    )
    assert await fixed.score_all(["x", "z"], {"answer": "x"}) == [1.0, 0.0]


async def test_resolver_turns_reward_bugs_into_reward_errors() -> None:
    class Broken:
        async def __call__(self, response: str, payload: object) -> float:
            raise KeyError("boom")

    class NotFinite:
        async def __call__(self, response: str, payload: object) -> float:
            return math.nan

    for bad, match in ((Broken(), "failed"), (NotFinite(), "nan")):
        resolver = RewardResolver(None)
        resolver._by_name["bad"] = bad
        with pytest.raises(RewardError, match=match):
            await resolver.score("x", {"reward": "bad"})


def test_unknown_reward_arguments_are_named() -> None:
    with pytest.raises(PluginError, match="unknown key 'colour'"):
        REWARDS.build({"type": "math", "colour": "red"})
    assert {
        "synthetic_exact",
        "exact_match",
        "qa_f1",
        "math",
        "code_tests",
        "reasoning_gym",
    } <= set(REWARDS.names())
