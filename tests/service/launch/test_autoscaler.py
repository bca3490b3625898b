"""The launcher's autoscaler against a real dataflow service: no flapping.

Nodes here are ids the pool manager starts and stops (what a node *does* is not under
test); whether a node is *seen* is decided by that id calling the real service.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from astraflow.dataflow.client import DataflowClient
from astraflow.launch.config import AutoscaleConfig, PoolSection
from astraflow.launch.pools import PoolManager, PoolState, autoscale_decision
from astraflow.records import LeaseRequest, PoolSize
from fixtures.dataflow import make_config


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Nodes:
    """Start/stop/alive callables recording what the manager did."""

    def __init__(self) -> None:
        self.alive: set[str] = set()
        self.started: list[str] = []
        self.stopped: list[str] = []

    def start(self, pool: PoolSection) -> str:
        node_id = f"{pool.name}-{len(self.started)}"
        self.started.append(node_id)
        self.alive.add(node_id)
        return node_id

    def stop(self, node_id: str) -> None:
        self.stopped.append(node_id)
        self.alive.discard(node_id)


def seen(client: DataflowClient, node_id: str) -> None:
    client.lease(LeaseRequest(node_id=node_id, pool="local", capacity=0, workflows=["rlvr"]))


def test_a_starting_node_is_counted_and_never_retired_young(
    tmp_path: Path, dataflow_factory: Callable[..., str]
) -> None:
    url = dataflow_factory(make_config(tmp_path / "df"))  # no trainer: the dead band holds
    nodes, clock = Nodes(), Clock()
    pool = PoolSection(name="local", nodes=2, min_nodes=1, max_nodes=4)
    config = AutoscaleConfig(enabled=True, interval_s=1, scale_down_delay_s=60)
    with DataflowClient(url) as client:
        manager = PoolManager(client, [pool], nodes.start, nodes.stop,
                              lambda n: n in nodes.alive, config, clock=clock)  # fmt: skip
        manager.start()
        assert nodes.started == ["local-0", "local-1"]
        seen(client, "local-0")  # local-1 is still loading its model: not seen yet
        for _ in range(5):
            clock.t += 3
            manager.tick()
        assert nodes.stopped == [], manager.decisions  # observed 1 + starting 1 = desired 2
        assert client.pool_sizes().pools["local"].desired == 2
        assert manager.decisions == []


def decide(
    desired: int, observed: int, target: int, running: int, oldest: float, since: float
) -> int | None:
    pool = PoolSection(name="p", min_nodes=1, max_nodes=4)
    config = AutoscaleConfig(enabled=True, scale_up_delay_s=30, scale_down_delay_s=120)
    size = PoolSize(pool="p", desired=desired, observed=observed, target=target)
    got = autoscale_decision(pool, PoolState(size, running, oldest, since), config)
    return None if got is None else got[0]


def test_decisions_count_starting_nodes_and_honour_the_delays() -> None:
    assert decide(2, 1, 1, running=2, oldest=500, since=500) is None  # hold: 1 starting
    assert decide(2, 2, 3, running=2, oldest=500, since=500) == 3  # grow
    assert decide(2, 1, 2, running=2, oldest=500, since=500) is None  # grow: wait for it
    assert decide(2, 2, 3, running=2, oldest=500, since=10) is None  # grew 10 s ago
    assert decide(3, 3, 2, running=3, oldest=500, since=500) == 2  # shrink
    assert decide(3, 3, 2, running=3, oldest=500, since=60) is None  # resized 60 s ago
    assert decide(3, 3, 2, running=3, oldest=100, since=500) is None  # every node too young
    assert decide(4, 4, 5, running=4, oldest=500, since=500) is None  # max_nodes
    assert decide(1, 1, 0, running=1, oldest=500, since=500) is None  # min_nodes
