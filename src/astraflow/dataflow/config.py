"""``DataflowConfig``: everything the dataflow service reads, validated with clear errors.

run_dir/ policies{} sources[] selector filters[] sampler lease regulation report auth limits
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from astraflow.config import ConfigModel, role_tokens
from astraflow.plugins import FILTER_SPEC, GENERATOR_SPEC, SAMPLER_SPEC, SELECTOR_SPEC, PluginSpec
from astraflow.records import Name, Role

__all__ = [
    "AuthConfig",
    "DataflowConfig",
    "LeaseConfig",
    "LimitsConfig",
    "PolicyConfig",
    "PolicySettings",
    "RegulationConfig",
    "RegulationSettings",
    "ReportConfig",
    "SourceConfig",
]

PluginField = PluginSpec | str

SelectorField = Annotated[PluginField, SELECTOR_SPEC]
FilterList = Annotated[list[PluginField], FILTER_SPEC]
SamplerField = Annotated[PluginField, SAMPLER_SPEC]


class PolicySettings(ConfigModel):
    """How the dataflow holds one policy's samples (what a run config sets per policy)."""

    max_staleness: int = Field(default=1, ge=0)
    """Largest trainer-version lag of a served sample; also the lease admission bound."""
    max_buffered: int = Field(default=4096, ge=1)
    """Cap on buffered + in-flight samples (backpressure: no new tasks beyond it)."""
    retain_acked: int = Field(default=0, ge=0)
    """Acked groups kept for replay samplers (0: samples are deleted once acked)."""
    replay_max_staleness: int | None = Field(default=None, ge=0)
    """Largest trainer-version lag of a *replayed* acked group (None: ``max_staleness``); kept
    groups beyond it are deleted. A group is first trained at up to ``max_staleness``, so with
    the same bound it is too stale to replay one or two versions later: a replay sampler needs
    this above ``max_staleness`` to serve much (the loss's TIS corrects for older weights)."""
    ack_timeout_s: float = Field(default=600.0, gt=0)
    """An un-acked batch is served again after this many seconds."""
    frozen: bool = False
    """Served but never trained (a judge, a tool model): its samples are dropped on submit,
    never buffered, and never throttle leases."""

    @model_validator(mode="after")
    def _replay_bound(self) -> PolicySettings:
        if self.replay_max_staleness is not None and self.replay_max_staleness < self.max_staleness:
            raise ValueError(
                f"replay_max_staleness ({self.replay_max_staleness}) is below max_staleness "
                f"({self.max_staleness}): replayed groups would be held to a tighter bound than "
                "fresh ones; raise it or leave it unset"
            )
        return self

    @property
    def replay_bound(self) -> int:
        """Largest staleness of a replayed acked group."""
        bound = self.replay_max_staleness
        return self.max_staleness if bound is None else bound


class PolicyConfig(PolicySettings):
    """One trained policy: its vocabulary, staleness bound and buffer cap."""

    vocab_size: int = Field(ge=1)
    """Token ids must be below this; a sample with a larger id is refused."""


class SourceConfig(ConfigModel):
    """One task source: where rows come from and which workflow runs them."""

    name: Name
    """Source name; the prefix of its task ids (``name/row_id@eN``)."""
    type: Literal["jsonl", "parquet", "hf", "generator"]
    """jsonl / parquet file, a Hugging Face ``datasets`` dataset, or a registered generator."""
    path: str | None = None
    """File (jsonl, parquet), or a datasets name / ``save_to_disk`` directory (hf)."""
    split: str = "train"
    """Split to load for ``hf`` sources given by name."""
    hf_config: str | None = None
    """Dataset configuration name for ``hf`` sources given by name."""
    generator: Annotated[PluginSpec | str | None, GENERATOR_SPEC] = None
    """Generator spec from ``astraflow.workflows.tasks.GENERATORS`` (type: generator)."""
    limit: int | None = Field(default=None, ge=1)
    """Use the first ``limit`` rows only (required for generators that never end)."""
    id_field: str | None = None
    """Row field holding a stable id (default: the row index; generators: ``id`` if present)."""
    workflow: Name
    """Workflow that runs these tasks (a node must declare it)."""
    policies: list[Name] = Field(min_length=1)
    """Policies whose samples the workflow produces (backpressure and staleness admission)."""
    group_size: int = Field(default=1, ge=1, le=1024)
    """Samples per policy per task (one GRPO group)."""
    epochs: int | None = Field(default=1, ge=1)
    """Passes over the source (None: unbounded)."""
    weight: float = Field(default=1.0, gt=0)
    """Share of tasks this source gets relative to the other sources."""

    @model_validator(mode="after")
    def _check_kind(self) -> SourceConfig:
        if self.type in ("jsonl", "parquet") and not self.path:
            raise ValueError(f"source {self.name!r}: type {self.type} needs 'path'")
        if self.type == "generator" and self.generator is None:
            raise ValueError(f"source {self.name!r}: type generator needs 'generator'")
        return self


