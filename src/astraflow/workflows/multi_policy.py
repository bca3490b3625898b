"""Two-policy workflows: ``solver_verifier`` and ``solver_selector``.

Each policy gets its own group (``group_id = task_id``, or ``task_id:role`` when one policy
plays both roles) and is trained only on tokens it generated: the other policy's words reach
it as re-tokenized text in its prompt (mask 0).

solver_verifier (per task, ``group_size`` solver attempts):

    solver answers ──► verifier judges (yes/no) ──yes──► done
                               │ no (or no verdict), retry on
                               ▼
                       solver retries once in the same trajectory ──► verifier judges again
    solver reward   = reward(final answer)                     (correct: reward >= threshold)
    verifier reward = 1 if its verdict agrees with the answer's true correctness, else 0
    verifier_balance: the verifier's group is instead ``group_size`` judgements, half of
    right answers and half of wrong ones (the group's answers first; when it has none of a
    kind, the task's reference answer, or answers the solver gave to other tasks), so a
    verdict that ignores the answer earns exactly 0.5 in every group. Without it the
    majority label wins (wrong while the solver is weak, right once it is good) and the
    verifier learns to answer one label for everything.

solver_selector:

    solver: group_size candidates ──► selector sees them numbered, picks one (selector_group
    samples) ──► selector reward = 1 if its pick is correct; solver reward = own correctness
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.records import Sample, Task
from astraflow.workflows.api import PolicyHandle, SamplingParams, Tool, Trajectory, encode_prompt
from astraflow.workflows.prompts import (
    add_user_turn,
    build_prompt,
    fill,
    get_policy,
    parse_choice,
    parse_verdict,
    question_text,
)
from astraflow.workflows.registry import WORKFLOWS, PolicyName, PromptConfig, RewardField
from astraflow.workflows.rewards import RewardResolver, ScoredWorkflow

__all__ = [
    "SolverSelector",
    "SolverVerifier",
    "role_group_ids",
    "role_policies",
    "role_sample",
]

VERIFIER_TEMPLATE = (
    "Question: {question}\nProposed answer: {answer}\n"
    "Is the proposed answer correct? Reply yes or no.\nVerdict: "
)
SELECTOR_TEMPLATE = (
    "Question: {question}\nCandidate answers:\n{candidates}\n"
    "Which candidate is correct? Reply with its number.\nChoice: "
)
RETRY_TEXT = "\nA verifier judged this answer wrong. Try again.\n"


class _TwoRoleConfig(ConfigModel):
    solver: PolicyName = "solver"
    """Policy that answers the task."""
    solver_sampling: SamplingParams = Field(default_factory=SamplingParams)
    """Sampling of solver answers."""
    reward: RewardField = None
    """Reward of solver answers (name or spec); unset: each task's ``payload['reward']``."""
    correct_threshold: float = Field(default=1.0, ge=0.0)
    """A solver answer counts as correct when its reward is at least this."""
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    """The solver's prompt."""
    judge_chat: bool = False
    """Send the judging prompt as a chat user message (for chat models)."""
    max_answer_chars: int = Field(default=2000, ge=1)
    """Solver answers longer than this are cut before another policy reads them."""


def role_group_ids(task: Task, roles: Mapping[str, str]) -> dict[str, str]:
    """Role → group id: the task id, suffixed by role when two roles share a policy."""
    shared = len(set(roles.values())) < len(roles)
    return {role: f"{task.task_id}:{role}" if shared else task.task_id for role in roles}


def role_policies(
    task: Task, policies: Mapping[str, PolicyHandle], names: Mapping[str, str], workflow: str
) -> tuple[list[PolicyHandle], dict[str, str]]:
    """Each role's handle (``names``: role → the policy the config gives it), in order, and
    each role's group id."""
    handles = [get_policy(policies, name, workflow) for name in names.values()]
    return handles, role_group_ids(
        task, {role: h.name for role, h in zip(names, handles, strict=True)}
    )


def role_sample(
    traj: Trajectory,
    task: Task,
    reward: float,
    groups: Mapping[str, str],
    role: str,
    **meta: Any,
) -> Sample:
    """The sample of ``traj`` in ``role``'s group, its meta led by the role."""
    return traj.to_sample(task, reward, group_id=groups[role], meta={"role": role, **meta})


@dataclass
class _Attempt:
    traj: Trajectory
    answer: str
    reward: float
    retried: bool = False


