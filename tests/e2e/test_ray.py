"""The reduced quickstart with every component a Ray actor on a local Ray (2 CPUs)."""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from astraflow.dataflow.client import DataflowClient
from astraflow.errors import AstraflowError, ConfigError
from astraflow.launch.status import RunStatus
from fixtures.launch import (
    assert_quickstart_learned,
    processes_mentioning,
    reduced_quickstart,
)

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

ray = pytest.importorskip("ray", reason="needs the ray extra")
psutil = pytest.importorskip("psutil", reason="ray's own dependency")


def _descendants(seen: dict[int, tuple[Any, set[str]]]) -> None:
    """Record every process the run has started so far, with each name it has had (a Ray
    worker is 'ray::IDLE' before it hosts an actor)."""
    for proc in psutil.Process().children(recursive=True):
        seen.setdefault(proc.pid, (proc, set()))[1].add(_name(proc))


def _running(procs: dict[int, tuple[Any, set[str]]]) -> list[str]:
    left = []
    for proc, _ in procs.values():
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return left


@pytest.mark.timeout(150)
def test_reduced_quickstart_on_local_ray(tmp_path: Path) -> None:
    from astraflow.launch.ray import RayRun  # imports ray

    run_dir = tmp_path / "qs"
    config = reduced_quickstart(
        run_dir,
        "ray.num_cpus=2",
        "ray.resources.node.num_cpus=0.5",  # room for a second node next to the trainer
        "serve_weights=true",  # nodes pull weights from the weight-server actor over HTTP
        steps=250,
    )
    run = RayRun(config)
    client = DataflowClient(run.plan.dataflow_url, timeout_s=10)
    seen: dict[int, tuple[Any, set[str]]] = {}  # every process the run started
    resize = _Resize(client)

    def on_tick(status: RunStatus) -> None:
        _descendants(seen)
        resize.tick(status)

    run.on_tick = on_tick
    try:
        result = run.run(threading.Event())
    finally:
        client.close()

    assert result.reason == "finished", (result, _logs(run_dir))
    assert not ray.is_initialized()
    # every component ran in-process in a Ray actor's worker that this run started
    actors = {}
    for log in (run_dir / "logs").glob("*.log"):
        match = re.search(r"ray actor pid (\d+)", log.read_text())
        assert match is not None, f"{log.name} was not written by a ray actor"
        actors[log.stem] = int(match.group(1))
    assert set(actors) >= {"dataflow", "weights", "trainer-policy", "eval-policy"}, actors
    for name, pid in actors.items():
        assert pid in seen and any("ComponentActor" in n for n in seen[pid][1]), (name, seen)
    # the pool manager grew and shrank the pool with Ray actors (what `astraflow pool add`
    # and `pool remove` ask for); the retired node stopped gracefully
    assert resize.phase == "done", resize.phase
    assert resize.sizes[-1] == 1 and max(resize.sizes) == 2, resize.sizes
    node_logs = sorted((run_dir / "logs").glob("node-*.log"))
    assert len(node_logs) == 2
    assert all("exited" in log.read_text() for log in node_logs)
    assert_quickstart_learned(run_dir, steps=250)
    # each actor wrote its component's log where a local process would
    assert "trainer ready" in (run_dir / "logs/trainer-policy.log").read_text()
    # nothing is left: not Ray's processes, not the actors' workers
    assert _running(seen) == []
    assert processes_mentioning(str(run_dir)) == []


class _Resize:
    """Once training runs, add a node to the pool, wait for it to lease, then remove one."""

    def __init__(self, client: DataflowClient) -> None:
        self.client = client
        self.phase = "wait"
        self.sizes: list[int] = []

    def tick(self, status: RunStatus) -> None:
        running = status.pools["local"][0]
        self.sizes.append(running)
        report = status.report.pools.get("local") if status.report is not None else None
        if self.phase == "wait" and status.policies["policy"].version >= 20:
            assert self.client.set_pool_size("local", delta=1).desired == 2
            self.phase = "grow"
        elif self.phase == "grow" and report is not None and report.nodes == 2:
            assert self.client.set_pool_size("local", delta=-1).desired == 1
            self.phase = "shrink"
        elif self.phase == "shrink" and running == 1:
            self.phase = "done"


