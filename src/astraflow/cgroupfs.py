"""cgroup directories, shared by the code sandbox (one pids/memory cgroup per program) and the
launcher's per-node CPU quotas: emptying one and removing it once the kernel lets go."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

__all__ = ["kill_members", "remove_cgroup"]


def kill_members(path: Path, *, attempts: int = 50) -> bool:
    """SIGKILL every process listed in the cgroup ``path`` until none is; False when some
    were still listed after ``attempts`` rounds."""
    for _ in range(attempts):
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except OSError:
            return True
        if not pids:
            return True
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    return False


def remove_cgroup(path: Path, *, kill: bool, attempts: int = 50, pause_s: float = 0.01) -> bool:
    """Remove the cgroup directory ``path`` (gone already counts), retrying while the kernel
    still lists a process in it (a process just killed may stay listed for a moment); with
    ``kill``, its members are SIGKILLed between tries. False when it could not be removed."""
    for _ in range(attempts):
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if kill:
                kill_members(path)
            time.sleep(pause_s)
    return False
