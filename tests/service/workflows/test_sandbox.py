"""The code sandbox against real misbehaving programs: loops, bombs, network, memory, output."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from astraflow.workflows.sandbox import Sandbox, SandboxConfig


def _survivors(directory: str) -> list[int]:
    """Processes still working in ``directory`` (a finished run's sandbox): there must be none."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if cwd.startswith(directory):
            found.append(int(entry.name))
    return found


BOMB = "import os\nprint(os.getcwd(), flush=True)\nwhile True:\n    os.fork()\n"


@pytest.fixture
def listener() -> Iterator[tuple[int, list[str]]]:
    """A real TCP server on loopback that records every connection it accepts."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.1)
    accepted: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, addr = server.accept()
            except OSError:
                continue
            accepted.append(str(addr))
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join(timeout=2)
    server.close()


def test_correct_solution_passes_and_wrong_one_fails() -> None:
    sandbox = Sandbox()
    ok = sandbox.run_sync("def f(x):\n    return 2 * x\nassert f(3) == 6\nprint('fine')")
    bad = sandbox.run_sync("def f(x):\n    return x\nassert f(3) == 6")
    assert ok.passed and ok.stdout == "fine\n"
    assert bad.status == "error" and "AssertionError" in bad.stderr


def test_infinite_loop_is_killed_within_its_limit() -> None:
    sandbox = Sandbox(SandboxConfig(time_limit_s=1.0))
    start = time.monotonic()
    result = sandbox.run_sync("while True:\n    pass")
    assert result.status == "timeout"
    assert time.monotonic() - start < 3.0


@pytest.mark.parametrize("isolation", ["kernel", "process"])
def test_fork_bomb_is_contained_and_leaves_no_process(isolation: str) -> None:
    sandbox = Sandbox(SandboxConfig(time_limit_s=2.0, isolation=isolation))
    result = sandbox.run_sync(BOMB)
    assert not result.passed and "os.fork is not allowed" in result.stderr
    assert _survivors(result.stdout.strip()) == []


@pytest.mark.parametrize("isolation", ["kernel", "process"])
def test_fork_bomb_without_the_audit_guard_is_contained(isolation: str) -> None:
    sandbox = Sandbox(SandboxConfig(time_limit_s=2.0, guard=False, isolation=isolation))
    start = time.monotonic()
    result = sandbox.run_sync(BOMB)
    assert not result.passed
    assert time.monotonic() - start < 4.0
    assert result.stdout.strip() and _survivors(result.stdout.strip()) == []


@pytest.mark.parametrize("isolation", ["kernel", "process"])
def test_process_count_is_capped_by_the_kernel(isolation: str) -> None:
    sandbox = Sandbox(
        SandboxConfig(time_limit_s=3.0, guard=False, max_processes=8, isolation=isolation)
    )
    layers = sandbox.layers()
    if not (layers["pids_cgroup"] or layers["rlimit_nproc"]):
        pytest.skip("no kernel process cap here: root without a writable pids cgroup")
    program = (
        "import os, time\nmade = 0\nwhile made < 200:\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n"
        "        os._exit(0)\n    made += 1\nprint(made)\n"
    )
    start = time.monotonic()
    result = sandbox.run_sync(program)
    assert result.passed, result.stderr
    assert int(result.stdout) < 12  # capped near 8 (200 without a cap); sleepers killed after
    assert time.monotonic() - start < 3.0


def test_network_call_fails_and_reaches_no_server(listener: tuple[int, list[str]]) -> None:
    port, accepted = listener
    program = (
        "import socket\n"
        f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "print('connected')\n"
    )
    result = Sandbox().run_sync(program)
    assert not result.passed and "connected" not in result.stdout
    # a client outside the sandbox does reach the same server
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    time.sleep(0.3)
    assert len(accepted) == 1


def test_network_namespace_alone_blocks_connections(listener: tuple[int, list[str]]) -> None:
    sandbox = Sandbox(SandboxConfig(guard=False))
    if not sandbox.layers()["namespaces"]:
        pytest.skip("unshare cannot create network namespaces here")
    port, accepted = listener
    result = sandbox.run_sync(
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
    )
    assert result.status == "error" and "unreachable" in result.stderr.lower()
    time.sleep(0.3)
    assert accepted == []


def test_memory_bomb_is_stopped() -> None:
    sandbox = Sandbox(SandboxConfig(memory_mb=256))
    result = sandbox.run_sync("blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))")
    assert result.status == "memory"


def test_output_is_capped() -> None:
    sandbox = Sandbox(SandboxConfig(output_limit_kb=16))
    result = sandbox.run_sync("print('x' * 10**6)")
    assert result.status == "output_limit" and len(result.stdout) <= 16 * 1024


def test_writes_outside_the_sandbox_directory_are_refused(tmp_path: Path) -> None:
    target = tmp_path / "escape.txt"
    result = Sandbox().run_sync(
        f"open('local.txt', 'w').write('ok')\nopen({str(target)!r}, 'w').write('no')"
    )
    assert result.status == "error" and "not allowed" in result.stderr
    assert not target.exists()


def test_subprocess_and_ctypes_are_refused() -> None:
    sandbox = Sandbox()
    for program in ("import subprocess\nsubprocess.run(['true'])", "import ctypes"):
        result = sandbox.run_sync(program)
        assert result.status == "error" and "not allowed" in result.stderr


async def test_async_runs_are_bounded_and_concurrent() -> None:
    import asyncio

    sandbox = Sandbox(SandboxConfig(max_concurrency=2))
    results = await asyncio.gather(*(sandbox.run(f"print({i})") for i in range(4)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(4)]


async def test_cache_answers_a_repeated_program_without_running_it_again() -> None:
    sandbox = Sandbox(SandboxConfig(cache_size=2))
    ok = "assert 1 + 1 == 2\nprint('ran')"
    first = await sandbox.run(ok)
    assert first.passed and await sandbox.run(ok) is first  # remembered: not run again
    failing = await sandbox.run("assert False")
    assert failing.status == "error" and await sandbox.run("assert False") is failing
    await sandbox.run("print(3)")  # a third program: the least recently used one is dropped
    assert await sandbox.run("assert False") is failing
    again = await sandbox.run(ok)
    assert again.passed and again is not first
    timed_out = Sandbox(SandboxConfig(cache_size=4, time_limit_s=0.5))
    loop = "while True:\n    pass"
    assert (await timed_out.run(loop)).status == "timeout"
    assert len(timed_out._cache) == 0  # a timeout may be the machine's fault: not remembered
    uncached = Sandbox()
    assert await uncached.run(ok) is not await uncached.run(ok)
