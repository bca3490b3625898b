"""Child side of the code sandbox: trusted set-up that runs before the untrusted program.

Started by :mod:`astraflow.workflows.sandbox` as ``python -I -S -B sandbox_child.py CONFIG``,
as pid 1 of new mount + pid + network + ipc + uts namespaces (isolation 'kernel') or in a
temporary directory (isolation 'process'). Standard library only: it never imports astraflow.

    join pids cgroup ─► jail (kernel: sandbox_jail.enter) ─► set rlimits ─► drop privileges
    ─► fork ─┬─ child: close status fd, install audit guard, run main.py as __main__
             └─ parent (init): reap every child; write the program's exit code or signal
                to the status fd

The audit guard is a second layer only: code in the same interpreter can reach and disarm it
(``gc.get_objects()``), and it sees neither ``dir_fd`` nor ``mkfifo``/``mknod``. The boundary
is the kernel's: a read-only root, one writable tmpfs, no capabilities, an unprivileged uid.
"""

from __future__ import annotations

import marshal
import os
import resource
import sys

# Every import here is paid by every sandboxed run (tens of milliseconds for json, runpy,
# importlib.util and typing together, against ~15 ms for the interpreter itself): the config
# comes as marshal data, the program runs by exec, the jail module by exec, and typing names
# exist for the type checker only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# Audit events refused outright: new processes, sockets, native code, signals, limits.
_BLOCKED = frozenset(
    {
        "os.fork",
        "os.forkpty",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "subprocess.Popen",
        "socket.__new__",
        "socket.connect",
        "socket.bind",
        "socket.getaddrinfo",
        "socket.gethostbyname",
        "socket.gethostbyname_ex",
        "socket.sendto",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.cdata",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "resource.setrlimit",
        "resource.prlimit",
    }
)
# Modules whose import would give a way around the guard (raw fork_exec, ctypes).
_BLOCKED_IMPORTS = frozenset({"_posixsubprocess", "_ctypes", "ctypes"})
# Events whose listed arguments are paths the program changes: only inside the sandbox dir.
_PATH_EVENTS: dict[str, tuple[int, ...]] = {
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.rename": (0, 1),
    "os.link": (0, 1),
    "os.symlink": (1,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.truncate": (0,),
    "os.utime": (0,),
    "shutil.rmtree": (0,),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _inside(root: str, path: Any) -> bool:
    if isinstance(path, int):
        return True  # an already-open descriptor
    real = os.path.realpath(os.fsdecode(path))
    return real == os.devnull or real == root or real.startswith(root + os.sep)


def _guard(root: str) -> Any:
    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event in _BLOCKED:
            raise PermissionError(f"astraflow-sandbox: {event} is not allowed")
        if event == "import" and args and args[0] in _BLOCKED_IMPORTS:
            raise PermissionError(f"astraflow-sandbox: import of {args[0]} is not allowed")
        if event == "open" and len(args) >= 3:
            path, mode, flags = args[0], args[1], args[2]
            writes = bool((flags or 0) & _WRITE_FLAGS) or (
                isinstance(mode, str) and any(c in mode for c in "wax+")
            )
            if writes and path is not None and not _inside(root, path):
                raise PermissionError(f"astraflow-sandbox: writing {path!r} is not allowed")
        for index in _PATH_EVENTS.get(event, ()):
            if len(args) > index and args[index] is not None and not _inside(root, args[index]):
                raise PermissionError(f"astraflow-sandbox: {event} on {args[index]!r}")

    return hook


def _limit(config: dict[str, Any]) -> None:
    for name, value in config["rlimits"].items():
        limit = int(value)
        resource.setrlimit(getattr(resource, name), (limit, limit))


def _run_program(config: dict[str, Any], status_fd: int) -> None:
    os.close(status_fd)
    for name in ("sandbox_jail", "ctypes", "_ctypes", "ctypes._endian"):
        sys.modules.pop(name, None)  # the set-up's native-call module is not the program's
    root = os.path.realpath(os.getcwd())
    sys.argv = [config["program"]]
    sys.path.insert(0, root)
    if config["guard"]:
        sys.addaudithook(_guard(root))
    code = 0
    try:
        _run_main(config["program"])
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # the program's own failure: report it like python would
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _run_main(path: str) -> None:
    """Run the file at ``path`` as ``__main__`` (what ``python path`` does)."""
    with open(path, "rb") as f:
        source = f.read()
    module = type(sys)("__main__")
    module.__file__ = path
    sys.modules["__main__"] = module
    exec(compile(source, path, "exec"), module.__dict__)


def _wait_as_init(pid: int) -> dict[str, int]:
    """Reap every child (we may be pid 1); return how the program itself ended."""
    while True:
        try:
            done, status = os.wait()
        except ChildProcessError:
            return {"exit": -1}
        if done == pid:
            if os.WIFSIGNALED(status):
                return {"signal": os.WTERMSIG(status)}
            return {"exit": os.WEXITSTATUS(status)}


def _interpreter_dirs(site_packages: bool) -> set[str]:
    """Directories this interpreter imports from (bound read-only into the jail)."""
    dirs = {sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    if site_packages:
        dirs |= {sys.prefix, *sys.path}
    return {os.path.realpath(d) for d in dirs if d and os.path.isdir(d)}


def _jail(config: dict[str, Any]) -> None:
    path = os.path.join(os.path.dirname(os.path.realpath(__file__)), "sandbox_jail.py")
    sandbox_jail: Any = type(sys)("sandbox_jail")
    sandbox_jail.__file__ = path
    sys.modules["sandbox_jail"] = sandbox_jail
    with open(path, "rb") as f:
        exec(compile(f.read(), path, "exec"), sandbox_jail.__dict__)
    sandbox_jail.enter(config["jail"], _interpreter_dirs(bool(config["site_packages"])))
    _limit(config)
    sandbox_jail.drop_privileges(config["jail"].get("uid"))


def main() -> None:
    """Set up the jail and limits, run the program in a child, report its end on the status fd."""
    with open(sys.argv[1], "rb") as f:
        config = marshal.load(f)  # written by the sandbox (trusted), never by the program
    status_fd = int(config["status_fd"])
    if config.get("cgroup_procs"):
        with open(config["cgroup_procs"], "w", encoding="ascii") as f:
            f.write("0")
    if config.get("jail"):
        _jail(config)
    else:
        _limit(config)
    pid = os.fork()
    if pid == 0:
        _run_program(config, status_fd)
    result = _wait_as_init(pid)
    ((key, value),) = result.items()
    os.write(status_fd, b'{"%s": %d}' % (key.encode(), value))
    os.close(status_fd)
    # nothing is left to flush or clean up: skip the interpreter's teardown (~5 ms a run)
    os._exit(0)


if __name__ == "__main__":
    main()
