"""``RunConfig``: one YAML file describing a whole run, and the component configs it implies.

The run config mirrors the system: policies (model + trainer + rollout settings), task
sources, workflows, rollout pools, the dataflow's plug-ins and regulation, the weight store,
evaluation. ``plan()`` turns it into the configs each component is started with; launch
code never interprets them further (each component validates its own).

    RunConfig ──plan()──► DataflowConfig · TrainerConfig per policy · NodeConfig per node
                          · EvalConfig per evaluated policy
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from astraflow.config import ConfigModel
from astraflow.dataflow.config import (
    AuthConfig,
    DashboardConfig,
    FilterList,
    LeaseConfig,
    PolicySettings,
    RegulationSettings,
    ReportConfig,
    SamplerField,
    SelectorField,
    SourceConfig,
)
from astraflow.evaluation.config import EvalSettings, ScoringSettings
from astraflow.launch.trackers import LoggingSection
from astraflow.link.config import LinkConfig
from astraflow.models import ModelSpec
from astraflow.plugins import GENERATOR_SPEC, TOOL_SPEC, WORKFLOW_SPEC, NamedSpecs, PluginSpec
from astraflow.raas.config import NodeSettings
from astraflow.raas.config import PolicyConfig as RolloutConfig
from astraflow.records import Name, exactly_one
from astraflow.trainer.config import TrainerSettings, WarmupSettings
from astraflow.weights.config import WeightStoreConfig

__all__ = [
    "COMPONENT_KINDS",
    "ActorResources",
    "AutoscaleConfig",
    "DataflowSection",
    "EvalSection",
    "HeldOutSection",
    "PolicySection",
    "PoolSection",
    "RaySection",
    "RunConfig",
    "WarmupSection",
]


class WarmupSection(WarmupSettings):
    """SFT warm-up before RL: pairs from a JSONL file or from a task generator."""

    pairs: str | None = None
    """JSONL file of ``{"prompt", "completion"}`` objects (relative to the config file)."""
    generator: Annotated[PluginSpec | None, GENERATOR_SPEC] = None
    """Or a task generator whose rows have ``prompt`` and ``completion`` (e.g. noisy_sft)."""

    _one_source = exactly_one(
        "pairs", "generator", "warmup needs exactly one of 'pairs' (a file) or 'generator'"
    )


class PolicySection(PolicySettings):
    """One policy: its model, its trainer, how rollout nodes host it, and how the dataflow
    holds its samples (``max_staleness``, the one staleness bound: the dataflow serves no
    sample and leases to no node whose weights lag more; ``max_buffered`` ...)."""

    model: ModelSpec
    """The policy's model (pretrained by name/path, or built from a config)."""
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)
    """The trainer (loss, optimizer, batch, publish_dtype, max_steps, backend ...); policy,
    model, URLs, run_dir and seed are filled in by the launcher."""
    warmup: WarmupSection | None = None
    """SFT warm-up before version 0 (fresh runs only)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """How nodes host this policy: engine, refresh, own model."""
    vocab_size: int | None = Field(default=None, ge=1)
    """Token-id bound checked on ingest (default: the model's vocabulary size)."""
    frozen: bool = False
    """Served but never trained (a judge or tool model): no trainer is started, nodes load
    ``model`` (or use an ``openai`` engine), and its samples are not buffered."""
    processes: int = Field(default=1, ge=1)
    """Trainer processes (FSDP2 ranks under torchrun when > 1; set trainer.backend: fsdp2)."""


class PoolSection(ConfigModel):
    """A group of identical rollout nodes with one pool label."""

    name: Name = "local"
    """Pool label (region, hardware ...) every node of the pool reports."""
    nodes: int = Field(default=1, ge=0)
    """Nodes started with the run."""
    capacity: int = Field(default=8, ge=1)
    """Tasks each node runs at once."""
    node: NodeSettings = Field(default_factory=NodeSettings)
    """Node settings for every node of the pool (timeouts, lease_wait_s ...)."""
    policies: dict[Name, RolloutConfig] = Field(default_factory=dict)
    """Per-policy overrides of ``PolicySection.rollout`` for this pool (e.g. another engine):
    the keys given replace the policy's."""
    min_nodes: int = Field(default=0, ge=0)
    """Autoscaler lower bound."""
    max_nodes: int = Field(default=8, ge=0)
    """Autoscaler upper bound."""
    speed: float = Field(default=1.0, gt=0, le=1)
    """Fraction of full speed: each node runs under a cgroup v1 CPU quota of speed x its
    threads (``threads.node``, else every core) CPUs; 1.0: no quota (local launcher only)."""
    link: LinkConfig | None = None
    """Remote pool: its nodes reach the dataflow service and the weight server only through
    an emulated WAN link of this shape, one per pool (local launcher only)."""
    relay: bool = False
    """Remote pool: a regional weight relay behind the link pulls each version once and
    the pool's nodes pull from it (needs ``link``)."""

    @model_validator(mode="after")
    def _relay_needs_link(self) -> PoolSection:
        if self.relay and self.link is None:
            raise ValueError(f"pool {self.name!r}: relay needs a link (a relay serves a region)")
        return self


class DataflowSection(ConfigModel):
    """Dataflow-service settings beyond what policies and sources imply."""

    port: int = Field(default=0, ge=0, le=65535)
    """Port of the dataflow service (0: a free port, chosen at each launch)."""
    host: str = "127.0.0.1"
    """Address the service binds to."""
    selector: SelectorField = "shuffled"
    """Before-rollout plug-in (TaskSelector)."""
    filters: FilterList = Field(default_factory=list)
    """After-rollout plug-ins (TrajectoryFilter), applied in order."""
    sampler: SamplerField = "fifo"
    """Batch-serving plug-in (BatchSampler)."""
    lease: LeaseConfig = Field(default_factory=LeaseConfig)
    """Lease time-to-live and attempts."""
    regulation: RegulationSettings = Field(default_factory=RegulationSettings)
    """Lease sizing (the mode and the sync round size come from the run's ``mode``)."""
    report: ReportConfig = Field(default_factory=ReportConfig)
    """Report window and dead-band pool target."""
    auth: AuthConfig = Field(default_factory=AuthConfig)
    """Bearer tokens per role (also from ASTRAFLOW_*_TOKEN)."""
    dashboard: DashboardConfig = Field(default_factory=DashboardConfig)
    """The live dashboard at ``/dashboard`` (``astraflow run`` prints its URL)."""


class HeldOutSection(ScoringSettings):
    """One more held-out set of an evaluation (metrics keyed ``<name>/<metric>``)."""

    name: Name
    """Set name: the prefix of its metrics."""
    generator: Annotated[PluginSpec, GENERATOR_SPEC]
    """Task generator of the set."""
    workflow: Name | None = None
    """Workflow (in ``workflows``) whose prompt and reward are used (default: the
    evaluation's)."""


class EvalSection(EvalSettings):
    """Evaluation of a policy's versions on held-out sets (greedy accuracy, avg@k, pass@k)
    while it trains, at milestones, and of the final version."""

    policy: Name
    """Policy to evaluate."""
    generator: Annotated[PluginSpec, GENERATOR_SPEC]
    """Task generator of the held-out set (e.g. ``{type: add1, split: eval, size: 200}``)."""
    workflow: Name = "rlvr"
    """Workflow (in ``workflows``) whose prompt and reward settings are used."""
    sets: list[HeldOutSection] = Field(default_factory=list)
    """More held-out sets scored at the same versions (one evaluator process per policy)."""


class AutoscaleConfig(ConfigModel):
    """Follow the dataflow's dead-band target pool size between each pool's min and max."""

    enabled: bool = False
    """Resize pools automatically (``astraflow pool add|remove`` works either way)."""
    interval_s: float = Field(default=10.0, gt=0)
    """How often the target is read."""
    scale_up_delay_s: float = Field(default=30.0, ge=0)
    """Least time between a pool's resize and its next growth (a new node must show its
    effect on trainer waiting first); never grows while a started node is not yet seen."""
    scale_down_delay_s: float = Field(default=120.0, ge=0)
    """Least time between a pool's resize and its next shrink, and the least age of a node
    the autoscaler retires."""


#: Component kinds a launcher starts (the keys of ``ray.resources``, besides ``node:<pool>``).
COMPONENT_KINDS = ("dataflow", "weights", "trainer", "node", "eval")
ComponentKind = Literal["dataflow", "weights", "trainer", "node", "eval"]


class ActorResources(ConfigModel):
    """What one component's Ray actor asks the cluster for."""

    num_cpus: float = Field(default=0.0, ge=0)
    """Logical CPUs reserved for the actor."""
    num_gpus: float = Field(default=0.0, ge=0)
    """GPUs (Ray sets CUDA_VISIBLE_DEVICES for the actor)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources, e.g. ``{"head": 0.01}`` to place it on machines that offer one."""


#: What a kind asks for when ``ray.resources`` does not name it.
_DEFAULT_RESOURCES = {"trainer": ActorResources(num_cpus=1), "node": ActorResources(num_cpus=1)}


class RaySection(ConfigModel):
    """Where ``astraflow run --cluster ray`` places the components, and what each asks for."""

    address: str | None = None
    """Cluster to join ('auto', 'HOST:6379'); unset: $RAY_ADDRESS, else a local Ray started
    for the run (and stopped after it)."""
    num_cpus: int | None = Field(default=None, ge=1)
    """Logical CPUs of a local Ray (default: this machine's)."""
    resources: dict[str, ActorResources] = Field(default_factory=dict)
    """Per component kind (dataflow, weights, trainer, node, eval) or per pool ('node:<pool>',
    overriding 'node'); a kind not listed: 1 CPU for trainers and nodes, nothing for others."""
    runtime_env: dict[str, Any] = Field(default_factory=dict)
    """Ray runtime_env of the run's job (env_vars, working_dir, pip ...)."""
    place_timeout_s: float = Field(default=300.0, gt=0)
    """A dataflow, trainer, weight server or evaluator the cluster cannot place within this
    long fails the run (a node waits for resources as long as it takes). Only time while its
    ask does not fit the cluster's free resources counts: an actor that fits is placed, and
    its process may take a while to start on a loaded machine."""

    @model_validator(mode="after")
    def _known_kinds(self) -> RaySection:
        bad = [
            key
            for key in self.resources
            if key not in COMPONENT_KINDS and not key.startswith("node:")
        ]
        if bad:
            raise ValueError(
                f"resources: unknown component kind(s) {bad}; use "
                f"{', '.join(COMPONENT_KINDS)} or node:<pool>"
            )
        if self.address is not None and self.address.startswith("ray://"):
            raise ValueError(
                "address: Ray Client (ray://) is not supported: run the launcher on a "
                "machine of the cluster (address 'auto' or 'HOST:6379')"
            )
        return self

    def actor_resources(self, kind: str, pool: str | None = None) -> ActorResources:
        """Resources of a component of ``kind`` (a node's: its pool's 'node:<pool>' entry, else
        'node')."""
        for key in ([f"{kind}:{pool}"] if pool else []) + [kind]:
            if key in self.resources:
                return self.resources[key]
        return _DEFAULT_RESOURCES.get(kind, ActorResources())


class RunConfig(ConfigModel):
    """A whole run: policies, data, workflows, pools, plug-ins, evaluation."""

    run_dir: Path = Path("runs/run")
    """Everything is written here; the same run_dir resumes a run."""
    seed: int = 0
    """Run seed: plug-ins, workflows, trainers and model init derive theirs from it."""
    mode: Literal["async", "sync"] = "async"
    """'async': autonomous components (the design); 'sync': trainer-centred lock-step rounds
    (generate a full batch, wait, train, push weights, repeat), for comparison."""
    policies: dict[Name, PolicySection] = Field(min_length=1)
    """Policies by name; each trained one gets a trainer."""
    sources: list[SourceConfig] = Field(min_length=1)
    """Task sources (each names its workflow, the policies it uses, group size, epochs)."""
    workflows: Annotated[NamedSpecs, WORKFLOW_SPEC] = Field(default_factory=dict)
    """Workflow specs by the name tasks use (``type`` defaults to the name)."""
    tools: Annotated[NamedSpecs, TOOL_SPEC] = Field(default_factory=dict)
    """Tools offered to every workflow, by name (``type`` defaults to the name)."""
    pools: list[PoolSection] = Field(default_factory=lambda: [PoolSection()])
    """Rollout pools started with the run."""
    dataflow: DataflowSection = Field(default_factory=DataflowSection)
    """Dataflow-service settings."""
    weights: WeightStoreConfig = Field(default_factory=WeightStoreConfig)
    """How the weight store writes and keeps versions (full_every, keep ...)."""
    serve_weights: bool = False
    """Serve the weight store over HTTP (nodes on other machines); local nodes read the
    directory either way."""
    eval: list[EvalSection] = Field(default_factory=list)
    """Held-out evaluations, one process each."""
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    """Pool autoscaling."""
    sync_round_tasks: int | None = Field(default=None, ge=1)
    """Tasks per round in sync mode (default: one batch worth of tasks for every trainer, at
    the sources' weights)."""
    threads: dict[Literal["trainer", "node", "eval"], int] = Field(default_factory=dict)
    """torch threads per component kind (OMP_NUM_THREADS); unset: one per placed CPU when
    ``placement`` pins the kind, else torch's default."""
    placement: dict[ComponentKind, list[Annotated[int, Field(ge=0)]]] = Field(default_factory=dict)
    """CPU ids each kind's local processes are pinned to (CPU affinity), e.g.
    ``{trainer: [0], node: [1]}``; unset kinds run anywhere. Local launcher only (Ray places
    actors by ``ray.resources``)."""
    max_time_s: float | None = Field(default=None, gt=0)
    """Stop the run after this long (None: when every trainer reaches max_steps)."""
    ray: RaySection = Field(default_factory=RaySection)
    """Ray cluster and per-component resources (``astraflow run --cluster ray`` only)."""
    logging: LoggingSection = Field(default_factory=LoggingSection)
    """Experiment trackers (TensorBoard, Weights & Biases, MLflow) every figure goes to."""

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        problems = self._policy_references()
        pools = [p.name for p in self.pools]
        if len(set(pools)) != len(pools):
            problems.append(f"pool names must be unique, got {pools}")
        problems += [
            f"ray.resources: {key!r} names no pool (pools: {', '.join(pools)})"
            for key in self.ray.resources
            if key.startswith("node:") and key.split(":", 1)[1] not in pools
        ]
        problems += [
            f"placement.{kind}: CPU ids must be distinct and at least one, got {cpus}"
            for kind, cpus in self.placement.items()
            if not cpus or len(set(cpus)) != len(cpus)
        ]
        if not any(not p.frozen for p in self.policies.values()):
            problems.append("no policy is trained (every policy is frozen)")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _policy_references(self) -> list[str]:
        """Every source and evaluation must name a known policy (workflow roles are plug-in
        settings: ``launch.checks`` checks them with the workflow's own config)."""
        problems = []
        known = set(self.policies)
        names = ", ".join(sorted(known))
        for src in self.sources:
            problems += [
                f"source {src.name!r} uses policy {p!r}, which is not in policies ({names})"
                for p in src.policies
                if p not in known
            ]
        problems += [
            f"eval policy {ev.policy!r} is not in policies"
            for ev in self.eval
            if ev.policy not in known
        ]
        evaluated = [ev.policy for ev in self.eval]
        problems += [
            f"eval: policy {p!r} has {evaluated.count(p)} entries; give it one entry and put "
            "the other held-out sets under its 'sets'"
            for p in sorted(set(evaluated))
            if evaluated.count(p) > 1
        ]
        for ev in self.eval:
            sets = [s.name for s in ev.sets]
            if len(set(sets)) != len(sets):
                problems.append(f"eval {ev.policy!r}: held-out set names must be unique: {sets}")
        return problems

    @property
    def trained(self) -> list[str]:
        """Names of the policies that get a trainer."""
        return [n for n, p in self.policies.items() if not p.frozen]