def _name(proc: Any) -> str:
    try:
        return " ".join(proc.cmdline()) or proc.name()
    except psutil.NoSuchProcess:
        return "?"


def _logs(run_dir: Path) -> str:
    out = []
    for log in sorted((run_dir / "logs").glob("*.log")):
        out.append(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-15:]))
    return "\n".join(out)


@pytest.mark.timeout(90)
def test_a_component_the_cluster_cannot_place_fails_the_run_clearly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from astraflow.launch.ray import RayRun

    run_dir = tmp_path / "unplaceable"
    config = reduced_quickstart(
        run_dir,
        "ray.num_cpus=2",
        "ray.resources.trainer.resources={nowhere: 1}",  # no machine offers it
        "ray.place_timeout_s=3",
        "eval=[]",
    )
    with caplog.at_level(logging.ERROR, logger="astraflow.launch.processes"):
        result = RayRun(config).run(threading.Event())
    assert result.reason == "failed" and result.failed == ["trainer-policy"], result
    assert "trainer-policy failed" in caplog.text
    assert "not placed on the Ray cluster" in caplog.text and "'nowhere': 1" in caplog.text
    assert not ray.is_initialized()


@pytest.mark.timeout(90)
def test_only_waiting_for_resources_counts_against_the_placement_timeout(tmp_path: Path) -> None:
    """An actor the cluster has room for is placed at once; its worker process may then take
    seconds to start on a loaded machine (CI failed a run so: the dataflow, asking for no
    CPU, "not placed after 3s"). Only an ask the free resources cannot hold times out."""
    from astraflow.launch.config import RaySection
    from astraflow.launch.ray import RayComponent, ray_cluster

    def component(name: str, **ask: Any) -> RayComponent:
        return RayComponent(
            name, "dataflow", "", {}, ask, tmp_path / f"{name}.log", str(tmp_path),
            place_timeout_s=0.001,
        )  # fmt: skip

    with ray_cluster(RaySection(num_cpus=2)):
        starting = component("starting", num_cpus=0, num_gpus=0)
        unplaceable = component("unplaceable", num_cpus=1, num_gpus=0, resources={"nowhere": 1})
        try:
            starting.place()
            unplaceable.place()
            time.sleep(0.01)  # past the timeout; a worker process takes longer to start
            assert not starting._placement_overdue()
            assert unplaceable._placement_overdue()
            host, port = starting.endpoint(0.001)  # waits for the process, not the timeout
            assert host and port > 0
            with pytest.raises(AstraflowError, match=r"unplaceable: not placed .*'nowhere': 1"):
                unplaceable.endpoint(0.001)
        finally:
            starting.kill()
            unplaceable.kill()
    assert not ray.is_initialized()


def test_ray_section_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown component kind\(s\) \['gpu'\]"):
        reduced_quickstart(tmp_path, "ray.resources.gpu.num_cpus=1")
    with pytest.raises(ConfigError, match="'node:fast' names no pool"):
        reduced_quickstart(tmp_path, "ray.resources.node:fast.num_gpus=1")
    with pytest.raises(ConfigError, match="Ray Client"):
        reduced_quickstart(tmp_path, "ray.address=ray://head:10001")
    config = reduced_quickstart(tmp_path, "ray.resources.node:local.num_gpus=1")
    assert config.ray.actor_resources("node", "local").num_gpus == 1
    assert config.ray.actor_resources("trainer").num_cpus == 1  # the default
    assert config.ray.actor_resources("dataflow").num_cpus == 0
