"""The dataflow's report and admin records: ``GET /v1/report``, ``/v1/admin/pools``.

What autoscalers, dashboards and the launcher read; the service builds them in
``dataflow/report.py`` and ``metrics.py`` renders the same snapshot as Prometheus gauges.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field

from astraflow.records.validators import exactly_one
from astraflow.records.wire import Name, NodeStats, Record

# --------------------------------------------------------------------------- dataflow report

#: Bins of :attr:`PolicyReport.served_staleness`.
STALENESS_BINS: Final = 32


class NodeReport(Record):
    """One rollout node, as the dataflow service has measured it."""

    node_id: Name
    pool: Name
    samples_per_s: float = Field(ge=0)
    """Samples submitted per second over the report window."""
    tasks_per_s: float = Field(ge=0)
    """Tasks completed per second over the report window."""
    leased: int = Field(ge=0)
    """Tasks the node holds now."""
    completed: int = Field(ge=0)
    failures: int = Field(ge=0)
    """Tasks the node reported as failed."""
    lease_expiries: int = Field(ge=0)
    """Leases of this node that expired (tasks re-queued)."""
    last_seen_s: float = Field(ge=0)
    """Seconds since the node last called the service."""
    stats: NodeStats = Field(default_factory=NodeStats)
    """What the node last reported about itself."""


class PoolReport(Record):
    """All nodes that report the same pool label."""

    pool: Name
    nodes: int = Field(ge=0)
    """Nodes seen within one lease ttl."""
    samples_per_s: float = Field(ge=0)
    tasks_per_s: float = Field(ge=0)
    leased: int = Field(ge=0)
    """Tasks in flight in this pool."""
    failures: int = Field(ge=0)
    lease_expiries: int = Field(ge=0)
    desired_nodes: int | None = Field(default=None, ge=0)
    """Node count an admin or autoscaler asked for (``POST /v1/admin/pools``; None: not set)."""
    target_nodes: int | None = Field(default=None, ge=0)
    """The dead-band rule applied to this pool: ``nodes`` +/- step, within min/max nodes."""


class PolicyReport(Record):
    """One policy's buffer."""

    policy: Name
    latest_version: int | None = None
    """Latest announced version (None: none yet)."""
    buffered_samples: int = Field(ge=0)
    """Samples waiting to be served."""
    buffered_groups: int = Field(ge=0)
    served_samples: int = Field(ge=0)
    """Samples in batches served and not yet acked."""
    in_flight_samples: int = Field(ge=0)
    """Samples expected from leased tasks."""
    max_buffered: int = Field(ge=0)
    """Backpressure cap on buffered + served + in-flight samples."""
    stale_dropped_samples: int = Field(ge=0)
    """Samples dropped because they exceeded max_staleness."""
    filtered_samples: int = Field(ge=0)
    """Samples whose group a trajectory filter dropped."""
    acked_samples: int = Field(ge=0)
    final: bool = False
    """Its trainer announced its final version: samples are no longer buffered."""
    sample_metrics: dict[str, float] = Field(default_factory=dict)
    """Means of the workflows' per-sample figures (``sample.meta['metrics']``, e.g. the ``env``
    workflow's ``env/success``, ``env/turns``) over the last samples ingested."""
    reward_mean: float | None = None
    """Mean reward of the last samples ingested (None before the first)."""
    served_staleness: list[int] = Field(default_factory=list, max_length=STALENESS_BINS)
    """Samples served in batches since the service started, by staleness (index: versions
    behind the trainer; the last bin also counts anything staler)."""


class TrainerReport(Record):
    """One trainer, as seen through its take_batch calls."""

    trainer_id: Name
    policy: Name
    samples_per_s: float = Field(ge=0)
    """Samples served to this trainer per second over the report window."""
    waiting_fraction: float = Field(ge=0, le=1)
    """Fraction of the window the trainer spent waiting inside take_batch."""
    version: int = Field(ge=0)
    """trainer_version of its latest take_batch."""
    batches: int = Field(ge=0)


class TaskQueueReport(Record):
    """Task counts by state."""

    pending: int = Field(ge=0)
    """Re-queued tasks waiting for a node."""
    leased: int = Field(ge=0)
    done: int = Field(ge=0)
    failed: int = Field(ge=0)
    exhausted: bool = False
    """Every source has used up its epochs and no task is open."""


class PoolTarget(Record):
    """The rollout-pool size the dead-band rule on trainer waiting asks for."""

    current_nodes: int = Field(ge=0)
    target_nodes: int = Field(ge=0)
    waiting_fraction: float | None = None
    """Highest waiting fraction among active trainers (None: no trainer activity)."""
    band: tuple[float, float]
    reason: str
    decided_at: float | None = None
    """When the service's sweep made this decision (reading the report decides nothing)."""


