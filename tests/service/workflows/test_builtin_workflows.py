"""Each built-in workflow end to end with real tiny models; token accounting checked per token."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from astraflow.errors import WorkflowError
from astraflow.records import Sample, SubmitRequest, Task, groups_of, pack, unpack
from astraflow.workflows.multi_policy import RETRY_TEXT
from astraflow.workflows.registry import WORKFLOWS
from astraflow.workflows.tasks import GENERATORS
from fixtures.workflows import TinyPolicy, check_accounting, trained_runs

ADD_PAYLOAD = {"prompt": "2+2=", "answer": "4", "reward": "synthetic_exact"}


def _task(workflow: str, payload: dict[str, Any], group_size: int, task_id: str = "t-1") -> Task:
    return Task(task_id=task_id, workflow=workflow, payload=payload, group_size=group_size)


def _check_wire(samples: list[Sample]) -> None:
    """Samples survive the /v1 msgpack round trip unchanged (what a node submits)."""
    req = SubmitRequest(node_id="n", task_id=samples[0].task_id, attempt=0, secret="ab" * 16,
                        samples=samples)  # fmt: skip
    assert unpack(SubmitRequest, pack(req)) == req


def _decoded(policy: TinyPolicy, sample: Sample, *, mask: int) -> str:
    ids = sample.token_ids[sample.loss_mask == mask]
    return str(policy.tokenizer.decode(ids.tolist(), skip_special_tokens=True))


# --------------------------------------------------------------------------- rlvr


async def test_rlvr_random_model_group_structure() -> None:
    policy = TinyPolicy("policy", seed=1, version=4)
    wf = WORKFLOWS.build({"type": "rlvr", "sampling": {"max_new_tokens": 4}})
    row = next(iter(GENERATORS.build({"type": "add1", "size": 1}).rows()))
    samples = await wf(_task("rlvr", row, 6), {"policy": policy}, {})
    assert len(samples) == 6 and {s.group_id for s in samples} == {"t-1"}
    for s in samples:
        (gen,) = check_accounting(s, policy)
        assert s.versions.max() == 4 and 1 <= s.num_generated <= 4
        assert s.reward == float(gen.text == row["answer"])
        assert s.meta["turns"] == 1 and s.meta["finish_reason"] in ("stop", "length")
        prompt = policy.tokenizer.decode(s.token_ids[s.loss_mask == 0].tolist())
        assert prompt == row["prompt"]
    _check_wire(samples)


async def test_rlvr_scripted_answer_scores_one_and_wrong_scores_zero() -> None:
    policy = TinyPolicy("policy", script=lambda p: ["4", "5", "4 "] if p == "2+2=" else None)
    wf = WORKFLOWS.build({"type": "rlvr", "reward": "synthetic_exact"})
    samples = await wf(_task("rlvr", ADD_PAYLOAD, 3), {"policy": policy}, {})
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0]  # exact: "4 " is wrong
    for s in samples:
        check_accounting(s, policy)
        assert s.token_ids[-1] == policy.tokenizer.eos_token_id  # EOS is trained


async def test_rlvr_math_reward_through_worker_on_gsm_symbolic() -> None:
    row = next(iter(GENERATORS.build({"type": "gsm_symbolic", "size": 1, "seed": 3}).rows()))
    answers = [f"so the total is \\boxed{{{row['answer']}}}", "\\boxed{-1}"]
    policy = TinyPolicy("policy", script=lambda p: answers)
    wf = WORKFLOWS.build({"type": "rlvr", "prompt": {"template": "Q: {prompt}\nA: "}})
    samples = await wf(_task("rlvr", row, 2), {"policy": policy}, {})
    assert [s.reward for s in samples] == [1.0, 0.0]


async def test_rlvr_code_reward_on_humaneval_canonical_solution() -> None:
    row = next(iter(GENERATORS.build({"type": "humaneval", "limit": 1}).rows()))
    body = "\n".join(line for line in row["canonical_solution"].splitlines() if line.strip())
    policy = TinyPolicy("policy", script=lambda p: [body, "    return True"])
    wf = WORKFLOWS.build({"type": "rlvr"})
    samples = await wf(_task("rlvr", row, 2), {"policy": policy}, {})
    assert [s.reward for s in samples] == [1.0, 0.0]


async def test_rlvr_missing_policy_is_a_workflow_error() -> None:
    wf = WORKFLOWS.build({"type": "rlvr", "policy": "actor"})
    with pytest.raises(WorkflowError, match="needs policy 'actor'"):
        await wf(_task("rlvr", ADD_PAYLOAD, 1), {"policy": TinyPolicy("policy")}, {})


# --------------------------------------------------------------------------- tool calling


async def test_tool_calling_scripted_calculator_then_answer() -> None:
    def script(prompt: str) -> str:
        return (
            "<answer>7</answer>" if prompt.endswith("</result>") else "<tool>calculator: 3+4</tool>"
        )

    policy = TinyPolicy("policy", version=2, script=script)
    wf = WORKFLOWS.build({"type": "tool_calling", "reward": "exact_match", "max_turns": 3})
    payload = {"prompt": "What is 3+4?", "answer": "7"}
    samples = await wf(_task("tool_calling", payload, 2), {"policy": policy}, {})
    for s in samples:
        gens = check_accounting(s, policy)
        assert [g.text for g in gens] == ["<tool>calculator: 3+4</tool>", "<answer>7</answer>"]
        assert s.reward == 1.0 and s.meta["tool_calls"] == 1 and s.meta["turns"] == 2
        context = _decoded(policy, s, mask=0)
        assert context.endswith("<result>7</result>")  # tool output is context, not trained
        assert "calculator" in context and "What is 3+4?" in context


async def test_tool_calling_search_tool_finds_the_answer_document() -> None:
    row = next(iter(GENERATORS.build({"type": "search_qa", "size": 1}).rows()))

    def script(prompt: str) -> str:
        if prompt.endswith("</result>"):
            return f"<answer>{row['answer']}</answer>"
        return f"<tool>search: {row['prompt']}</tool>"

    policy = TinyPolicy("policy", script=script)
    wf = WORKFLOWS.build({"type": "tool_calling", "tools": ["search"]})
    samples = await wf(_task("tool_calling", row, 1), {"policy": policy}, {})
    (s,) = samples
    check_accounting(s, policy)
    assert s.reward == 1.0  # qa_f1 from the row
    result = _decoded(policy, s, mask=0).rsplit("<result>", 1)[1]
    assert row["doc_id"] in result and row["answer"] in result


async def test_tool_calling_random_model_stops_at_max_turns() -> None:
    policy = TinyPolicy("policy", seed=2)
    wf = WORKFLOWS.build(
        {
            "type": "tool_calling",
            "reward": "qa_f1",
            "max_turns": 2,
            "sampling": {"max_new_tokens": 12},
        }
    )
    samples = await wf(
        _task("tool_calling", {"prompt": "hi", "answer": "x"}, 3), {"policy": policy}, {}
    )
    assert len(samples) == 3
    for s in samples:
        gens = check_accounting(s, policy)
        assert 1 <= len(gens) <= 2 and s.meta["turns"] == len(gens)
        assert 0.0 <= s.reward <= 1.0


# --------------------------------------------------------------------------- solver + verifier


async def test_solver_verifier_masks_token_by_token_with_retry() -> None:
    solver = TinyPolicy(
        "solver", seed=3, version=5, script=lambda p: "4" if p.endswith(RETRY_TEXT) else "5"
    )
    verifier = TinyPolicy("verifier", seed=4, version=9, script=lambda p: "no")
    wf = WORKFLOWS.build({"type": "solver_verifier"})
    samples = await wf(
        _task("solver_verifier", ADD_PAYLOAD, 2), {"solver": solver, "verifier": verifier}, {}
    )
    groups = groups_of(samples)
    assert set(groups) == {("solver", "t-1"), ("verifier", "t-1")}
    solver_samples, verifier_samples = groups[("solver", "t-1")], groups[("verifier", "t-1")]
    assert len(solver_samples) == 2 and len(verifier_samples) == 4
    for s in solver_samples:
        gens = check_accounting(s, solver)
        assert [g.text for g in gens] == ["5", "4"]  # the retry is a second trained turn
        assert set(s.versions[s.loss_mask == 1].tolist()) == {5}
        assert s.reward == 1.0 and s.meta["retried"] is True
        (_, first_end), (second_start, _) = trained_runs(s.loss_mask)
        between = solver.tokenizer.decode(s.token_ids[first_end:second_start].tolist())
        assert between == RETRY_TEXT  # the rejection is context
    verdict_rewards = sorted(s.reward for s in verifier_samples)
    assert verdict_rewards == [0.0, 0.0, 1.0, 1.0]  # "no" is right for "5", wrong for "4"
    for s in verifier_samples:
        (gen,) = check_accounting(s, verifier)
        assert gen.text == "no" and set(s.versions[s.loss_mask == 1].tolist()) == {9}
        context = _decoded(verifier, s, mask=0)
        answer = re.search(r"Proposed answer: (\d)", context)
        assert answer is not None  # the solver's words reach the verifier only as context
        assert s.reward == float(answer.group(1) == "5")
    _check_wire(samples)


async def test_solver_verifier_random_models_structure() -> None:
    solver, verifier = TinyPolicy("solver", seed=5), TinyPolicy("verifier", seed=6, version=1)
    wf = WORKFLOWS.build(
        {
            "type": "solver_verifier",
            "solver_sampling": {"max_new_tokens": 3},
            "verifier_sampling": {"max_new_tokens": 3},
        }
    )
    samples = await wf(
        _task("solver_verifier", ADD_PAYLOAD, 3), {"solver": solver, "verifier": verifier}, {}
    )
    by_role = {r: [s for s in samples if s.meta["role"] == r] for r in ("solver", "verifier")}
    assert len(by_role["solver"]) == 3 and 3 <= len(by_role["verifier"]) <= 6
    for s in by_role["solver"]:
        check_accounting(s, solver)
    for s in by_role["verifier"]:
        check_accounting(s, verifier)
        assert s.reward in (0.0, 1.0)


async def test_one_policy_in_two_roles_gets_two_groups() -> None:
    both = TinyPolicy("both", script=lambda p: "yes" if "Verdict" in p else "4")
    wf = WORKFLOWS.build({"type": "solver_verifier", "solver": "both", "verifier": "both"})
    samples = await wf(_task("solver_verifier", ADD_PAYLOAD, 2), {"both": both}, {})
    assert wf.policies == ("both",)
    assert {k: len(v) for k, v in groups_of(samples).items()} == {
        ("both", "t-1:solver"): 2,
        ("both", "t-1:verifier"): 2,
    }
    assert all(s.reward == 1.0 for s in samples)


# --------------------------------------------------------------------------- solver + selector


async def test_solver_selector_rewards_a_correct_pick() -> None:
    answers = iter(["5", "4", "3"])
    solver = TinyPolicy("solver", version=1, script=lambda p: next(answers))

    def pick(prompt: str) -> str:
        found = re.search(r"\((\d)\) 4\n", prompt)
        return found.group(1) if found else "1"

    selector = TinyPolicy("selector", seed=7, version=2, script=lambda p: [pick(p), "9", "x"])
    wf = WORKFLOWS.build({"type": "solver_selector", "selector_group_size": 3})
    samples = await wf(
        _task("solver_selector", ADD_PAYLOAD, 3), {"solver": solver, "selector": selector}, {}
    )
    solvers = [s for s in samples if s.policy == "solver"]
    selectors = [s for s in samples if s.policy == "selector"]
    assert sorted(s.reward for s in solvers) == [0.0, 0.0, 1.0]
    assert [s.reward for s in selectors] == [1.0, 0.0, 0.0]  # right pick, out of range, none
    assert selectors[1].meta["choice"] is None and selectors[2].meta["choice"] is None
    for s in solvers:
        check_accounting(s, solver)
    for s in selectors:
        check_accounting(s, selector)
        context = _decoded(selector, s, mask=0)
        assert "(1) " in context and "(3) " in context  # candidates are context only


# --------------------------------------------------------------------------- solver + testgen

ADD_CODE = {
    "prompt": 'def add(a, b):\n    """Return a + b."""\n',
    "entry_point": "add",
    "test": (
        "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
    ),
    "canonical_solution": "    return a + b\n",
}


async def test_solver_testgen_rewards_follow_the_documented_design() -> None:
    solver = TinyPolicy("solver", script=lambda p: ["    return a + b", "    return a - b"])
    tests = [
        "assert add(2, 3) == 5",  # valid and catches a - b
        "assert add(0, 0) == 0",  # valid, catches nothing
        "assert add(1, 1) == 3",  # wrong on the reference
        "x = add(1, 2)",  # no assert
    ]
    testgen = TinyPolicy("testgen", seed=8, version=3, script=lambda p: tests)
    wf = WORKFLOWS.build({"type": "solver_testgen", "testgen_group_size": 4})
    samples = await wf(
        _task("solver_testgen", ADD_CODE, 2), {"solver": solver, "testgen": testgen}, {}
    )
    solver_rewards = [s.reward for s in samples if s.policy == "solver"]
    testgen_rewards = [s.reward for s in samples if s.policy == "testgen"]
    assert solver_rewards == [1.0, 0.0]
    assert testgen_rewards == [1.0, 0.5, 0.0, 0.0]
    for s in samples:
        check_accounting(s, solver if s.policy == "solver" else testgen)
    assert "add" in _decoded(testgen, samples[-1], mask=0)


async def test_testgen_reward_is_validity_only_when_no_solution_fails() -> None:
    solver = TinyPolicy("solver", script=lambda p: "    return b + a")
    tests = ["assert add(2, 3) == 5", "assert True", "assert add(1, 1) == 3"]
    testgen = TinyPolicy("testgen", script=lambda p: tests)
    wf = WORKFLOWS.build({"type": "solver_testgen", "testgen_group_size": 3})
    samples = await wf(
        _task("solver_testgen", ADD_CODE, 2), {"solver": solver, "testgen": testgen}, {}
    )
    assert [s.reward for s in samples] == [1.0, 1.0, 0.5, 0.5, 0.0]


async def test_solver_testgen_random_models_structure() -> None:
    solver, testgen = TinyPolicy("solver", seed=9), TinyPolicy("testgen", seed=10)
    wf = WORKFLOWS.build(
        {
            "type": "solver_testgen",
            "solver_sampling": {"max_new_tokens": 16},
            "testgen_sampling": {"max_new_tokens": 16},
            "sandbox": {"time_limit_s": 2},
        }
    )
    samples = await wf(
        _task("solver_testgen", ADD_CODE, 2), {"solver": solver, "testgen": testgen}, {}
    )
    assert len(samples) == 4
    for s in samples:
        check_accounting(s, solver if s.policy == "solver" else testgen)
        assert s.reward == 0.0  # random characters neither solve nor test anything
    assert np.all([s.num_generated > 0 for s in samples])


async def test_balanced_verifier_groups_hold_both_labels_whatever_the_solver_does() -> None:
    # a verifier that says "yes" to everything must earn exactly 0.5 in every group:
    # right answers and wrong ones are judged in equal numbers
    verifier = TinyPolicy("verifier", script=lambda p: "yes")
    wf = WORKFLOWS.build({"type": "solver_verifier", "retry": False, "verifier_balance": True})
    right = TinyPolicy("solver", script=lambda p: "6" if "3+3" in p else "4")
    policies_right = {"solver": right, "verifier": verifier}
    policies_wrong = {"solver": TinyPolicy("solver", script=lambda p: "5"), "verifier": verifier}
    other = {"prompt": "3+3=", "answer": "6", "reward": "synthetic_exact"}
    # all wrong, first task: the right side comes from the task's reference answer
    samples = await wf(_task("solver_verifier", ADD_PAYLOAD, 4), policies_wrong, {})
    judged = [s for s in samples if s.meta["role"] == "verifier"]
    assert len(judged) == 4 and sorted(s.reward for s in judged) == [0.0, 0.0, 1.0, 1.0]
    # all right: the wrong side comes from answers the solver gave to other tasks ("6", "5")
    samples = await wf(_task("solver_verifier", other, 4, "t-2"), policies_right, {})
    samples = await wf(_task("solver_verifier", ADD_PAYLOAD, 4, "t-3"), policies_right, {})
    judged = [s for s in samples if s.meta["role"] == "verifier"]
    assert sorted(s.reward for s in judged) == [0.0, 0.0, 1.0, 1.0]
    contexts = sorted(_decoded(verifier, s, mask=0) for s in judged)
    assert any("Proposed answer: 6" in c for c in contexts)  # another task's answer, wrong here
    assert [s.reward for s in samples if s.meta["role"] == "solver"] == [1.0] * 4
    # without balance, the same all-right group teaches "yes" for everything
    plain = WORKFLOWS.build({"type": "solver_verifier", "retry": False})
    samples = await plain(_task("solver_verifier", ADD_PAYLOAD, 4), policies_right, {})
    assert [s.reward for s in samples if s.meta["role"] == "verifier"] == [1.0] * 4
