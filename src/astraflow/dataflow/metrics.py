"""Prometheus exposition of the dataflow report (``GET /metrics``).

Gauges are rendered from a ``records.DataflowReport``, the same snapshot ``GET /v1/report``
serves, so the two never disagree. Names: ``astraflow_dataflow_<quantity>_<unit>``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from astraflow.records import DataflowReport

__all__ = ["metrics_text"]


_PREFIX = "astraflow_dataflow_"


class _ReportCollector(Collector):
    def __init__(self, report: DataflowReport) -> None:
        self.report = report

    def collect(self) -> Iterator[GaugeMetricFamily]:
        r = self.report

        def family(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(_PREFIX + name, doc, labels=labels)

        up = family("uptime_seconds", "Seconds since the service started", [])
        up.add_metric([], r.uptime_s)
        yield up
        tasks = family("tasks", "Tasks by state", ["state"])
        for state in ("pending", "leased", "done", "failed"):
            tasks.add_metric([state], getattr(r.tasks, state))
        yield tasks
        yield from _table(r.pools, "pool", ["nodes", "samples_per_s", "leased", "failures",
                                            "lease_expiries"])  # fmt: skip
        yield from _table(r.nodes, "node", ["samples_per_s", "tasks_per_s", "leased",
                                            "failures", "lease_expiries"])  # fmt: skip
        yield from _table(r.policies, "policy", ["buffered_samples", "served_samples",
                                                 "in_flight_samples", "max_buffered",
                                                 "stale_dropped_samples", "filtered_samples",
                                                 "acked_samples"])  # fmt: skip
        yield from _table(r.trainers, "trainer", ["samples_per_s", "waiting_fraction", "version"])
        figures = family(
            "policy_sample_metric", "Mean of a workflow's per-sample figure", ["policy", "name"]
        )
        reward = family("policy_reward_mean", "Mean reward of the last samples ingested",
                        ["policy"])  # fmt: skip
        served = family("policy_served_samples_by_staleness",
                        "Samples served since start, by versions behind the trainer",
                        ["policy", "staleness"])  # fmt: skip
        for policy, report in r.policies.items():
            for name, value in report.sample_metrics.items():
                figures.add_metric([policy, name], value)
            if report.reward_mean is not None:
                reward.add_metric([policy], report.reward_mean)
            for staleness, n in enumerate(report.served_staleness):
                served.add_metric([policy, str(staleness)], n)
        yield figures
        yield reward
        yield served
        target = family("target_nodes", "Rollout nodes the dead-band rule asks for", [])
        target.add_metric([], r.target.target_nodes)
        yield target
        current = family("active_nodes", "Rollout nodes seen within one lease ttl", [])
        current.add_metric([], r.target.current_nodes)
        yield current
        yield from _pool_sizes(r)
        if r.sync is not None:
            yield from _sync(r)
        plugin = family("plugin_metric", "Plug-in metrics() values", ["plugin", "name"])
        for where, values in r.plugins.items():
            for key, value in values.items():
                plugin.add_metric([where, key], value)
        yield plugin


def _pool_sizes(r: DataflowReport) -> Iterator[GaugeMetricFamily]:
    desired = GaugeMetricFamily(
        _PREFIX + "pool_desired_nodes", "Nodes asked for per pool (admin API)", labels=["pool"]
    )
    target = GaugeMetricFamily(
        _PREFIX + "pool_target_nodes", "Dead-band target nodes per pool", labels=["pool"]
    )
    for name, pool in r.pools.items():
        if pool.desired_nodes is not None:
            desired.add_metric([name], pool.desired_nodes)
        if pool.target_nodes is not None:
            target.add_metric([name], pool.target_nodes)
    yield desired
    yield target


def _sync(r: DataflowReport) -> Iterator[GaugeMetricFamily]:
    assert r.sync is not None
    values = {
        "sync_round": ("Current synchronous round", r.sync.round),
        "sync_round_tasks": ("Tasks of the current round", r.sync.tasks),
        "sync_round_open_tasks": ("Round tasks pending or leased", r.sync.open_tasks),
        "sync_rollout_seconds": ("Closed rounds' open -> data complete time", r.sync.rollout_s),
        "sync_train_seconds": ("Closed rounds' data complete -> closed time", r.sync.train_s),
    }
    for name, (doc, value) in values.items():
        fam = GaugeMetricFamily(_PREFIX + name, doc, labels=[])
        fam.add_metric([], value)
        yield fam


_UNITS = {"samples_per_s": "samples_per_second", "tasks_per_s": "tasks_per_second"}


def _table(
    rows: Mapping[str, object], label: str, fields: list[str]
) -> Iterator[GaugeMetricFamily]:
    for f in fields:
        name = f"{label}_{_UNITS.get(f, f)}"
        fam = GaugeMetricFamily(_PREFIX + name, f"{label} {f.replace('_', ' ')}", labels=[label])
        for key, row in rows.items():
            fam.add_metric([key], float(getattr(row, f)))
        yield fam


def metrics_text(report: DataflowReport) -> bytes:
    """Prometheus exposition of a report (the same snapshot the JSON endpoint serves)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ReportCollector(report))
    data: bytes = generate_latest(registry)
    return data
