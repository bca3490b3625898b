"""Kernel side of the code sandbox: a read-only minimal root and an identity with no privilege.

Loaded by ``sandbox_child.py`` (standard library only, never imports astraflow) in the init
process of fresh mount + pid + net + ipc + uts namespaces, before the untrusted program exists::

    tmpfs new root ─► read-only binds: /usr /bin /lib* /etc, the interpreter's prefix
    │                 (+ the venv and sys.path dirs with site_packages)
    ├─ /dev: null zero full random urandom      /proc: this pid namespace only
    ├─ <work>: a size-capped tmpfs owned by the sandbox uid (the only writable place)
    ▼
    pivot_root, detach the old root ─► remount / read-only ─► drop privileges:
    empty capability bounding set ─► setresuid/setresgid to a fresh unprivileged uid
    (root launcher) ─► empty capability sets ─► no_new_privs, not dumpable ─► verify in
    /proc/self/status

Everything the program could use to regain a privilege is gone before it starts; the audit
hook of ``sandbox_child.py`` is only a second layer. Any failure here aborts the run.
"""

from __future__ import annotations

import ctypes
import os

# run by every sandboxed program's set-up: typing names for the type checker only (typing
# and platform cost more than the interpreter's own start)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 4, 24, 38
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
#: Syscalls glibc has no wrapper for, per machine (mount_setattr is 442 everywhere).
_SYSCALLS = {
    "x86_64": {"pivot_root": 155, "capset": 126, "mount_setattr": 442},
    "aarch64": {"pivot_root": 41, "capset": 91, "mount_setattr": 442},
}
#: Host directories the interpreter and its shared libraries live in (bound read-only).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_DEVICES = ("null", "zero", "full", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)


class JailError(OSError):
    """The kernel boundary could not be set up: the run must not start."""


class _MountAttr(ctypes.Structure):
    _fields_ = (
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    )


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise JailError(err, f"astraflow-sandbox: {what}: {os.strerror(err)}")


def _syscall(name: str) -> int:
    numbers = _SYSCALLS.get(os.uname().machine)
    if numbers is None:
        raise JailError(f"astraflow-sandbox: no syscall table for {os.uname().machine}")
    return numbers[name]


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    enc = [None if s is None else os.fsencode(s) for s in (source, target, fstype)]
    result = _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), data.encode() or None)
    _check(result, f"mount {source} on {target}")


def _read_only_tree(target: str) -> None:
    """Make the mount at ``target`` and every mount below it read-only, nosuid, nodev."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)
    result = _libc.syscall(
        _syscall("mount_setattr"), AT_FDCWD, os.fsencode(target), AT_RECURSIVE,
        ctypes.byref(attr), ctypes.sizeof(attr),
    )  # fmt: skip
    if result != 0:  # kernels before 5.12: the top mount only (submounts are rare there)
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _bind_read_only(source: str, new_root: str) -> None:
    target = new_root + source
    if os.path.lexists(target):
        return  # already inside an earlier bind
    if os.path.islink(source):
        os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
        os.symlink(os.readlink(source), target)
        return
    if not os.path.isdir(source):
        return
    os.makedirs(target, 0o755, exist_ok=True)
    _mount(source, target, None, MS_BIND | MS_REC)
    _read_only_tree(target)


def _devices(new_root: str) -> None:
    dev = new_root + "/dev"
    os.mkdir(dev, 0o755)
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k,nr_inodes=64")
    for name in _DEVICES:
        with open(f"{dev}/{name}", "wb"):
            pass
        _mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for name, link in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                       ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):  # fmt: skip
        os.symlink(link, f"{dev}/{name}")
    _mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)


def _work(new_root: str, work: str, program: bytes, uid: int | None, disk_mb: int) -> None:
    target = new_root + work
    os.makedirs(target, 0o755)
    owner = "" if uid is None else f",uid={uid},gid={uid}"
    options = f"mode=0700,size={disk_mb}m,nr_inodes=4096{owner}"
    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, options)
    path = f"{target}/main.py"
    with open(path, "wb") as f:
        f.write(program)
    if uid is not None:
        os.chown(path, uid, uid)


def enter(config: dict[str, Any], read_only: Iterable[str]) -> None:
    """Move this process into the jail described by ``config`` (cwd: the work dir)."""
    new_root, work, uid = config["root"], config["work"], config.get("uid")
    with open(os.path.join(os.path.dirname(work), "main.py"), "rb") as f:
        program = f.read()
    os.umask(0o022)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=4096")
    for source in (*SYSTEM_DIRS, *sorted(read_only, key=len)):
        _bind_read_only(source, new_root)
    _devices(new_root)
    os.mkdir(new_root + "/proc", 0o555)
    _mount("proc", new_root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _work(new_root, work, program, uid, int(config["disk_mb"]))
    os.chdir(new_root)
    _check(_libc.syscall(_syscall("pivot_root"), b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(work)


def drop_privileges(uid: int | None) -> None:
    """Give up every capability and, as root, become ``uid``; for good (no_new_privs)."""
    with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.syscall(_syscall("capset"), ctypes.byref(header), data), "clear capabilities")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "set no_new_privs")
    # not dumpable: the program (same uid) cannot open the init's status pipe via /proc/1/fd
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "clear the dumpable flag")
    _verify(uid)


def _verify(uid: int | None) -> None:
    with open("/proc/self/status", encoding="ascii") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    caps = {k: int(fields[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
    held = {k: v for k, v in caps.items() if v}
    if held or fields["NoNewPrivs"].strip() != "1":
        raise JailError(f"astraflow-sandbox: privileges remain after the drop: {held}")
    if uid is not None and {int(x) for x in fields["Uid"].split()} != {uid}:
        raise JailError(f"astraflow-sandbox: uid is {fields['Uid'].split()}, not {uid}")
