"""Run untrusted Python (model-written code and tests) in a limited subprocess.

Layers (``Sandbox.layers()`` says which are on). With ``isolation='kernel'`` (the default) the
kernel enforces the boundary, and a machine that cannot build it refuses to run (SandboxError
when the ``Sandbox`` is made), never silently weaker:

    new mount + pid + net + ipc + uts namespaces (``unshare``; + a user namespace when the
    │   launcher is not root) ─ no network; the program's processes die with its pid 1
    read-only minimal root (pivot_root) ─ /usr /bin /lib* /etc and the interpreter only: no
    │   run directory, no /home, no /root; one writable place, the program's own size-capped
    │   tmpfs (its cwd, HOME and TMPDIR), gone when the run ends
    unprivileged identity ─ a fresh uid per run (root launcher) or root-of-a-user-namespace
    │   without capabilities; empty capability sets and bounding set; no_new_privs
    pids cgroup (v1, when writable) ─ a hard cap on processes: fork bombs stop here
    rlimits ─ address space, CPU seconds, file size (caps output), open files, processes
    audit hook in the child ─ refuses fork/exec/spawn, sockets, ctypes, signals, rlimit
    │   changes, writes outside its dir: a second layer only (code in the same interpreter can
    │   disarm it), the kernel layers above are the boundary
    new session; wall-clock limit ─ SIGKILL to the whole group after every run / on timeout

``isolation='process'`` is the weaker mode a caller must opt into (machines without
namespaces, or a node already inside a throw-away container or VM): no namespaces, no
filesystem or identity boundary, only rlimits, the pids cgroup and the audit hook; a guard
against runaway or careless code, not against hostile code.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import marshal
import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from astraflow.cgroupfs import kill_members, remove_cgroup
from astraflow.config import ConfigModel
from astraflow.errors import SandboxError
from astraflow.workflows.gate import Gate

__all__ = ["Sandbox", "SandboxConfig", "SandboxResult"]

log = logging.getLogger(__name__)

Status = Literal["ok", "error", "timeout", "memory", "output_limit", "killed"]
Mode = Literal["auto", "off", "required"]
Isolation = Literal["kernel", "process"]
_CHILD = Path(__file__).with_name("sandbox_child.py")
_PROGRAM = "main.py"
#: Each kernel-isolated run gets its own uid from this range (files it writes, its process
#: count); no account has it, so it owns nothing outside its own tmpfs.
_UID_BASE, _UID_SPAN = 1_500_000_000, 1 << 24
_UNSHARE_FLAGS = ("--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child")
_CHILD_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    # thread pools reserve address space per thread: keep imports inside RLIMIT_AS
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


class SandboxConfig(ConfigModel):
    """Limits of one sandboxed run."""

    time_limit_s: float = Field(default=5.0, gt=0, le=600)
    """Wall-clock limit; the whole process group is killed when it passes."""
    memory_mb: int = Field(default=512, ge=32)
    """Address-space limit per process (RLIMIT_AS)."""
    max_processes: int = Field(default=16, ge=2)
    """Processes the program may hold at once (pids cgroup; RLIMIT_NPROC when not root)."""
    output_limit_kb: int = Field(default=256, ge=1)
    """Largest file the program may write, stdout and stderr included (RLIMIT_FSIZE)."""
    max_open_files: int = Field(default=64, ge=16)
    """Open file descriptors (RLIMIT_NOFILE)."""
    isolation: Isolation = "kernel"
    """'kernel': namespaces, read-only root, unprivileged uid (refuses to run without them);
    'process': rlimits, cgroup and audit hook only, for trusted code or a throw-away VM."""
    disk_mb: int = Field(default=32, ge=1, le=4096)
    """Size of the program's writable tmpfs (kernel isolation): its files, all together."""
    pids_cgroup: Mode = "auto"
    """A pids cgroup capping process count: 'auto' uses one when this process may make it."""
    guard: bool = True
    """Install the audit hook that refuses process creation, sockets, ctypes and writes."""
    site_packages: bool = False
    """Let the program import installed packages (off: standard library only)."""
    max_concurrency: int = Field(default=2, ge=1)
    """Sandboxed runs at once from one ``Sandbox`` (async callers wait their turn)."""
    cache_size: int = Field(default=0, ge=0)
    """Distinct programs whose results ``run`` remembers (least recently used dropped): an
    identical program is answered from memory instead of run again. Timeouts and kills are
    not remembered (the machine may be at fault). For deterministic programs only (tiny models
    on generated tasks repeat their answers); 0: off."""


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed program ended."""

    status: Status
    """'ok' (exit 0), 'error' (non-zero exit), 'timeout', 'memory', 'output_limit', 'killed'."""
    returncode: int | None
    signal: int | None
    stdout: str
    stderr: str
    duration_s: float

    @property
    def passed(self) -> bool:
        """The program ran to completion and exited 0."""
        return self.status == "ok"


class Sandbox:
    """Runs Python programs under the configured limits; safe to share between tasks."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._prefix = _resolve_namespaces(self.config.isolation)
        self._cgroup_root = _resolve_cgroup(self.config.pids_cgroup, self._prefix)
        self._gate = Gate(self.config.max_concurrency)
        self._cache: OrderedDict[tuple[str, float | None], SandboxResult] = OrderedDict()

    def layers(self) -> dict[str, bool]:
        """Which isolation layers are in force on this machine."""
        kernel = bool(self._prefix)
        return {
            "namespaces": kernel,
            "read_only_root": kernel,
            "unprivileged": kernel or os.geteuid() != 0,
            "user_namespace": "--map-root-user" in self._prefix,
            "pids_cgroup": self._cgroup_root is not None,
            "rlimit_nproc": kernel or os.geteuid() != 0,
            "guard": self.config.guard,
        }

    async def run(self, program: str, *, time_limit_s: float | None = None) -> SandboxResult:
        """Run ``program`` (Python source) without blocking the event loop."""
        key = (program, time_limit_s)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        async with self._gate:
            result = await asyncio.to_thread(self.run_sync, program, time_limit_s=time_limit_s)
        if self.config.cache_size and result.status in ("ok", "error"):
            self._cache[key] = result
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
        return result

    def run_sync(self, program: str, *, time_limit_s: float | None = None) -> SandboxResult:
        """Run ``program`` in a fresh temporary directory and return how it ended.

        Raises:
            SandboxError: the sandbox itself could not start (not the program's fault).
        """
        limit = time_limit_s or self.config.time_limit_s
        with tempfile.TemporaryDirectory(
            prefix="astraflow-sandbox-", ignore_cleanup_errors=True
        ) as tmp:
            cgroup = self._make_cgroup()
            try:
                return self._run_in(Path(tmp), program, limit, cgroup)
            finally:
                if cgroup is not None and not remove_cgroup(cgroup, kill=True):
                    log.warning("sandbox cgroup=%s could not be removed", cgroup)

    # ----------------------------------------------------------------- internals

    def _make_cgroup(self) -> Path | None:
        if self._cgroup_root is None:
            return None
        path = self._cgroup_root / f"astraflow-sandbox-{uuid.uuid4().hex[:12]}"
        try:
            path.mkdir()
            (path / "pids.max").write_text(str(self.config.max_processes))
        except OSError as exc:
            raise SandboxError(f"cannot create pids cgroup {path}: {exc}") from exc
        return path

    def _rlimits(self, limit_s: float) -> dict[str, int]:
        cfg = self.config
        # a kernel-isolated run has a uid of its own: its init plus max_processes
        nproc = cfg.max_processes + 1 if self._prefix else _nproc_limit(cfg.max_processes)
        return {
            "RLIMIT_AS": cfg.memory_mb * 2**20,
            "RLIMIT_CPU": math.ceil(limit_s) + 1,
            "RLIMIT_FSIZE": cfg.output_limit_kb * 1024,
            "RLIMIT_NOFILE": cfg.max_open_files,
            "RLIMIT_NPROC": nproc,
            "RLIMIT_CORE": 0,
        }

    def _run_in(
        self, tmp: Path, program: str, limit_s: float, cgroup: Path | None
    ) -> SandboxResult:
        work = tmp / "work"
        work.mkdir()
        jail = None
        if self._prefix:  # the child copies the program into its own tmpfs at ``work``
            (tmp / "root").mkdir()
            uid = None if "--map-root-user" in self._prefix else _fresh_uid()
            jail = {"root": str(tmp / "root"), "work": str(work), "uid": uid,
                    "disk_mb": self.config.disk_mb}  # fmt: skip
        (tmp / _PROGRAM if jail else work / _PROGRAM).write_text(
            program, encoding="utf-8", errors="replace"
        )
        status_r, status_w = os.pipe()
        config = {
            "program": _PROGRAM,
            "status_fd": status_w,
            "guard": self.config.guard,
            "site_packages": self.config.site_packages,
            "jail": jail,
            "rlimits": self._rlimits(limit_s),
            "cgroup_procs": str(cgroup / "cgroup.procs") if cgroup else None,
        }
        cfg_path = tmp / ".sandbox.cfg"
        cfg_path.write_bytes(marshal.dumps(config))  # the child reads it without importing json
        flags = ["-I", "-B"] if self.config.site_packages else ["-I", "-S", "-B"]
        cmd = [*self._prefix, sys.executable, *flags, str(_CHILD), str(cfg_path)]
        out_path, err_path = tmp / ".stdout", tmp / ".stderr"
        start = time.monotonic()
        try:
            with out_path.open("wb") as out, err_path.open("wb") as err:
                proc = subprocess.Popen(
                    cmd,
                    cwd=tmp if jail else work,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    pass_fds=(status_w,),
                    start_new_session=True,
                    env={**_CHILD_ENV, "HOME": str(work), "TMPDIR": str(work)},
                )
        except OSError as exc:
            os.close(status_r)
            os.close(status_w)
            raise SandboxError(f"cannot start the sandbox: {exc}") from exc
        os.close(status_w)
        timed_out = False
        try:
            timed_out = not _wait_exit(proc, limit_s)
        finally:
            _kill_group(proc)
            if cgroup is not None and not kill_members(cgroup):
                log.warning("sandbox cgroup=%s still has processes after SIGKILL", cgroup)
        with os.fdopen(status_r, "rb") as f:
            raw = f.read()
        duration = time.monotonic() - start
        return self._result(raw, proc.returncode, timed_out, out_path, err_path, duration)

    def _result(
        self,
        raw: bytes,
        returncode: int | None,
        timed_out: bool,
        out_path: Path,
        err_path: Path,
        duration: float,
    ) -> SandboxResult:
        cap = self.config.output_limit_kb * 1024
        stdout = _read_capped(out_path, cap)
        stderr = _read_capped(err_path, cap)
        end: dict[str, int] = {}
        if raw:
            with contextlib.suppress(ValueError):
                end = json.loads(raw)
        code, sig = end.get("exit"), end.get("signal")
        if timed_out or sig in (signal.SIGXCPU, signal.SIGKILL):
            status: Status = "timeout" if timed_out or sig == signal.SIGXCPU else "killed"
        elif sig == signal.SIGXFSZ or (code != 0 and _full(out_path, err_path, cap)):
            status = "output_limit"
        elif sig is not None:
            status = "killed"
        elif code is None:
            # the init side never reported: the sandbox itself failed to set up
            if returncode not in (0, None):
                raise SandboxError(f"sandbox failed to start (exit {returncode}): {stderr[-400:]}")
            status = "killed"
        elif code == 0:
            status = "ok"
        elif "MemoryError" in stderr[-2000:]:
            status = "memory"
        else:
            status = "error"
        return SandboxResult(status, code, sig, stdout, stderr, round(duration, 4))