class LeaseConfig(ConfigModel):
    """Task leases."""

    ttl_s: float = Field(default=60.0, gt=0)
    """A lease expires this long after it was granted or last renewed; the task is re-queued."""
    max_attempts: int = Field(default=3, ge=1)
    """Failures (reported with ``fail``) after which a task is failed for good."""
    retry_after_s: float = Field(default=1.0, ge=0)
    """What a lease reply with no task tells the node to wait before asking again."""


class RegulationSettings(ConfigModel):
    """How lease sizes follow each node's measured rate (what a run config sets)."""

    sync_lease_hold_s: float = Field(default=2.0, ge=0, le=10)
    """A lease the sync round (or, async, the staleness budget) leaves empty waits this long
    for the round to change (opened, tasks re-queued) or a trainer to take or announce before
    it answers, so nodes start work at once (0: never)."""
    window_s: float = Field(default=30.0, gt=0)
    """A node may hold about what it finishes in this long."""
    min_lease: int = Field(default=1, ge=1)
    """Leases a node may always hold, whatever its measured rate."""
    initial_lease: int | None = Field(default=None, ge=1)
    """Leases a node with no measured rate may hold (None: whatever capacity it asks for)."""


class RegulationConfig(RegulationSettings):
    """Regulation mode and round size (a launcher sets both from the run), and lease sizing."""

    mode: Literal["async", "sync"] = "async"
    """async: the dataflow way; sync: trainer-centred lock-step rounds (see dataflow/rounds.py)."""
    sync_round_tasks: int | None = Field(default=None, ge=1)
    """Tasks per sync round (one full batch per policy); required in sync mode."""

    @model_validator(mode="after")
    def _check_mode(self) -> RegulationConfig:
        if self.mode == "sync" and self.sync_round_tasks is None:
            raise ValueError("regulation.mode 'sync' needs regulation.sync_round_tasks")
        return self


class ReportConfig(ConfigModel):
    """Rates and the dead-band rule for the target rollout-pool size."""

    window_s: float = Field(default=60.0, gt=0)
    """Rates and waiting fractions are measured over this trailing window."""
    band: tuple[float, float] = (0.1, 0.3)
    """Trainer waiting fraction [low, high]: above high scale up, below low scale down."""
    scale_down_after_s: float = Field(default=120.0, ge=0)
    """Waiting must stay below the band this long before the target shrinks."""
    step: int = Field(default=1, ge=1)
    """Nodes added or removed per decision."""
    min_nodes: int = Field(default=1, ge=0)
    """The target never goes below this."""
    max_nodes: int = Field(default=64, ge=1)
    """The target never goes above this."""

    @model_validator(mode="after")
    def _check(self) -> ReportConfig:
        low, high = self.band
        if not 0 <= low <= high <= 1:
            raise ValueError(f"band must satisfy 0 <= low <= high <= 1, got {self.band}")
        if self.min_nodes > self.max_nodes:
            raise ValueError("min_nodes is larger than max_nodes")
        return self


class DashboardConfig(ConfigModel):
    """The live dashboard at ``/dashboard`` (same tokens as the API; a read token is enough)."""

    enabled: bool = True
    """Serve the dashboard and keep its history of report snapshots."""
    sample_s: float = Field(default=1.0, ge=0.1, le=60)
    """Seconds between two report snapshots of the history."""
    history: int = Field(default=3600, ge=10, le=100_000)
    """Report snapshots (and, apart, posted metric points) kept in memory."""
    session_ttl_s: float = Field(default=43_200.0, gt=0)
    """How long a browser session (a cookie given for a valid token) lasts."""


ENV_TOKENS: dict[Role, str] = {
    "node": "ASTRAFLOW_NODE_TOKEN",
    "trainer": "ASTRAFLOW_TRAINER_TOKEN",
    "admin": "ASTRAFLOW_ADMIN_TOKEN",
    "read": "ASTRAFLOW_READ_TOKEN",
}


class AuthConfig(ConfigModel):
    """Bearer tokens per role. With none set, the service is open; with any set, every request
    but ``/v1/health`` needs a token, and a role's token only opens that role's endpoints."""

    node: SecretStr | None = None
    """Token of rollout nodes (default: env ASTRAFLOW_NODE_TOKEN)."""
    trainer: SecretStr | None = None
    """Token of trainers (default: env ASTRAFLOW_TRAINER_TOKEN)."""
    admin: SecretStr | None = None
    """Token that may call everything (default: env ASTRAFLOW_ADMIN_TOKEN)."""
    read: SecretStr | None = None
    """Read-only token: the report, versions, metrics and the dashboard (default: env
    ASTRAFLOW_READ_TOKEN)."""

    def tokens(self) -> dict[Role, str]:
        """Configured tokens per role, falling back to the environment."""
        return role_tokens(self, ENV_TOKENS)