class RoundTiming(Record):
    """One synchronous round: its tasks and when it opened, had all its data, and closed."""

    round: int = Field(ge=0)
    """Round r serves trainers at version r and needs nodes holding version r."""
    tasks: int = Field(ge=0)
    """Tasks of the round (carried-over and top-up tasks included)."""
    topups: int = Field(default=0, ge=0)
    """Times the round's quota grew because a trajectory filter left a policy without data."""
    opened_at: float | None = None
    """When every policy had announced version ``round`` (tasks could be leased from then on)."""
    data_complete_at: float | None = None
    """When every round task was submitted or failed for good (round batches servable)."""
    closed_at: float | None = None
    """When every policy had announced version ``round + 1``."""


class SyncReport(Record):
    """Synchronous regulation: the current round and the timings of past ones."""

    round: int = Field(ge=0)
    state: Literal["waiting", "open", "complete"]
    """waiting: for trainers to announce version ``round``; open: tasks are leased and run;
    complete: the round's data is all in, trainers train on it and announce ``round + 1``."""
    quota: int = Field(ge=0)
    """Tasks the round leases (``sync_round_tasks``, plus one more per top-up)."""
    tasks: int = Field(ge=0)
    """Tasks of the round so far."""
    open_tasks: int = Field(ge=0)
    """Round tasks pending or leased."""
    waiting_for: list[Name] = Field(default_factory=list)
    """Policies whose announced version holds the round back (waiting or complete state)."""
    current: RoundTiming
    history: list[RoundTiming] = Field(default_factory=list)
    """The latest closed rounds, oldest first (at most 100)."""
    closed_rounds: int = Field(default=0, ge=0)
    """Rounds closed since the run began."""
    rollout_s: float = Field(default=0.0, ge=0)
    """Total over closed rounds of opened -> data complete (trainers wait, rollout works)."""
    train_s: float = Field(default=0.0, ge=0)
    """Total over closed rounds of data complete -> closed (rollout waits, trainers work)."""


class DataflowReport(Record):
    """``GET /v1/report``: what autoscalers and dashboards read (also as Prometheus gauges)."""

    time: float
    uptime_s: float = Field(ge=0)
    window_s: float = Field(gt=0)
    """Rates and fractions are measured over this trailing window."""
    tasks: TaskQueueReport
    pools: dict[str, PoolReport] = Field(default_factory=dict)
    nodes: dict[str, NodeReport] = Field(default_factory=dict)
    policies: dict[str, PolicyReport] = Field(default_factory=dict)
    trainers: dict[str, TrainerReport] = Field(default_factory=dict)
    target: PoolTarget
    plugins: dict[str, dict[str, float]] = Field(default_factory=dict)
    """Each plug-in's ``metrics()`` by its place (``selector``, ``filter.0``, ``sampler``)."""
    pool_targets: dict[str, PoolTarget] = Field(default_factory=dict)
    """The dead-band rule per pool (``current_nodes``: the pool's active nodes); what an
    autoscaler follows. Equals ``target`` when there is one pool."""
    mode: Literal["async", "sync"] = "async"
    """Regulation mode of the service (``regulation.mode``)."""
    sync: SyncReport | None = None
    """The round state (sync mode only)."""


# --------------------------------------------------------------------------- admin

#: Largest node count (or change of it) a pool size request may name.
MAX_POOL_NODES: Final = 100_000


class PoolSizeRequest(Record):
    """Admin: set a pool's desired node count, absolutely (``nodes``) or relatively (``delta``)."""

    pool: Name
    nodes: int | None = Field(default=None, ge=0, le=MAX_POOL_NODES)
    """New desired node count."""
    delta: int | None = Field(default=None, ge=-MAX_POOL_NODES, le=MAX_POOL_NODES)
    """Change of the desired count (from the observed count if none was set); floored at 0."""

    _one_of = exactly_one(
        "nodes", "delta", "give exactly one of 'nodes' (absolute) and 'delta' (relative)"
    )


class PoolSize(Record):
    """One pool's desired, observed and dead-band target node counts."""

    pool: Name
    desired: int | None = Field(default=None, ge=0)
    """What an admin or autoscaler asked for (None: never set); provisioners follow it."""
    observed: int = Field(ge=0)
    """Nodes of the pool seen within one lease ttl."""
    target: int = Field(ge=0)
    """The dead-band rule on trainer waiting applied to this pool (what an autoscaler follows)."""


class PoolSizes(Record):
    """``GET /v1/admin/pools``: every pool with a desired size or an observed node."""

    pools: dict[Name, PoolSize] = Field(default_factory=dict)


#: Most figures one metric point may carry, and most points one post may carry.
MAX_POINT_VALUES: Final = 64
MAX_POINTS: Final = 1000


class MetricPoint(Record):
    """Figures of one policy version from outside the dataflow (e.g. held-out accuracy)."""

    policy: Name
    source: Name
    """What measured them: ``eval``, ``trainer`` ..."""
    version: int = Field(ge=0)
    """The policy version they describe."""
    time: float = Field(ge=0)
    """Wall time (seconds since the epoch) they were measured."""
    values: dict[Name, float] = Field(max_length=MAX_POINT_VALUES)
    """Figure name → value (finite)."""


class MetricPoints(Record):
    """Admin: ``POST /v1/admin/metrics``, points the dashboard plots beside the report."""

    points: list[MetricPoint] = Field(max_length=MAX_POINTS)
