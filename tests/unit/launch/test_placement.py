"""``placement``: CPU affinity per component kind for local processes, typed in the run config,
checked against this machine by ``astraflow config check``, applied to the real process."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from astraflow.cli.main import main
from astraflow.launch.processes import Proc

QUICKSTART = Path(__file__).resolve().parents[3] / "examples" / "quickstart.yaml"


def _check(capsys: pytest.CaptureFixture[str], *overrides: str) -> tuple[int, str]:
    args = ["config", "check", "--config", str(QUICKSTART)]
    for item in overrides:
        args += ["--set", item]
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_config_check_accepts_usable_cpus_and_names_bad_placements(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cpu = min(os.sched_getaffinity(0))
    assert _check(capsys, f"placement={{trainer: [{cpu}], node: [{cpu}]}}")[0] == 0
    code, out = _check(capsys, "placement={node: [4096]}")
    assert code != 0 and "placement.node: CPU 4096 is not available here" in out
    code, out = _check(capsys, f"placement={{trainer: [{cpu}, {cpu}]}}")
    assert code != 0 and "placement.trainer" in out and "distinct" in out
    code, out = _check(capsys, "placement={trainr: [0]}")
    assert code != 0 and "trainr" in out
    code, out = _check(capsys, "placement={eval: [-1]}")
    assert code != 0 and "placement" in out


def test_a_placed_process_runs_on_its_cpus_only(tmp_path: Path) -> None:
    cpu = max(os.sched_getaffinity(0))
    out = tmp_path / "affinity.txt"
    code = f"import os; open({str(out)!r}, 'w').write(repr(sorted(os.sched_getaffinity(0))))"
    proc = Proc("probe", "trainer", [sys.executable, "-c", code], tmp_path / "probe.log",
                restart=False, cpus=(cpu,))  # fmt: skip
    proc.start()
    deadline = time.monotonic() + 30
    while proc.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.read_text() == repr([cpu])
