"""Heterogeneous pools: the pool section's typed options, the CPU quota a slowed node runs
under (a real cgroup v1, when this machine lets us make one), and the error without one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from astraflow.errors import ConfigError
from astraflow.launch.cgroups import (
    CPU_ROOT,
    CpuQuotas,
    check_cpu_cgroups,
    descendants,
    move_to_cgroup,
)
from astraflow.launch.config import PoolSection
from astraflow.launch.plan import make_plan, node_config
from astraflow.launch.processes import Proc
from astraflow.launch.regions import Regions
from astraflow.link import LinkConfig
from fixtures.launch import reduced_quickstart


def _cgroups_usable() -> bool:
    try:
        check_cpu_cgroups()
    except ConfigError:
        return False
    return True


def test_pool_section_types_speed_link_and_relay() -> None:
    pool = PoolSection.model_validate(
        {"name": "far", "speed": 0.3, "link": {"delay_ms": 150, "rate_mbit": 100}, "relay": True}
    )
    assert pool.speed == 0.3 and pool.link == LinkConfig(delay_ms=150, rate_mbit=100)
    for bad in ({"speed": 0}, {"speed": 1.5}, {"relay": True}, {"link": {"delay_ms": -1}}):
        with pytest.raises(ValueError, match="speed|relay|delay_ms"):
            PoolSection.model_validate(bad)


def test_missing_cgroups_are_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"speed below 1 .* no cgroup v1 cpu controller"):
        check_cpu_cgroups(tmp_path / "cpu")
    (tmp_path / "cpu").mkdir()
    with pytest.raises(ConfigError, match="cfs_quota_us"):
        check_cpu_cgroups(tmp_path / "cpu")


@pytest.mark.skipif(not _cgroups_usable(), reason=f"needs a writable cgroup v1 {CPU_ROOT} (root)")
def test_a_slowed_node_process_gets_its_cpu_quota(tmp_path: Path) -> None:
    quotas = CpuQuotas(f"test-{os.getpid()}")
    ready, go, out = tmp_path / "ready", tmp_path / "go", tmp_path / "cpu"
    # the child spins for 1 s of wall time once moved, and writes the CPU time it got
    spin = (
        "import pathlib, time\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        f"while not pathlib.Path({str(go)!r}).exists():\n    time.sleep(0.01)\n"
        "c, t = time.process_time(), time.time()\n"
        "while time.time() - t < 1.0:\n    pass\n"
        f"pathlib.Path({str(out)!r}).write_text(str(time.process_time() - c))\n"
    )
    try:
        cgroup = quotas.create("spinner", 0.25)
        proc = Proc("spinner", "node", [sys.executable, "-c", spin], tmp_path / "spin.log",
                    restart=False)  # fmt: skip
        proc.start()
        while not ready.exists():  # ready: the launcher moves it then
            assert proc.poll() is None
            time.sleep(0.02)
        assert proc.pid is not None
        move_to_cgroup(cgroup, proc.pid)
        member = Path(f"/proc/{proc.pid}/cgroup").read_text()
        go.touch()
        assert proc.wait(30) == 0
        cpu = float(out.read_text())
        stat = dict(line.split() for line in (cgroup / "cpu.stat").read_text().splitlines())
    finally:
        quotas.close()
    # the process runs in its cgroup, under the quota's periods; the quota caps the spin at
    # 0.25 CPU-s per wall second (one 100 ms period of slack), however loaded the machine
    # is (on a busy machine it may get less, and is then never throttled)
    assert f"/astraflow/test-{os.getpid()}/spinner" in member
    assert cpu <= 0.25 + 0.15 and int(stat["nr_periods"]) >= 1
    assert not quotas.base.exists()


@pytest.mark.skipif(not _cgroups_usable(), reason=f"needs a writable cgroup v1 {CPU_ROOT} (root)")
def test_a_slowed_node_takes_the_processes_it_started_into_its_cgroup(tmp_path: Path) -> None:
    """A node's engine process (``process: true``), sandboxes and environment servers run
    under its quota too: the child and grandchild it started before the move are moved with
    it, and a process it starts afterwards is born in the cgroup."""
    quotas = CpuQuotas(f"test-{os.getpid()}")
    go, pids = tmp_path / "go", tmp_path / "pids"
    # the node forks a child, which forks a grandchild; each notes its pid, then waits; once
    # moved, the node starts one more child
    tree = (
        "import os, pathlib, subprocess, sys, time\n"
        f"go, pids = pathlib.Path({str(go)!r}), pathlib.Path({str(pids)!r})\n"
        "top = os.getpid()\n"
        "if os.fork() == 0:\n    os.fork()\n"
        "with pids.open('a') as f:\n    f.write(f'{os.getpid()}\\n')\n"
        "while not go.exists():\n    time.sleep(0.01)\n"
        "if os.getpid() == top:\n"
        "    late = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "    (pids.parent / 'late').write_text(str(late.pid))\n"
        "    time.sleep(30)\n"
        "else:\n    time.sleep(30)\n"
    )
    procs: list[int] = []
    try:
        cgroup = quotas.create("tree", 0.5)
        proc = Proc("tree", "node", [sys.executable, "-c", tree], tmp_path / "tree.log",
                    restart=False)  # fmt: skip
        proc.start()
        assert proc.pid is not None
        while len(pids.read_text().split() if pids.exists() else []) < 3:
            assert proc.poll() is None, (tmp_path / "tree.log").read_text()
            time.sleep(0.02)
        procs = [int(p) for p in pids.read_text().split()]
        assert proc.pid in procs
        move_to_cgroup(cgroup, proc.pid)
        go.touch()
        while not (tmp_path / "late").exists():
            time.sleep(0.02)
        procs.append(int((tmp_path / "late").read_text()))
        where = f"/astraflow/test-{os.getpid()}/tree"
        for pid in procs:
            assert where in Path(f"/proc/{pid}/cgroup").read_text(), pid
        assert set(procs) - {proc.pid} <= set(descendants(proc.pid))
    finally:
        for pid in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if procs:
            proc.wait(10)
        time.sleep(0.2)  # the orphans are reaped by init
        quotas.close()


def test_remote_pool_nodes_get_the_link_and_relay_urls(tmp_path: Path) -> None:
    link = "{delay_ms: 20, rate_mbit: 50}"
    config = reduced_quickstart(
        tmp_path / "run",
        f"pools=[{{name: local}}, {{name: far, link: {link}, relay: true}}, "
        f"{{name: near, link: {link}}}]",
    )
    plan = make_plan(config, port=8700)
    regions = Regions(config)
    assert regions.remote  # so the weight store is served over HTTP
    relayed = regions.open_links(plan.dataflow_url, "http://127.0.0.1:8020")
    try:
        assert [p.name for p in relayed] == ["far"]
        regions.relays["far"] = "http://127.0.0.1:8021"
        pools = {p.name: p for p in config.pools}
        urls = {}
        for name in ("local", "far", "near"):
            cfg = regions.node_urls(pools[name], node_config(plan, pools[name], weights="W"))
            urls[name] = (cfg.dataflow_url, cfg.weights)
    finally:
        regions.close(tmp_path)
    assert urls["local"] == (plan.dataflow_url, "W")
    far_link = urls["far"][0]
    assert far_link != plan.dataflow_url and urls["far"][1] == "http://127.0.0.1:8021"
    assert urls["near"][0] not in (plan.dataflow_url, far_link)  # a link per pool
    assert urls["near"][1].startswith("http://127.0.0.1:") and urls["near"][1] != "W"
    carried = json.loads((tmp_path / "links.json").read_text())
    assert set(carried) == {"far", "near"} and carried["far"]["config"]["delay_ms"] == 20
