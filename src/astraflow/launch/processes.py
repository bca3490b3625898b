"""Component processes on this machine: start, watch, stop; nothing outlives the launcher.

Each component runs as ``python -m astraflow <component> --config FILE`` in its own session
(so a terminal's Ctrl-C reaches only the launcher, which stops components in order), with
output in ``<run_dir>/logs/<name>.log`` and, on Linux, a parent-death signal so even a
``kill -9`` of the launcher takes every component down with it.

    start ──► running ──(exit 0)──► done
                 │ (crash)
                 └──► restarted after a back-off, up to ``max_restarts`` times ──► failed
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Proc", "ProcessGroup"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux/glibc: the launcher's own shutdown path still applies
        pass


@dataclass
class Proc:
    """One component process (restarted in place when it crashes)."""

    name: str
    kind: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    restart: bool = True
    """Restart in place after a crash; False: the process is replaceable, a crash is logged
    and the owner (the pool manager) starts a fresh one."""
    max_restarts: int = 3
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    exit_code: int | None = None
    stopping: bool = False

    @property
    def alive(self) -> bool:
        """Whether the process is running."""
        return self.popen is not None and self.popen.poll() is None

    @property
    def pid(self) -> int | None:
        """OS process id (None before start)."""
        return self.popen.pid if self.popen is not None else None

    def start(self) -> None:
        """Start (or restart) the process."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("ab") as out:
            out.write(f"\n=== start {self.name} at {time.ctime()}\n".encode())
            out.flush()
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self.started_at = time.monotonic()
        self.exit_code = None
        log.info("started %s pid=%s", self.name, self.popen.pid)

    def signal(self, sig: int) -> None:
        """Send ``sig`` if the process runs."""
        if self.alive and self.popen is not None:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.kill(self.popen.pid, sig)

    def tail(self, lines: int = 20) -> str:
        """Last lines of the process's log (for error messages)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class ProcessGroup:
    """All component processes of a run; restarts crashed ones, stops them in order."""

    def __init__(self, on_failure: Callable[[Proc], None] | None = None) -> None:
        self.procs: dict[str, Proc] = {}
        self.on_failure = on_failure

    def add(self, proc: Proc) -> Proc:
        """Start ``proc`` and keep it."""
        if proc.name in self.procs and self.procs[proc.name].alive:
            raise RuntimeError(f"component {proc.name!r} is already running")
        self.procs[proc.name] = proc
        proc.start()
        return proc

    def of_kind(self, kind: str) -> list[Proc]:
        """Processes of one kind (e.g. 'node'), in start order."""
        return [p for p in self.procs.values() if p.kind == kind]

    def poll(self) -> None:
        """Notice exits: restart crashed processes, report those out of restarts."""
        for proc in list(self.procs.values()):
            if proc.popen is None or proc.alive or proc.exit_code is not None:
                continue
            proc.exit_code = proc.popen.returncode
            if proc.stopping or proc.exit_code == 0:
                log.info("%s exited code=%s", proc.name, proc.exit_code)
                continue
            if not proc.restart:  # replaceable (rollout nodes): the pool manager replaces it
                log.warning("%s crashed code=%s\n%s", proc.name, proc.exit_code, proc.tail(8))
                continue
            if proc.restarts < proc.max_restarts:
                proc.restarts += 1
                log.warning(
                    "%s crashed code=%s; restart %d/%d\n%s",
                    proc.name, proc.exit_code, proc.restarts, proc.max_restarts, proc.tail(8),
                )  # fmt: skip
                time.sleep(min(5.0, 0.5 * 2**proc.restarts))
                proc.start()
            else:
                log.error("%s failed code=%s\n%s", proc.name, proc.exit_code, proc.tail(20))
                if self.on_failure is not None:
                    self.on_failure(proc)

    def stop(self, procs: Sequence[Proc], timeout_s: float) -> None:
        """SIGTERM ``procs``, wait up to ``timeout_s``, then SIGKILL what still runs."""
        for p in procs:
            p.stopping = True
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in procs:
            if p.popen is None:
                continue
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs: killing it", p.name, timeout_s)
                p.signal(signal.SIGKILL)
                p.popen.wait()
            p.exit_code = p.popen.returncode

    def kill_all(self) -> None:
        """SIGKILL every process still running (last resort)."""
        for p in self.procs.values():
            p.stopping = True
            p.signal(signal.SIGKILL)
        for p in self.procs.values():
            if p.popen is not None:
                p.popen.wait()