class LimitsConfig(ConfigModel):
    """Request limits."""

    max_body_mb: float = Field(default=64.0, gt=0)
    """Larger request bodies are refused with 413 before they are read."""
    max_take_timeout_s: float = Field(default=120.0, gt=0)
    """Longest long-poll a take may wait (the request's timeout_s is capped to it)."""
    max_decoding_mb: float = Field(default=128.0, gt=0)
    """Large bodies (over 64 kB) read, decoded and applied at once, in MB (JSON counts 4x);
    a body beyond it waits (unread: TCP holds it back) up to ``busy_wait_s``, then is answered
    503 with ``retry_after_s``. Bounds the service's memory."""
    busy_wait_s: float = Field(default=2.0, ge=0, le=60)
    """How long a large body waits for the decoding budget before its 503."""
    busy_retry_after_s: float = Field(default=1.0, gt=0, le=60)
    """The ``retry_after_s`` a 503 for a body over ``max_decoding_mb`` names."""

    @model_validator(mode="after")
    def _cap_holds_a_body(self) -> LimitsConfig:
        if self.max_decoding_mb < self.max_body_mb:
            raise ValueError(
                f"max_decoding_mb ({self.max_decoding_mb}) must be at least max_body_mb "
                f"({self.max_body_mb}): a body of the largest size could never be decoded"
            )
        return self


class DataflowConfig(ConfigModel):
    """The dataflow service: task sources, policies, plug-ins, leases, regulation, report."""

    run_dir: Path = Path("runs/dataflow")
    """Directory of the state database (``dataflow.sqlite``) and the resolved config."""
    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = Field(default=8600, ge=0, le=65535)
    """TCP port to listen on."""
    seed: int = 0
    """Run seed: plug-in RNGs and shuffles derive from it."""
    policies: dict[Name, PolicyConfig] = Field(min_length=1)
    """Trained policies by name; samples of any other policy are refused."""
    sources: list[SourceConfig] = Field(default_factory=list)
    """Task sources (names must be unique)."""
    selector: SelectorField = "shuffled"
    """TaskSelector: sequential, shuffled, curriculum, greso, or package.module:Class."""
    filters: FilterList = Field(default_factory=list)
    """TrajectoryFilters applied in order to every group: dynamic_sampling, length, ..."""
    sampler: SamplerField = "fifo"
    """BatchSampler: fifo, freshest, edf, replay, mixing, or package.module:Class."""
    lease: LeaseConfig = LeaseConfig()
    """Task leases."""
    regulation: RegulationConfig = RegulationConfig()
    """Lease sizing by measured node rate."""
    report: ReportConfig = ReportConfig()
    """Rates and the target rollout-pool size."""
    auth: AuthConfig = AuthConfig()
    """Bearer tokens per role."""
    limits: LimitsConfig = LimitsConfig()
    """Request limits."""
    dashboard: DashboardConfig = DashboardConfig()
    """The live dashboard at ``/dashboard``."""

    @field_validator("selector", "sampler", mode="before")
    @classmethod
    def _coerce_spec(cls, v: Any) -> Any:
        return PluginSpec.coerce(v) if isinstance(v, dict) else v

    @model_validator(mode="after")
    def _check_refs(self) -> DataflowConfig:
        names = [s.name for s in self.sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"source names must be unique, repeated: {', '.join(dupes)}")
        for s in self.sources:
            unknown = [p for p in s.policies if p not in self.policies]
            if unknown:
                raise ValueError(
                    f"source {s.name!r} names undeclared policies {unknown}; "
                    f"declared: {sorted(self.policies)}"
                )
        if self.regulation.mode == "sync":
            fed = {p for s in self.sources for p in s.policies}
            idle = sorted(set(self.policies) - fed)
            if idle:
                raise ValueError(
                    f"regulation.mode 'sync' steps every policy in lock-step, but no source "
                    f"produces samples for {idle}"
                )
        sampler = self.sampler if isinstance(self.sampler, str) else self.sampler.type
        if sampler == "replay" and not any(p.retain_acked for p in self.policies.values()):
            raise ValueError("sampler 'replay' needs policies.<name>.retain_acked > 0")
        return self

    @property
    def db_path(self) -> Path:
        """The SQLite state database."""
        return self.run_dir / "dataflow.sqlite"
