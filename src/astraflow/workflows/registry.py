"""The workflow registry: built-in workflows by name, and what every workflow config shares.

Nodes build a workflow as ``WORKFLOWS.build({"type": "rlvr", ...}, seed=...)``; a task names
the workflow that runs it (``task.workflow``). Built-ins register on first lookup.

| name | policies (config fields) | module |
|---|---|---|
| ``rlvr`` | ``policy`` | ``workflows/rlvr.py`` |
| ``tool_calling`` | ``policy`` | ``workflows/tool_calling.py`` |
| ``solver_verifier`` | ``solver``, ``verifier`` | ``workflows/multi_policy.py`` |
| ``solver_selector`` | ``solver``, ``selector`` | ``workflows/multi_policy.py`` |
| ``solver_testgen`` | ``solver``, ``testgen`` | ``workflows/testgen.py`` |
| ``env_players`` | ``players`` (one policy per seat) | ``workflows/env_players.py`` |
| ``long_tail`` | those of the workflow it wraps | ``workflows/length_tail.py`` |
| ``agent`` | ``policies`` (an OpenAI-API agent program) | ``workflows/agent.py`` |
| ``env`` | ``policy`` (drives any ``astraflow.envs`` environment) | ``workflows/env.py`` |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Generic, Protocol, TypeVar

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.plugins import REWARD_SPEC, PluginSpec, Registry
from astraflow.records import Name
from astraflow.workflows.api import SamplingParams, Workflow

__all__ = [
    "POLICY_ROLE",
    "WORKFLOWS",
    "PolicyName",
    "PolicyRole",
    "PromptConfig",
    "RewardField",
    "SinglePolicy",
    "SingleRoleConfig",
]

WORKFLOWS: Registry[Workflow] = Registry(
    "workflow",
    Workflow,
    (
        "astraflow.workflows.rlvr",
        "astraflow.workflows.tool_calling",
        "astraflow.workflows.multi_policy",
        "astraflow.workflows.testgen",
        "astraflow.workflows.length_tail",
        "astraflow.workflows.agent",
        "astraflow.workflows.env",
        "astraflow.workflows.env_players",
    ),
)

RewardField = Annotated[str | PluginSpec | None, REWARD_SPEC]
"""A reward by registry name or spec; None: use the name in each task's ``payload['reward']``."""


class PolicyRole:
    """Field metadata: the field names a policy the workflow calls (a name or a list).

    A run config is checked against it: every policy a workflow's config names (its
    defaults included) must be one the run trains or serves.
    """


POLICY_ROLE = PolicyRole()
PolicyName = Annotated[Name, POLICY_ROLE]
"""A workflow config field naming a policy (``solver: PolicyName = "solver"``)."""


class PromptConfig(ConfigModel):
    """How a workflow turns a task payload into the first prompt of a policy."""

    template: str | None = None
    """Format string over payload fields for text prompts, e.g. 'Q: {prompt}\\nA:'."""
    system: str | None = None
    """System text: a system message in chat, else prepended to the prompt."""
    chat: bool = False
    """Send text prompts as a user message through the policy's chat template."""


class SingleRoleConfig(ConfigModel):
    """Config shared by single-policy workflows."""

    policy: PolicyName = "policy"
    """Name of the policy that generates (and is trained)."""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    """Sampling of every generation."""
    reward: RewardField = None
    """Reward by name or spec; unset: each task's ``payload['reward']``."""
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    """Prompt construction."""


class _NamesOnePolicy(Protocol):
    @property
    def policy(self) -> str:
        """The policy the workflow calls."""
        ...


RoleConfigT = TypeVar("RoleConfigT", bound=_NamesOnePolicy)


class SinglePolicy(Generic[RoleConfigT]):
    """Base of a workflow that calls the one policy its config names (``config.policy``)."""

    config: RoleConfigT

    @property
    def policies(self) -> Sequence[str]:
        """The one policy."""
        return (self.config.policy,)
