"""``EvalConfig``: which policy, which held-out sets, how to prompt, sample and score them."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from astraflow.config import ConfigModel
from astraflow.models import ComputeDType
from astraflow.plugins import GENERATOR_SPEC, WORKFLOW_SPEC, PluginSpec
from astraflow.records import Name

__all__ = ["EvalConfig", "EvalSettings", "HeldOutSet", "ScoringSettings"]


class ScoringSettings(ConfigModel):
    """What is measured on one held-out set: greedy accuracy and/or k samples per task."""

    greedy: bool = True
    """Score one greedy completion per task (``accuracy``; ``env``: one episode per task)."""
    k: int = Field(default=0, ge=0, le=1024)
    """Samples per task for ``avg@k`` and ``pass@k`` (0: none, greedy accuracy only)."""
    sample_temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature of the k samples."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus bound of the k samples."""
    pass_at: list[int] = Field(default_factory=list)
    """k values reported as ``pass@j`` (default: 1, 2, 4 ... below k, and k); each at most k."""
    success_threshold: float = 1.0
    """A sample whose reward is at least this counts as solved for pass@k (``env``: the
    episode's success)."""

    @model_validator(mode="after")
    def _consistent(self) -> ScoringSettings:
        if not self.greedy and self.k == 0:
            raise ValueError("nothing to measure: set greedy: true or k >= 1")
        bad = [j for j in self.pass_at if not 1 <= j <= self.k]
        if bad:
            raise ValueError(f"pass_at values {bad} must lie in 1..k (k={self.k})")
        return self


class EvalSettings(ScoringSettings):
    """How an evaluator generates and how often (what a run config sets per evaluation)."""

    max_new_tokens: int | None = Field(default=None, ge=1)
    """Generation bound (default: the workflow's sampling.max_new_tokens)."""
    every_s: float = Field(default=5.0, gt=0)
    """Evaluate the newest version at most this often."""
    every_versions: int | None = Field(default=None, ge=1)
    """Milestones: evaluate only once the newest version has passed a multiple of this since
    the last evaluated one (None: every new version); the final version is always evaluated."""
    batch_size: int = Field(default=256, ge=1)
    """Prompts per generation batch."""
    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature of the ``greedy`` pass of ``env`` episodes (0: greedy);
    single-turn workflows decode greedily."""
    dtype: ComputeDType = "auto"
    """Dtype the model computes in ('auto': float32 for weights published in bfloat16 or
    float16, as the evaluator runs on the CPU; 'published'; or a dtype by name)."""


class HeldOutSet(ScoringSettings):
    """One more held-out set of an evaluator (its metrics are keyed ``<name>/<metric>``)."""

    name: Name
    """Set name: the prefix of its metrics."""
    generator: Annotated[PluginSpec, GENERATOR_SPEC]
    """Task generator of the set."""
    workflow: Annotated[PluginSpec | None, WORKFLOW_SPEC] = None
    """Workflow spec whose prompt and reward are used (default: the evaluator's)."""


class EvalConfig(EvalSettings):
    """One evaluator process: a policy, its weight store, one or more held-out task sets."""

    policy: Name
    """Policy whose versions are evaluated."""
    weights: str
    """Weight store: a directory, an fsspec URL or a weight server URL."""
    generator: Annotated[PluginSpec, GENERATOR_SPEC]
    """Task generator of the main held-out set (rows with the fields the workflow's prompt
    uses); its metrics are keyed without prefix (``accuracy``, ``avg@k``, ``pass@k``)."""
    workflow: Annotated[PluginSpec, WORKFLOW_SPEC] = Field(
        default_factory=lambda: PluginSpec(type="rlvr")
    )
    """Workflow spec whose prompt and reward settings are used (single-role workflows)."""
    sets: list[HeldOutSet] = Field(default_factory=list)
    """More held-out sets, each scored at the same versions."""
    out: str = "eval.jsonl"
    """JSONL file the results are appended to."""
    seed: int = 0
    """Seed of the reward plug-ins and of the sampled passes."""
    threads: int = Field(default=1, ge=1)
    """torch threads (evaluation should not starve trainers and nodes)."""

    @model_validator(mode="after")
    def _unique_sets(self) -> EvalConfig:
        names = [s.name for s in self.sets]
        if len(set(names)) != len(names):
            raise ValueError(f"held-out set names must be unique, got {names}")
        return self