def _nproc_limit(max_processes: int) -> int:
    """RLIMIT_NPROC for the program: it counts every thread of the user, not just ours.

    Root ignores the limit, so ``max_processes`` is only symbolic there; any other user gets
    its current thread count plus ``max_processes``, so the program can make that many more.
    """
    uid = os.getuid()
    if uid == 0:
        return max_processes
    threads = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == uid:
                threads += sum(1 for _ in (entry / "task").iterdir())
        except OSError:
            continue  # exited meanwhile
    return threads + max_processes


def _full(out_path: Path, err_path: Path, cap: int) -> bool:
    """An output file reached the size limit (python ignores SIGXFSZ: writes fail instead)."""
    return max(out_path.stat().st_size, err_path.stat().st_size) >= cap


def _read_capped(path: Path, cap: int) -> str:
    with path.open("rb") as f:
        return f.read(cap).decode("utf-8", errors="replace")


def _wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``proc`` to end (True) without polling: its pidfd becomes
    readable when it exits. ``Popen.wait(timeout)`` sleeps 1, 2, 4 ... 50 ms between checks,
    which added ~10-25 ms to every sandboxed run of a few tens of milliseconds."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): the polling wait
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(max(0, math.ceil(timeout_s * 1000))):
            return False
    finally:
        os.close(fd)
    proc.wait()  # it has ended: reaps at once
    return True


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _fresh_uid() -> int:
    return _UID_BASE + secrets.randbelow(_UID_SPAN)