class _TwoRole:
    workflow: str
    """Registry name (in error messages)."""
    roles: tuple[str, str]
    """The two roles, each named by the config field of the same name."""
    config: Any

    async def __call__(
        self, task: Task, policies: Mapping[str, PolicyHandle], tools: Mapping[str, Tool]
    ) -> list[Sample]:
        """Both roles' policies and group ids, then :meth:`_play`."""
        names = {role: getattr(self.config, role) for role in self.roles}
        (solver, other), groups = role_policies(task, policies, names, self.workflow)
        return await self._play(task, solver, other, groups)

    async def _play(
        self, task: Task, solver: PolicyHandle, other: PolicyHandle, groups: dict[str, str]
    ) -> list[Sample]:
        raise NotImplementedError

    def _judge_prompt(self, template: str, **values: str) -> Any:
        text = fill(template, values)
        if self.config.judge_chat:
            return [{"role": "user", "content": text}]
        return text

    async def _solve(self, task: Task, solver: PolicyHandle, rewards: RewardResolver) -> _Attempt:
        cfg = self.config
        traj = Trajectory(solver, started=time.monotonic())
        traj.add_prompt(
            build_prompt(
                task.payload,
                template=cfg.prompt.template,
                system=cfg.prompt.system,
                chat=cfg.prompt.chat,
            )
        )
        gen = await traj.generate(cfg.solver_sampling)
        return _Attempt(traj, gen.text, await rewards.score(gen.text, task.payload))

    def _correct(self, reward: float) -> bool:
        return bool(reward >= self.config.correct_threshold)

    @property
    def policies(self) -> Sequence[str]:
        """Both policies (distinct names)."""
        return tuple(dict.fromkeys(getattr(self.config, role) for role in self.roles))


class SolverVerifierConfig(_TwoRoleConfig):
    """Config of ``solver_verifier``."""

    verifier: PolicyName = "verifier"
    """Policy that judges solver answers."""
    verifier_sampling: SamplingParams = Field(
        default_factory=lambda: SamplingParams(max_new_tokens=8)
    )
    """Sampling of verdicts."""
    verifier_template: str = VERIFIER_TEMPLATE
    """Judging prompt; fields: {question}, {answer}."""
    retry: bool = True
    """Let the solver retry once after a rejection (same trajectory, multi-turn)."""
    retry_text: str = RETRY_TEXT
    """What the solver is told after a rejection (context)."""
    judge_retry: bool = True
    """Have the verifier judge the retried answer too (another verifier sample)."""
    verifier_balance: bool = False
    """Train the verifier on a balanced group: half right answers, half wrong (the group's,
    else the task's reference ``answer`` / answers given to other tasks)."""
    balance_memory: int = Field(default=256, ge=1)
    """Recent solver answers (of other tasks) kept as candidate wrong answers."""


