"""``solver_testgen``: a solver writes code, a test generator writes tests, the sandbox judges.

For a HumanEval-style task (``prompt``, ``entry_point``, ``test``, ``canonical_solution``):

    solver:  group_size programs ──► reference tests in the sandbox ──► pass / fail
    testgen: testgen_group_size test sets (assert statements) ──► run on the reference solution
             ──► valid? ──► run on every *failing* solver program ──► which ones they catch

Rewards (each in [0, 1]):
- solver: 1 if its program passes the task's reference tests, else 0.
- testgen: 0 if its tests have no ``assert``, do not parse, or fail on the reference solution
  (a wrong test); otherwise 0.5 for being valid plus 0.5 × the fraction of the group's
  failing solver programs its tests reject (0.5 when no solver program failed: there is
  nothing to tell strong tests from trivial ones). Tests that find real bugs earn the most;
  tests that reject correct code earn nothing, so neither "assert False" nor "assert True"
  pays.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping, Sequence

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.records import Sample, Task
from astraflow.workflows.api import (
    Generation,
    PolicyHandle,
    Prompt,
    SamplingParams,
    Tool,
    Trajectory,
    encode_prompt,
)
from astraflow.workflows.code import (
    count_asserts,
    extract_code,
    reference_program,
    solution_program,
    with_reference_tests,
)
from astraflow.workflows.multi_policy import role_policies, role_sample
from astraflow.workflows.prompts import build_prompt, fill
from astraflow.workflows.registry import WORKFLOWS, PolicyName, PromptConfig
from astraflow.workflows.sandbox import Sandbox, SandboxConfig

__all__ = ["SolverTestgen"]

TESTGEN_TEMPLATE = (
    "Write Python assert statements that test the function {entry_point} below. "
    "Reply with code only.\n{prompt}\n"
)


class SolverTestgenConfig(ConfigModel):
    """Config of ``solver_testgen``."""

    solver: PolicyName = "solver"
    """Policy that writes the solution."""
    testgen: PolicyName = "testgen"
    """Policy that writes tests."""
    solver_sampling: SamplingParams = Field(
        default_factory=lambda: SamplingParams(max_new_tokens=384)
    )
    """Sampling of solutions."""
    testgen_sampling: SamplingParams = Field(
        default_factory=lambda: SamplingParams(max_new_tokens=256)
    )
    """Sampling of test sets."""
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    """The solver's prompt (by default the task's ``prompt``: signature and docstring)."""
    testgen_template: str = TESTGEN_TEMPLATE
    """The test generator's prompt; fields: any payload field ({prompt}, {entry_point})."""
    testgen_chat: bool = False
    """Send the test generator's prompt as a chat user message."""
    testgen_group_size: int | None = Field(default=None, ge=1)
    """Test sets per task; unset: the task's group_size."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Limits of every sandboxed run."""


@WORKFLOWS.register("solver_testgen")
class SolverTestgen:
    """Code solutions and unit tests, each policy rewarded by running them in the sandbox."""

    Config = SolverTestgenConfig

    def __init__(self, config: SolverTestgenConfig, rng: random.Random) -> None:
        self.config = config
        self.sandbox = Sandbox(config.sandbox)

    @property
    def policies(self) -> Sequence[str]:
        """Solver and test generator (distinct names)."""
        return tuple(dict.fromkeys((self.config.solver, self.config.testgen)))

    async def __call__(
        self, task: Task, policies: Mapping[str, PolicyHandle], tools: Mapping[str, Tool]
    ) -> list[Sample]:
        """Generate solutions and tests, judge both in the sandbox, return both groups."""
        cfg = self.config
        (solver, testgen), groups = role_policies(
            task, policies, {"solver": cfg.solver, "testgen": cfg.testgen}, "solver_testgen"
        )
        solver_prompt = build_prompt(
            task.payload,
            template=cfg.prompt.template,
            system=cfg.prompt.system,
            chat=cfg.prompt.chat,
        )
        test_text = fill(cfg.testgen_template, task.payload)
        test_prompt: Prompt = (
            [{"role": "user", "content": test_text}] if cfg.testgen_chat else test_text
        )
        started = time.monotonic()
        (s_ids, solutions), (t_ids, testsets) = await asyncio.gather(
            self._generate(solver, solver_prompt, cfg.solver_sampling, task.group_size),
            self._generate(
                testgen,
                test_prompt,
                cfg.testgen_sampling,
                cfg.testgen_group_size or task.group_size,
            ),
        )
        programs = [solution_program(task.payload, g.text) for g in solutions]
        solver_rewards, testgen_rewards = await self._judge(
            task, programs, [g.text for g in testsets]
        )
        samples = [
            _sample(task, solver, s_ids, g, r, groups, "solver", started)
            for g, r in zip(solutions, solver_rewards, strict=True)
        ]
        samples += [
            _sample(task, testgen, t_ids, g, r, groups, "testgen", started)
            for g, r in zip(testsets, testgen_rewards, strict=True)
        ]
        return samples

    async def _generate(
        self, policy: PolicyHandle, prompt: Prompt, sampling: SamplingParams, n: int
    ) -> tuple[list[int], list[Generation]]:
        ids = encode_prompt(policy.tokenizer, prompt)
        return ids, await policy.generate(ids, sampling, n=n)

    async def _passes(self, program: str) -> bool:
        return (await self.sandbox.run(program)).passed

    async def _judge(
        self, task: Task, programs: list[str], answers: list[str]
    ) -> tuple[list[float], list[float]]:
        payload = task.payload
        reference = reference_program(payload)
        tests = [extract_code(a) for a in answers]
        solved, valid = await asyncio.gather(
            asyncio.gather(*(self._passes(with_reference_tests(payload, p)) for p in programs)),
            asyncio.gather(*(self._valid(reference, t) for t in tests)),
        )
        failing = [p for p, ok in zip(programs, solved, strict=True) if not ok]
        checked = [t for t, ok in zip(tests, valid, strict=True) if ok and failing]
        outcomes = await asyncio.gather(
            *(self._passes(f"{p}\n\n{t}\n") for t in checked for p in failing)
        )
        caught = iter(outcomes)
        testgen_rewards = []
        for ok in valid:
            if not ok:
                testgen_rewards.append(0.0)
            elif not failing:
                testgen_rewards.append(0.5)
            else:
                rejected = sum(not next(caught) for _ in failing)
                testgen_rewards.append(0.5 + 0.5 * rejected / len(failing))
        return [float(ok) for ok in solved], testgen_rewards

    async def _valid(self, reference: str, test: str) -> bool:
        if count_asserts(test) <= 0:
            return False
        return await self._passes(f"{reference}\n\n{test}\n")


def _sample(
    task: Task,
    policy: PolicyHandle,
    prompt_ids: list[int],
    gen: Generation,
    reward: float,
    groups: Mapping[str, str],
    role: str,
    started: float,
) -> Sample:
    traj = Trajectory(policy, started=started)
    traj.add_tokens(prompt_ids)
    traj.add_generation(gen)
    return role_sample(traj, task, reward, groups, role)