@functools.cache
def _probe_unshare() -> tuple[tuple[str, ...], str]:
    """The ``unshare`` prefix that builds the namespaces here, or () and why not."""
    exe = shutil.which("unshare")
    if exe is None:
        return (), "`unshare` (util-linux) is not installed"
    user = () if os.geteuid() == 0 else ("--user", "--map-root-user")
    cmd = [exe, *user, *_UNSHARE_FLAGS]
    try:
        done = subprocess.run([*cmd, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return (), f"`unshare` failed: {exc}"
    if done.returncode != 0:
        return (), f"`{' '.join(cmd)} true` failed: {done.stderr.decode(errors='replace')[-300:]}"
    return (*cmd, "--"), ""


def _resolve_namespaces(isolation: Isolation) -> tuple[str, ...]:
    if isolation == "process":
        return ()
    prefix, why = _probe_unshare()
    if not prefix:
        raise SandboxError(
            f"kernel isolation is unavailable on this machine ({why}); refusing to run "
            "untrusted code without it (set sandbox isolation='process' only for trusted "
            "code or inside a throw-away container or VM)"
        )
    return prefix


@functools.cache
def _probe_cgroup() -> Path | None:
    if os.geteuid() != 0:
        return None
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "pids" in controllers.split(","):
            root = Path("/sys/fs/cgroup/pids") / rel.lstrip("/")
            probe = root / f"astraflow-probe-{uuid.uuid4().hex[:8]}"
            try:
                probe.mkdir()
                ok = (probe / "pids.max").exists()
                probe.rmdir()
            except OSError:
                return None
            return root if ok else None
    return None


def _resolve_cgroup(mode: Mode, prefix: tuple[str, ...]) -> Path | None:
    root = None if mode == "off" or "--map-root-user" in prefix else _probe_cgroup()
    if root is None and mode == "required":
        raise SandboxError("a pids cgroup is required but none can be created here")
    return root
