"""Ctrl-C stops every component; a crashed launcher leaves nothing; the same command resumes."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from astraflow.trainer.checkpoint import latest_checkpoint
from fixtures.launch import QUICKSTART, ROOT, lines, processes_mentioning, wait_for

pytestmark = pytest.mark.e2e


def _launch(run_dir: Path, steps: int) -> subprocess.Popen[bytes]:
    """``astraflow run`` as a user starts it, in its own process group (like a terminal job);
    a short warm-up (what is learnt does not matter here)."""
    return subprocess.Popen(
        [sys.executable, "-m", "astraflow", "run", str(QUICKSTART),
         "--set", f"run_dir={run_dir}", "--set", f"policies.policy.trainer.max_steps={steps}",
         "--set", "policies.policy.trainer.checkpoint.every=10", "--set", "eval=[]",
         "--set", "policies.policy.warmup.steps=10"],
        cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


def _versions(run_dir: Path) -> list[int]:
    return [int(json.loads(x)["version"]) for x in lines(run_dir / "trainers/policy/metrics.jsonl")]


@pytest.mark.timeout(300)
def test_ctrl_c_then_crash_then_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "interrupted"
    proc = _launch(run_dir, steps=100_000)
    wait_for(lambda: len(_versions(run_dir)) >= 5, 120, "5 trainer steps")
    assert len(processes_mentioning(str(run_dir))) >= 3  # dataflow, trainer, node

    # Ctrl-C as a terminal sends it: SIGINT to the whole foreground process group
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out.decode()[-3000:]
    assert b"run stopped" in out
    assert processes_mentioning(str(run_dir)) == []
    stopped_at = _versions(run_dir)[-1]
    # nothing lost: the last version is checkpointed (not only the periodic one, every 10)
    checkpoint = latest_checkpoint(run_dir / "trainers/policy/checkpoints")
    assert checkpoint is not None and checkpoint.name == f"step-{stopped_at:08d}"

    # the same command resumes (past the periodic checkpoint of version 10 when it stopped
    # before it); then the launcher itself dies by kill -9: nothing survives it
    proc = _launch(run_dir, steps=100_000)
    wait_for(lambda: _versions(run_dir)[-1] >= max(stopped_at + 5, 11), 120, "training to resume")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    wait_for(lambda: processes_mentioning(str(run_dir)) == [], 30, "components to die with it")
    crashed_at = _versions(run_dir)[-1]

    # and resumes again after the crash (from an older checkpoint than the store's latest
    # version), up to max_steps, versions strictly increasing
    target = crashed_at + 5
    proc = _launch(run_dir, steps=target)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out.decode()[-3000:]
    versions = _versions(run_dir)
    assert versions[-1] == target
    # every launch started its node under the id of the one before (so the dataflow re-queues
    # a dead process's leases at once instead of holding training back until they expire)
    assert len(list((run_dir / "components").glob("node-*.json"))) == 1
    assert all(b > a for a, b in itertools.pairwise(versions)), "versions repeat"
    assert processes_mentioning(str(run_dir)) == []
