"""``NodeConfig``: everything one rollout node is started with (YAML, flags, ``--set``)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from astraflow.config import ConfigModel, env_secret
from astraflow.models import ModelSpec
from astraflow.plugins import ENGINE_SPEC, TOOL_SPEC, WORKFLOW_SPEC, NamedSpecs, PluginSpec
from astraflow.records import NAME_PATTERN

__all__ = [
    "NodeConfig",
    "NodeSettings",
    "PolicyConfig",
    "default_node_id",
]


def default_node_id() -> str:
    """``<host>-<pid>``: unique per process on a cluster, stable for the process's life."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    return f"{host or 'node'}-{os.getpid()}"[:120]


class PolicyConfig(ConfigModel):
    """One policy hosted by the node: its model, its engine, how eagerly its weights follow."""

    model: ModelSpec | None = None
    """The policy's own model; default: built from the weight store's assets and weights."""
    engine: Annotated[PluginSpec, ENGINE_SPEC] = Field(
        default_factory=lambda: PluginSpec(type="transformers")
    )
    """Engine spec: ``type`` (transformers, vllm, sglang, openai or module:Class) + options."""
    frozen: bool = False
    """Never refresh from the weight store (judges, tools); implied by the openai engine."""
    refresh: Literal["eager", "lazy"] = "eager"
    """'eager': pull as soon as a newer version is announced; 'lazy': only when the dataflow
    asks for it (a lease refused for staleness: the dataflow's ``max_staleness`` is the one
    staleness bound)."""

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_type(cls, v: Any) -> Any:
        if isinstance(v, Mapping) and "type" not in v:
            return {"type": "transformers", **v}
        return PluginSpec.coerce(v) if isinstance(v, str) else v

    @property
    def is_frozen(self) -> bool:
        """True when the weights never change (frozen, or served by an openai endpoint)."""
        return self.frozen or self.engine.type == "openai"


class NodeSettings(ConfigModel):
    """What a run config sets for every node of a pool: ``NodeConfig`` without what a
    launcher fills in (URLs, policies, workflows, tools, id, pool, capacity, work_dir, seed)."""

    task_timeout_s: float = Field(default=600.0, gt=0)
    """A workflow running longer is cancelled and its task reported failed."""
    grace_s: float = Field(default=30.0, ge=0)
    """On SIGTERM: how long running tasks may finish before their leases are handed back."""
    lease_wait_s: float = Field(default=0.05, ge=0)
    """When some slots free up while tasks still run, wait up to this long for more to free
    before leasing: tasks leased together generate together (bigger engine batches)."""
    submit_wait_s: float = Field(default=0.05, ge=0)
    """Tasks that finish within this long of each other submit their samples in one request
    (``/v1/submit/many``): tasks that generated in one engine batch end together, and one
    request for all of them costs the node and the dataflow far less than one each. The
    request goes sooner when every task the node runs is waiting to submit, so a longer
    window delays only a task that finished while others of its node still run. The rows of
    one batch finish a decode step or more apart (at their end-of-sequence), and a decode
    step can take longer than a few milliseconds: with 5 ms (the default before) the
    quickstart's 16 tasks went in 2.25 requests a step, with 50 ms in about one. 0: one
    request per task."""
    watch_versions_s: float = Field(default=30.0, ge=0, le=600)
    """Hold a long-poll (``/v1/versions/watch``) of up to this long open to hear of each new
    version as it is announced, and pull it (eager refresh) while tasks still generate with
    the one before; 0: hear of versions only from lease and heartbeat replies."""
    idle_wait_s: float = Field(default=1.0, gt=0)
    """Wait before leasing again after an empty reply that named no retry time."""
    request_timeout_s: float = Field(default=30.0, gt=0)
    """Timeout of each call to the dataflow service."""
    heartbeat_fraction: float = Field(default=1 / 3, gt=0, lt=1)
    """Leases are renewed every ``lease_ttl_s * heartbeat_fraction`` seconds."""
    stats_window_s: float = Field(default=60.0, gt=0)
    """Window of the throughput figures reported in heartbeats."""
    hardware: str | None = None
    """Hardware label in reports (default: detected, e.g. 'cpu x2' or the GPU name)."""


class NodeConfig(NodeSettings):
    """A rollout node: where the dataflow and weights are, what it hosts and runs."""

    dataflow_url: str
    """Base URL of the dataflow service, e.g. http://127.0.0.1:8700."""
    weights: str
    """Weight store: an http(s) weight server URL, a local directory, or an fsspec URL."""
    policies: dict[str, PolicyConfig] = Field(min_length=1)
    """Hosted policies by name (a node may host several, one engine each)."""
    workflows: Annotated[NamedSpecs, WORKFLOW_SPEC] = Field(
        default_factory=lambda: {"rlvr": PluginSpec(type="rlvr")}
    )
    """Workflows this node runs, by task workflow name: specs (``type`` defaults to the name)."""
    tools: Annotated[NamedSpecs, TOOL_SPEC] = Field(default_factory=dict)
    """Tools offered to every workflow, by name: specs (``type`` defaults to the name)."""
    node_id: str = Field(default_factory=default_node_id, pattern=NAME_PATTERN)
    """This node's id in leases and reports (default: host-pid)."""
    pool: str = Field(default="default", pattern=NAME_PATTERN)
    """Pool label reported with every lease and heartbeat (region, hardware ...)."""
    capacity: int = Field(default=8, ge=1, le=4096)
    """Tasks run at once."""
    work_dir: str | None = None
    """Scratch directory (assets, engine files); default: a temporary directory."""
    seed: int = 0
    """Seed of workflow and engine RNGs."""
    dataflow_token: SecretStr | None = Field(
        default_factory=env_secret("ASTRAFLOW_NODE_TOKEN"), exclude=True, repr=False
    )
    """Bearer token for the dataflow service (default: env ASTRAFLOW_NODE_TOKEN; never dumped)."""
    weights_token: SecretStr | None = Field(
        default_factory=env_secret(
            "ASTRAFLOW_WEIGHTS_READ_TOKEN", "ASTRAFLOW_WEIGHTS_PUBLISH_TOKEN"
        ),
        exclude=True,
        repr=False,
    )
    """Bearer token for a weight server (default: env ASTRAFLOW_WEIGHTS_READ_TOKEN, else
    ASTRAFLOW_WEIGHTS_PUBLISH_TOKEN; never dumped)."""

    @field_validator("policies")
    @classmethod
    def _policy_names(cls, v: dict[str, PolicyConfig]) -> dict[str, PolicyConfig]:
        import re

        for name in v:
            if not re.match(NAME_PATTERN, name):
                raise ValueError(f"policy name {name!r} is not a valid name")
        return v

    @model_validator(mode="after")
    def _workflows_named(self) -> NodeConfig:
        if not self.workflows:
            raise ValueError("a node must run at least one workflow")
        return self
