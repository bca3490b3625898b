"""Slow a rollout pool down with the OS: a cgroup v1 CPU quota per node process.

A pool with ``speed < 1`` runs each node in its own cgroup under the ``cpu`` controller,
``<mount>/astraflow/<run>/<node>``, whose CFS quota is ``speed x cpus`` of every period
(``cpus``: the node's torch threads). The launcher moves the node process (all its threads,
and every process it has started: an engine process, sandboxes, environment servers) into it
once the node is ready; the directories are removed when the run ends::

    /sys/fs/cgroup/cpu/astraflow/<run>/            (no limit)
        <node>/  cpu.cfs_period_us = 100000, cpu.cfs_quota_us = speed x cpus x 100000

Needs Linux, a cgroup v1 ``cpu`` controller mounted at ``/sys/fs/cgroup/cpu`` and the right
to create directories there (root); ``check_cpu_cgroups`` says which is missing.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from astraflow.cgroupfs import remove_cgroup
from astraflow.errors import ConfigError

__all__ = ["CPU_ROOT", "CpuQuotas", "check_cpu_cgroups", "descendants", "move_to_cgroup"]

log = logging.getLogger(__name__)

#: Where the cgroup v1 cpu controller is mounted.
CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def check_cpu_cgroups(root: Path = CPU_ROOT) -> None:
    """Raise ``ConfigError`` naming what is missing unless CPU quotas can be set under ``root``."""
    why = None
    if not root.is_dir():
        why = f"no cgroup v1 cpu controller mounted at {root}"
        if Path("/sys/fs/cgroup/cgroup.controllers").exists():
            why += " (this machine uses cgroup v2, which astraflow does not drive)"
    elif not (root / "cpu.cfs_quota_us").exists():
        why = f"{root} has no cpu.cfs_quota_us (the CFS bandwidth controller is not enabled)"
    elif not os.access(root, os.W_OK):
        why = f"{root} is not writable by this user (creating cgroups needs root)"
    if why is not None:
        raise ConfigError(
            f"pool speed below 1 slows nodes with a cgroup CPU quota, but {why}; "
            "set every pool's speed to 1.0 or run where cgroups are available"
        )


class CpuQuotas:
    """The cgroups of one run's slowed nodes (created on demand, removed by ``close``)."""

    def __init__(self, run: str, root: Path = CPU_ROOT) -> None:
        self.base = root / "astraflow" / "".join(c if c.isalnum() else "-" for c in run)[-64:]
        self._made: list[Path] = []

    def create(self, name: str, cpus: float) -> Path:
        """A cgroup for one process limited to ``cpus`` CPUs; returns its directory."""
        check_cpu_cgroups(self.base.parents[1])
        path = self.base / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(max(1000, int(cpus * PERIOD_US))))
        self._made.append(path)
        log.info("cgroup %s: %.2f CPUs", path, cpus)
        return path

    def stats(self) -> dict[str, dict[str, int]]:
        """``cpu.stat`` of every cgroup made (periods, periods throttled, ns throttled)."""
        out = {}
        for path in self._made:
            try:
                text = (path / "cpu.stat").read_text()
            except OSError:
                continue
            out[path.name] = {k: int(v) for k, v in (line.split() for line in text.splitlines())}
        return out

    def close(self) -> None:
        """Remove every cgroup made (their processes must have ended)."""
        for path in reversed(self._made):
            remove_cgroup(path, kill=False, attempts=21, pause_s=0.05)
        self._made.clear()
        remove_cgroup(self.base, kill=False, attempts=21, pause_s=0.05)
        with contextlib.suppress(OSError):  # shared with other runs: only when empty
            self.base.parent.rmdir()


def move_to_cgroup(path: Path, pid: int) -> None:
    """Move process ``pid`` (every thread of it) and every process it has started (an engine
    process, a sandbox, an environment server) into the cgroup ``path``; processes started
    from now on are born in it."""
    (path / "cgroup.procs").write_text(str(pid))
    moved = {pid}
    while True:  # again until none is left: a child may have forked before it was moved
        left = [p for p in descendants(pid) if p not in moved]
        if not left:
            return
        for child in left:
            moved.add(child)
            with contextlib.suppress(ProcessLookupError, FileNotFoundError):  # it ended
                (path / "cgroup.procs").write_text(str(child))


def descendants(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """Process ids of every live descendant of ``pid``, read from ``proc`` (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended meanwhile
            continue
        fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
