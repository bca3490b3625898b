"""Heterogeneous pools: the pool section's typed options, the CPU quota a slowed node runs
under (a real cgroup v1, when this machine lets us make one), and the error without one."""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

import pytest

from astraflow.errors import ConfigError
from astraflow.launch.cgroups import CPU_ROOT, CpuQuotas, check_cpu_cgroups
from astraflow.launch.config import PoolSection
from astraflow.launch.processes import Proc
from astraflow.link import LinkConfig


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
    spin = "import time\nt = time.time()\nwhile time.time() - t < 1.0:\n    pass\n"
    try:
        cgroup = quotas.create("spinner", 0.25)
        proc = Proc("spinner", "node", [sys.executable, "-c", spin], tmp_path / "spin.log",
                    restart=False, cgroup=cgroup)  # fmt: skip
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        proc.start()
        assert proc.wait(30) == 0
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        stat = dict(line.split() for line in (cgroup / "cpu.stat").read_text().splitlines())
        throttled = int(stat["nr_throttled"])
    finally:
        quotas.close()
    # the quota caps CPU at 0.25 of wall time (one 100 ms period of slack), whatever the load
    assert cpu <= 0.25 * wall + 0.15 and throttled >= 1
    assert not quotas.base.exists()
