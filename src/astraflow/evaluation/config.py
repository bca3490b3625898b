"""``EvalConfig``: which policy, which held-out tasks, how to prompt and score them."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.plugins import GENERATOR_SPEC, WORKFLOW_SPEC, PluginSpec
from astraflow.records import Name

__all__ = ["EvalConfig", "EvalSettings"]


class EvalSettings(ConfigModel):
    """How an evaluator generates and how often (what a run config sets per evaluation)."""

    max_new_tokens: int | None = Field(default=None, ge=1)
    """Generation bound (default: the workflow's sampling.max_new_tokens)."""
    every_s: float = Field(default=5.0, gt=0)
    """Evaluate the newest version at most this often."""
    batch_size: int = Field(default=256, ge=1)
    """Prompts per greedy generation batch."""
    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature of ``env`` episodes (0: greedy); single-turn workflows are greedy."""


class EvalConfig(EvalSettings):
    """One evaluator process: a policy, its weight store, a held-out task set."""

    policy: Name
    """Policy whose versions are evaluated."""
    weights: str
    """Weight store: a directory, an fsspec URL or a weight server URL."""
    generator: Annotated[PluginSpec, GENERATOR_SPEC]
    """Task generator of the held-out set (rows with the fields the workflow's prompt uses)."""
    workflow: Annotated[PluginSpec, WORKFLOW_SPEC] = Field(
        default_factory=lambda: PluginSpec(type="rlvr")
    )
    """Workflow spec whose prompt and reward settings are used (single-role workflows)."""
    out: str = "eval.jsonl"
    """JSONL file the results are appended to."""
    seed: int = 0
    """Seed of the reward plug-ins."""
    threads: int = Field(default=1, ge=1)
    """torch threads (evaluation should not starve trainers and nodes)."""
