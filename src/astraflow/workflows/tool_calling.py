"""``tool_calling``: multi-turn episodes where the model calls tools between generations.

    prompt + tool instructions
        │
        ▼
    generate (stops at </tool>) ──call?──yes──► run tool ──► append <result>…</result> ─┐
        │ no call, or max_turns reached                                                │
        ▼                                                              (next turn) ◄───┘
    reward(last generation's text) ──► one sample per episode; group_size episodes per task

Tool output and the prompt are context (mask 0); only the model's own turns are trained.
Tools come from the node's ``tools`` mapping when it has one of that name, else are built
from the ``TOOLS`` registry by this workflow's config.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
from typing import Annotated

from pydantic import Field

from astraflow.plugins import TOOL_SPEC, PluginSpec
from astraflow.records import Sample, Task
from astraflow.workflows.api import PolicyHandle, SamplingParams, Tool, Trajectory
from astraflow.workflows.prompts import build_prompt, get_policy
from astraflow.workflows.registry import WORKFLOWS, SinglePolicy, SingleRoleConfig
from astraflow.workflows.rewards import ScoredWorkflow
from astraflow.workflows.tools import TOOLS, parse_tool_call

__all__ = ["ToolCalling"]

DEFAULT_INSTRUCTIONS = (
    "You can use tools. To call one, write <tool>NAME: INPUT</tool> and wait for "
    "<result>OUTPUT</result>. Tools: {tools}. Give the final answer as <answer>ANSWER</answer>.\n"
)
_DESCRIPTIONS = {
    "calculator": "calculator (arithmetic, e.g. <tool>calculator: 12*(3+4)</tool>)",
    "search": "search (finds documents, e.g. <tool>search: capital of Eldoria</tool>)",
}


_DEFAULT_TOOLS: tuple[str | PluginSpec, ...] = ("calculator", "search")


class ToolCallingConfig(SingleRoleConfig):
    """Config of ``tool_calling``."""

    tools: Annotated[list[str | PluginSpec], TOOL_SPEC] = Field(
        default_factory=lambda: list(_DEFAULT_TOOLS)
    )
    """Tools offered (``TOOLS`` registry names or specs)."""
    max_turns: int = Field(default=4, ge=1, le=64)
    """Most generations per episode (tool calls + final answer)."""
    sampling: SamplingParams = Field(default_factory=lambda: SamplingParams(max_new_tokens=128))
    """Sampling of every turn (``</tool>`` is added to its stop strings)."""
    instructions: str | None = DEFAULT_INSTRUCTIONS
    """Text put before the task's prompt ('{tools}' lists the tools); None: nothing."""
    max_result_chars: int = Field(default=800, ge=1)
    """Tool output longer than this is cut."""


@WORKFLOWS.register("tool_calling")
class ToolCalling(SinglePolicy[ToolCallingConfig], ScoredWorkflow[ToolCallingConfig]):
    """Multi-turn tool use with a calculator and a local search tool."""

    Config = ToolCallingConfig
    open_tag, close_tag = "<tool>", "</tool>"

    def __init__(self, config: ToolCallingConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        self.tools: dict[str, Tool] = {}
        for spec in config.tools:
            tool = TOOLS.build(spec, seed=rng.randrange(2**31))
            self.tools[tool.name] = tool
        self.sampling = config.sampling.model_copy(
            update={"stop": (*config.sampling.stop, self.close_tag)}
        )

    def _prompt_text(self) -> str:
        if self.config.instructions is None:
            return ""
        listed = ", ".join(_DESCRIPTIONS.get(name, name) for name in self.tools)
        return self.config.instructions.replace("{tools}", listed)

    async def __call__(
        self, task: Task, policies: Mapping[str, PolicyHandle], tools: Mapping[str, Tool]
    ) -> list[Sample]:
        """Run ``group_size`` episodes concurrently and reward each."""
        policy = get_policy(policies, self.config.policy, "tool_calling")
        available = {**self.tools, **{k: v for k, v in tools.items() if k in self.tools}}
        episodes = [self._episode(task, policy, available) for _ in range(task.group_size)]
        return list(await asyncio.gather(*episodes))

    async def _episode(self, task: Task, policy: PolicyHandle, tools: Mapping[str, Tool]) -> Sample:
        cfg = self.config
        traj = Trajectory(policy, started=time.monotonic())
        instructions = self._prompt_text()
        system = (cfg.prompt.system or "") + instructions if instructions else cfg.prompt.system
        traj.add_prompt(
            build_prompt(
                task.payload, template=cfg.prompt.template, system=system, chat=cfg.prompt.chat
            )
        )
        calls = errors = 0
        text = ""
        for turn in range(cfg.max_turns):
            gen = await traj.generate(self.sampling)
            text = gen.text
            call = parse_tool_call(text, self.open_tag, self.close_tag)
            if call is None or turn == cfg.max_turns - 1:
                break
            calls += 1
            tool = tools.get(call.name)
            if tool is None:
                errors += 1
                result = f"error: unknown tool {call.name!r}"
            else:
                result = await tool(call.arguments)
            traj.add_text(f"<result>{result[: cfg.max_result_chars]}</result>")
        reward = await self.rewards.score(text, task.payload)
        return traj.to_sample(
            task, reward, meta={"role": "policy", "tool_calls": calls, "tool_errors": errors}
        )
