"""The code sandbox against hostile programs: the filesystem and identity are the kernel's
boundary, so escapes that first switch off the in-process audit guard still change nothing
outside the program's own directory."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from astraflow.workflows.sandbox import Sandbox, SandboxConfig

#: Reaches the audit hook's globals through the garbage collector and empties its rules (the
#: probe's finding): after it, the in-process guard refuses nothing.
DISARM = """
import gc
for obj in gc.get_objects():
    g = getattr(obj, "__globals__", None)
    if getattr(obj, "__name__", "") == "hook" and isinstance(g, dict) and "_BLOCKED" in g:
        g["_BLOCKED"] = frozenset()
        g["_BLOCKED_IMPORTS"] = frozenset()
        g["_PATH_EVENTS"] = {}
        g["_inside"] = lambda root, path: True
        print("guard disarmed", flush=True)
"""

#: Each escape writes the file ``{target}``; ``{dir}``/``{name}`` are its directory and name.
ESCAPES = {
    "open": "open({target!r}, 'w').write('escaped')",
    "dir_fd": (
        "import os\nfd = os.open({dir!r}, os.O_RDONLY)\n"
        "os.write(os.open({name!r}, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), b'escaped')"
    ),
    "mkfifo": "import os\nos.mkfifo({target!r})",
    "mknod": "import os, stat\nos.mknod({target!r}, 0o644 | stat.S_IFREG)",
    "os_system": ("import os\nrc = os.system('echo escaped > {target}')\nassert rc == 0, rc"),
    "subprocess": (
        "import subprocess\n"
        "subprocess.run(['/bin/sh', '-c', 'echo escaped > {target}'], check=True)"
    ),
    "symlink_swap": (
        "import os\nos.symlink({dir!r}, 'out')\nopen('out/' + {name!r}, 'w').write('escaped')"
    ),
}


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    sandbox = Sandbox(SandboxConfig(time_limit_s=5.0))
    if not sandbox.layers()["read_only_root"]:
        pytest.fail("kernel isolation is the default and must be on (or refuse to build)")
    return sandbox


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run directory beside the sandbox, holding a secret the program must not reach."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "secret.txt").write_text("hunter2")
    run.chmod(0o755)
    (run / "secret.txt").chmod(0o644)  # world-readable: only the mount view keeps it out
    return run


@pytest.fixture
def targets(run_dir: Path) -> Iterator[dict[str, Path]]:
    """Places outside the sandbox a hostile program would write to: run dir, /tmp, /etc."""
    tag = uuid.uuid4().hex[:10]
    found = {
        "run_dir": run_dir / f"escape-{tag}",
        "tmp": Path("/tmp") / f"astraflow-escape-{tag}",
        "etc": Path("/etc") / f"astraflow-escape-{tag}",
    }
    yield found
    for path in found.values():
        if path.exists() or path.is_symlink():
            path.unlink()


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no-guard"])
@pytest.mark.parametrize("escape", sorted(ESCAPES))
@pytest.mark.parametrize("where", ["run_dir", "tmp", "etc"])
def test_escape_after_disarming_the_guard_changes_nothing_outside(
    sandbox: Sandbox, targets: dict[str, Path], escape: str, where: str, guard: bool
) -> None:
    target = targets[where]
    body = ESCAPES[escape].format(target=str(target), dir=str(target.parent), name=target.name)
    program = DISARM + body + "\nprint('wrote', flush=True)\n"
    config = sandbox.config.model_copy(update={"guard": guard})
    result = Sandbox(config).run_sync(program)
    if guard:
        assert "guard disarmed" in result.stdout  # the in-process layer really was switched off
    assert not result.passed and "wrote" not in result.stdout, result
    assert not target.exists() and not target.is_symlink()
    assert sorted(p.name for p in target.parent.iterdir() if p.name.startswith("escape")) == []


def test_run_directory_is_not_even_readable(sandbox: Sandbox, run_dir: Path) -> None:
    secret = run_dir / "secret.txt"
    result = sandbox.run_sync(DISARM + f"print(open({str(secret)!r}).read())")
    assert not result.passed and "hunter2" not in result.stdout
    assert "No such file" in result.stderr
    assert secret.read_text() == "hunter2"


def test_program_runs_unprivileged_and_cannot_regain_root(sandbox: Sandbox) -> None:
    program = DISARM + (
        "import os\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)\n"
        "print(os.getuid(), os.geteuid(), status['CapEff'].strip(), status['CapBnd'].strip(),"
        " status['NoNewPrivs'].strip())\n"
        "for call in (lambda: os.setuid(0), lambda: os.setresuid(0, 0, 0),"
        " lambda: os.chroot('/'), lambda: os.chown('main.py', 0, 0)):\n"
        "    try:\n        call()\n    except PermissionError:\n        print('refused')\n"
    )
    result = sandbox.run_sync(program)
    assert result.passed, result.stderr
    uid, euid, cap_eff, cap_bnd, no_new_privs = result.stdout.splitlines()[1].split()
    assert int(uid) != 0 and int(euid) != 0
    assert int(cap_eff, 16) == 0 and int(cap_bnd, 16) == 0 and no_new_privs == "1"
    assert result.stdout.count("refused") == 4


def test_program_cannot_forge_the_status_its_init_reports(sandbox: Sandbox) -> None:
    """The init (pid 1, same uid) holds the status pipe; the program cannot reach it."""
    program = DISARM + (
        "import json, os\nfor fd in range(3, 64):\n    try:\n"
        "        w = os.open(f'/proc/1/fd/{fd}', os.O_WRONLY)\n"
        "        os.write(w, json.dumps({'exit': 0}).encode())\n        print('forged')\n"
        "    except OSError:\n        pass\nraise SystemExit(3)\n"
    )
    result = sandbox.run_sync(program)
    assert "forged" not in result.stdout and result.status == "error" and result.returncode == 3


def test_remounting_the_root_writable_is_refused(sandbox: Sandbox) -> None:
    program = DISARM + (
        "import os\nrc = os.system('mount -o remount,rw / 2>&1; touch /usr/escape 2>&1')\n"
        "print('rc', rc)\nassert not os.path.exists('/usr/escape')\n"
    )
    result = sandbox.run_sync(program)
    assert result.passed, result.stderr
    assert not Path("/usr/escape").exists()


def test_legitimate_program_reads_stdin_and_writes_its_own_directory(sandbox: Sandbox) -> None:
    program = (
        "import os, sys, tempfile, json, collections\n"
        "assert sys.stdin.read() == ''\n"
        "os.makedirs('sub/dir')\n"
        "open('sub/dir/data.json', 'w').write(json.dumps({'a': 1}))\n"
        "with tempfile.NamedTemporaryFile('w', delete=False) as f:\n"
        "    f.write('scratch')\n"
        "assert os.path.dirname(f.name) == os.getcwd()\n"
        "os.mkfifo('pipe')\n"
        "print(json.load(open('sub/dir/data.json'))['a'], sorted(os.listdir('.')))\n"
    )
    result = sandbox.run_sync(program)
    assert result.passed, result.stderr
    assert result.stdout.startswith("1 ")


def test_humaneval_style_solution_and_tests(sandbox: Sandbox) -> None:
    program = (
        "from typing import List\n\n"
        "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
        "    return any(abs(a - b) < threshold for i, a in enumerate(numbers)\n"
        "               for j, b in enumerate(numbers) if i != j)\n\n"
        "def check(candidate):\n"
        "    assert candidate([1.0, 2.0, 3.0], 0.5) is False\n"
        "    assert candidate([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3) is True\n\n"
        "check(has_close_elements)\n"
    )
    assert sandbox.run_sync(program).passed
    wrong = program.replace("< threshold", "> threshold")
    assert sandbox.run_sync(wrong).status == "error"


def test_disk_of_the_program_is_capped(sandbox: Sandbox) -> None:
    config = sandbox.config.model_copy(update={"disk_mb": 1, "output_limit_kb": 512})
    program = (
        "n = 0\ntry:\n    while True:\n        open(f'f{n}', 'wb').write(b'x' * 200_000)\n"
        "        n += 1\nexcept OSError as exc:\n    print('full after', n, exc.errno)\n"
    )
    result = Sandbox(config).run_sync(program)
    assert result.passed, result.stderr
    assert 1 <= int(result.stdout.split()[2]) <= 6  # 1 MiB: at most five 200 kB files


def test_kernel_isolation_refuses_to_run_without_namespaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from astraflow.errors import SandboxError
    from astraflow.workflows import sandbox as module

    monkeypatch.setattr(module, "_probe_unshare", lambda: ((), "no namespaces here (test)"))
    with pytest.raises(SandboxError, match="kernel isolation is unavailable"):
        Sandbox(SandboxConfig())
    weaker = Sandbox(SandboxConfig(isolation="process"))  # only when the caller opts in
    assert not weaker.layers()["read_only_root"]
    assert os.path.exists(str(module._CHILD))
