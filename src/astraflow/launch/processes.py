"""Components of a run: start, watch, stop; nothing outlives the launcher.

A :class:`Component` is anything the launcher can start, watch and stop: a local process
(:class:`Proc`, here) or a Ray actor (``launch.ray``). :class:`ComponentGroup` holds a run's
components and applies the same rules to both:

    start ──► running ──(exit 0)──► done
                 │ (crash)
                 ├──► restarted after a back-off, up to ``max_restarts`` times ──► failed
                 └──► (``restart=False``: replaceable, e.g. a rollout node) logged; its owner
                      (the pool manager) starts a fresh one

A :class:`Proc` runs ``python -m astraflow <component> --config FILE`` in its own session
(so a terminal's Ctrl-C reaches only the launcher, which stops components in order), with
output in ``<run_dir>/logs/<name>.log`` and, on Linux, a parent-death signal so even a
``kill -9`` of the launcher takes every component down with it.
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
from typing import Protocol

__all__ = ["Component", "ComponentGroup", "Proc", "ProcessGroup"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class Component(Protocol):
    """One supervised component (a process, a Ray actor); the group sets the bookkeeping."""

    name: str
    kind: str
    restart: bool
    max_restarts: int
    restarts: int
    exit_code: int | None
    stopping: bool

    def start(self) -> None:
        """Start (or restart, fresh) the component."""

    def poll(self) -> int | None:
        """Its exit code once it has ended, else None (also None before start)."""

    def terminate(self) -> None:
        """Ask it to stop gracefully (what SIGTERM does to a component process)."""

    def kill(self) -> None:
        """End it at once."""

    def wait(self, timeout_s: float | None) -> int | None:
        """Wait up to ``timeout_s`` (None: for ever) for it to end; its exit code or None."""

    def tail(self, lines: int = 20) -> str:
        """The last lines of its log (for error messages)."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux/glibc: the launcher's own shutdown path still applies
        pass


def _child_setup(cpus: tuple[int, ...]) -> Callable[[], None]:
    """What runs in the child between fork and exec: die with the parent, pin to ``cpus``
    (the affinity is inherited by the program exec'd and every process it starts)."""

    def setup() -> None:
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


def tail_file(path: Path, lines: int = 20) -> str:
    """Last lines of a log file (for error messages); empty if unreadable."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


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
    cpus: tuple[int, ...] = ()
    """CPU ids the process is pinned to (empty: anywhere)."""
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
                preexec_fn=_child_setup(self.cpus) if sys.platform == "linux" else None,
            )
        self.started_at = time.monotonic()
        self.exit_code = None
        log.info("started %s pid=%s", self.name, self.popen.pid)

    def poll(self) -> int | None:
        """The exit code once the process has ended."""
        return None if self.popen is None else self.popen.poll()

    def signal(self, sig: int) -> None:
        """Send ``sig`` if the process runs."""
        if self.alive and self.popen is not None:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.kill(self.popen.pid, sig)

    def terminate(self) -> None:
        """SIGTERM: the component stops gracefully."""
        self.signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.signal(signal.SIGKILL)

    def wait(self, timeout_s: float | None) -> int | None:
        """Wait for the process to end; its exit code, or None on time-out."""
        if self.popen is None:
            return None
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def tail(self, lines: int = 20) -> str:
        """Last lines of the process's log (for error messages)."""
        return tail_file(self.log_path, lines)


class ComponentGroup:
    """All components of a run; restarts crashed ones, stops them in order."""

    def __init__(self, on_failure: Callable[[Component], None] | None = None) -> None:
        self.procs: dict[str, Component] = {}
        self.on_failure = on_failure

    def add(self, proc: Component) -> Component:
        """Start ``proc`` and keep it."""
        if self.alive(proc.name):
            raise RuntimeError(f"component {proc.name!r} is already running")
        self.procs[proc.name] = proc
        proc.start()
        return proc

    def of_kind(self, kind: str) -> list[Component]:
        """Components of one kind (e.g. 'trainer'), in start order."""
        return [p for p in self.procs.values() if p.kind == kind]

    def alive(self, name: str) -> bool:
        """Whether component ``name`` was started and has not ended."""
        proc = self.procs.get(name)
        return proc is not None and proc.exit_code is None and proc.poll() is None

    def poll(self) -> None:
        """Notice exits: restart crashed components, report those out of restarts."""
        for proc in list(self.procs.values()):
            if proc.exit_code is not None:
                continue
            code = proc.poll()
            if code is None:
                continue
            proc.exit_code = code
            if proc.stopping or code == 0:
                log.info("%s exited code=%s", proc.name, code)
                continue
            if not proc.restart:  # replaceable (rollout nodes): the pool manager replaces it
                log.warning("%s crashed code=%s\n%s", proc.name, code, proc.tail(8))
                continue
            if proc.restarts < proc.max_restarts:
                proc.restarts += 1
                log.warning(
                    "%s crashed code=%s; restart %d/%d\n%s",
                    proc.name, code, proc.restarts, proc.max_restarts, proc.tail(8),
                )  # fmt: skip
                time.sleep(min(5.0, 0.5 * 2**proc.restarts))
                proc.start()
            else:
                log.error("%s failed code=%s\n%s", proc.name, code, proc.tail(20))
                if self.on_failure is not None:
                    self.on_failure(proc)

    def stop(self, procs: Sequence[Component], timeout_s: float) -> None:
        """Stop ``procs`` gracefully, wait up to ``timeout_s``, then kill what still runs."""
        self.stop_together([(procs, timeout_s)])

    def stop_together(self, groups: Sequence[tuple[Sequence[Component], float]]) -> None:
        """Stop every group's components at once (each asked once), each group with its own
        time-out from now; kill what is still running past it."""
        start = time.monotonic()
        for procs, _ in groups:
            for p in procs:
                p.stopping = True
                p.terminate()
        for procs, timeout_s in groups:
            deadline = start + timeout_s
            for p in procs:
                code = p.wait(max(0.0, deadline - time.monotonic()))
                if code is None and p.poll() is None:
                    log.warning("%s did not stop within %.0fs: killing it", p.name, timeout_s)
                    p.kill()
                    code = p.wait(None)
                p.exit_code = code if code is not None else p.poll()

    def kill_all(self) -> None:
        """Kill every component still running (last resort)."""
        for p in self.procs.values():
            p.stopping = True
            p.kill()
        for p in self.procs.values():
            p.wait(None)


#: The name this class had when every component was a process.
ProcessGroup = ComponentGroup
