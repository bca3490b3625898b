"""``rlvr``: single-turn reinforcement learning from verifiable rewards.

    payload ──prompt──► policy.generate(n=group_size) ──► reward(each) ──► one group

One generation call with ``n = task.group_size`` (the node batches it), each completion scored
by the configured reward (or the one the task names), one sample per completion.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from astraflow.errors import WorkflowError
from astraflow.records import Sample, Task
from astraflow.workflows.api import PolicyHandle, Tool, Trajectory, encode_prompt
from astraflow.workflows.prompts import build_prompt, get_policy
from astraflow.workflows.registry import WORKFLOWS, SinglePolicy, SingleRoleConfig
from astraflow.workflows.rewards import ScoredWorkflow

__all__ = ["RLVR"]


@WORKFLOWS.register("rlvr")
class RLVR(SinglePolicy[SingleRoleConfig], ScoredWorkflow[SingleRoleConfig]):
    """Prompt → ``group_size`` completions → a reward each → one group."""

    Config = SingleRoleConfig

    async def __call__(
        self, task: Task, policies: Mapping[str, PolicyHandle], tools: Mapping[str, Tool]
    ) -> list[Sample]:
        """Generate the group, score it, return its samples."""
        started = time.monotonic()
        policy = get_policy(policies, self.config.policy, "rlvr")
        cfg = self.config.prompt
        prompt = build_prompt(task.payload, template=cfg.template, system=cfg.system, chat=cfg.chat)
        prompt_ids = encode_prompt(policy.tokenizer, prompt)
        gens = await policy.generate(prompt_ids, self.config.sampling, n=task.group_size)
        if len(gens) != task.group_size:
            raise WorkflowError(
                f"policy {policy.name!r} returned {len(gens)} generations, asked for "
                f"{task.group_size}"
            )
        rewards = await self.rewards.score_all([g.text for g in gens], task.payload)
        samples = []
        for gen, reward in zip(gens, rewards, strict=True):
            traj = Trajectory(policy, started=started)
            traj.add_tokens(prompt_ids)
            traj.add_generation(gen)
            samples.append(traj.to_sample(task, reward, meta={"role": "policy"}))
        return samples