@WORKFLOWS.register("solver_verifier")
class SolverVerifier(_TwoRole, ScoredWorkflow[SolverVerifierConfig]):
    """A solver answers, a verifier judges; the solver may retry once after a rejection."""

    Config = SolverVerifierConfig
    workflow = "solver_verifier"
    roles = ("solver", "verifier")

    def __init__(self, config: SolverVerifierConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        self._recent: deque[str] = deque(maxlen=config.balance_memory)

    async def _play(
        self, task: Task, solver: PolicyHandle, verifier: PolicyHandle, groups: dict[str, str]
    ) -> list[Sample]:
        """``group_size`` solver episodes, each judged (and maybe retried) concurrently."""
        episodes = await asyncio.gather(
            *(self._episode(task, solver, verifier) for _ in range(task.group_size))
        )
        judged = [j for _, judgements in episodes for j in judgements]
        if self.config.verifier_balance:
            judged = await self._balance(task, verifier, [a for a, _ in episodes])
            self._recent.extend(a.answer for a, _ in episodes)
        samples = [
            role_sample(a.traj, task, a.reward, groups, "solver", retried=a.retried)
            for a, _ in episodes
        ]
        samples += [
            role_sample(traj, task, reward, groups, "verifier", verdict=verdict)
            for traj, reward, verdict in judged
        ]
        return samples

    async def _judge(
        self, task: Task, verifier: PolicyHandle, answer: str, correct: bool
    ) -> tuple[Trajectory, float, str]:
        cfg = self.config
        traj = Trajectory(verifier, started=time.monotonic())
        question = question_text(task.payload)
        traj.add_prompt(
            self._judge_prompt(
                cfg.verifier_template, question=question, answer=answer[: cfg.max_answer_chars]
            )
        )
        gen = await traj.generate(cfg.verifier_sampling)
        verdict = parse_verdict(gen.text)
        reward = float(verdict is not None and verdict == correct)
        label = "none" if verdict is None else ("yes" if verdict else "no")
        return traj, reward, label

    async def _balance(
        self, task: Task, verifier: PolicyHandle, attempts: Sequence[_Attempt]
    ) -> list[tuple[Trajectory, float, str]]:
        """``group_size`` judgements, half of right answers and half of wrong ones."""
        right = [a.answer for a in attempts if self._correct(a.reward)]
        wrong = [a.answer for a in attempts if not self._correct(a.reward)]
        if not right and "answer" in task.payload:
            right = await self._scored(task, [str(task.payload["answer"])], correct=True)
        if not wrong:
            others = list(dict.fromkeys(reversed(self._recent)))[: 4 * task.group_size]
            wrong = await self._scored(task, others, correct=False)
        n_right = task.group_size // 2 + (task.group_size % 2 if len(right) > len(wrong) else 0)
        if not right or not wrong:  # only one kind to show: as many as the group has
            n_right = task.group_size if right else 0
        picks = [(a, True) for a in itertools.islice(itertools.cycle(right), n_right)]
        picks += [
            (a, False) for a in itertools.islice(itertools.cycle(wrong), task.group_size - n_right)
        ]
        return list(await asyncio.gather(*(self._judge(task, verifier, a, ok) for a, ok in picks)))

    async def _scored(self, task: Task, answers: list[str], correct: bool) -> list[str]:
        """The ``answers`` whose true correctness on ``task`` is ``correct``."""
        scores = await asyncio.gather(*(self.rewards.score(a, task.payload) for a in answers))
        return [a for a, r in zip(answers, scores, strict=True) if self._correct(r) == correct]

    async def _episode(
        self, task: Task, solver: PolicyHandle, verifier: PolicyHandle
    ) -> tuple[_Attempt, list[tuple[Trajectory, float, str]]]:
        cfg = self.config
        attempt = await self._solve(task, solver, self.rewards)
        if cfg.verifier_balance and not cfg.retry:  # the balanced group is judged later
            return attempt, []
        judged = await self._judge(task, verifier, attempt.answer, self._correct(attempt.reward))
        judgements = [judged]
        if cfg.retry and judged[2] != "yes":
            add_user_turn(attempt.traj, cfg.retry_text, chat=cfg.prompt.chat)
            gen = await attempt.traj.generate(cfg.solver_sampling)
            attempt.answer, attempt.retried = gen.text, True
            attempt.reward = await self.rewards.score(gen.text, task.payload)
            if cfg.judge_retry:
                judgements.append(
                    await self._judge(task, verifier, gen.text, self._correct(attempt.reward))
                )
        return attempt, judgements


class SolverSelectorConfig(_TwoRoleConfig):
    """Config of ``solver_selector``."""

    selector: PolicyName = "selector"
    """Policy that picks one of the solver's candidates."""
    selector_sampling: SamplingParams = Field(
        default_factory=lambda: SamplingParams(max_new_tokens=8)
    )
    """Sampling of picks."""
    selector_template: str = SELECTOR_TEMPLATE
    """Selection prompt; fields: {question}, {candidates} (numbered '(1) …' lines)."""
    selector_group_size: int | None = Field(default=None, ge=1)
    """Selector samples per task (its group); unset: the task's group_size."""


@WORKFLOWS.register("solver_selector")
class SolverSelector(_TwoRole, ScoredWorkflow[SolverSelectorConfig]):
    """A solver proposes ``group_size`` candidates; a selector picks the correct one."""

    Config = SolverSelectorConfig
    workflow = "solver_selector"
    roles = ("solver", "selector")

    async def _play(
        self, task: Task, solver: PolicyHandle, selector: PolicyHandle, groups: dict[str, str]
    ) -> list[Sample]:
        """Candidates, then the selector's group of picks."""
        cfg = self.config
        attempts = await asyncio.gather(
            *(self._solve(task, solver, self.rewards) for _ in range(task.group_size))
        )
        correct = [self._correct(a.reward) for a in attempts]
        candidates = "\n".join(
            f"({i + 1}) {a.answer[: cfg.max_answer_chars].strip()}" for i, a in enumerate(attempts)
        )
        prompt = self._judge_prompt(
            cfg.selector_template, question=question_text(task.payload), candidates=candidates
        )
        size = cfg.selector_group_size or task.group_size
        prompt_ids = encode_prompt(selector.tokenizer, prompt)
        started = time.monotonic()
        picks = await selector.generate(prompt_ids, cfg.selector_sampling, n=size)
        samples = [
            role_sample(a.traj, task, a.reward, groups, "solver", candidate=i)
            for i, a in enumerate(attempts)
        ]
        for gen in picks:
            traj = Trajectory(selector, started=started)
            traj.add_tokens(prompt_ids)
            traj.add_generation(gen)
            choice = parse_choice(gen.text, len(attempts))
            reward = float(choice is not None and correct[choice])
            samples.append(role_sample(traj, task, reward, groups, "selector", choice=choice))
        return samples
