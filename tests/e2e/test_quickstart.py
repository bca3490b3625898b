"""The shipped quickstart, reduced, end to end: every component a real process."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.launch.local import LocalRun
from fixtures.launch import (
    assert_quickstart_learned,
    lines,
    processes_mentioning,
    reduced_quickstart,
)

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(240)
def test_reduced_quickstart_learns(tmp_path: Path) -> None:
    run_dir = tmp_path / "qs"
    secrets = {"node": "node-secret-1", "trainer": "trainer-secret-2", "admin": "admin-secret-3"}
    config = reduced_quickstart(
        run_dir, *(f"dataflow.auth.{role}={token}" for role, token in secrets.items()), steps=250
    )
    result = LocalRun(config).run()

    assert result.reason == "finished", result
    assert_quickstart_learned(run_dir, steps=250)
    assert processes_mentioning(str(run_dir)) == []
    # with tokens set, every component authenticated (the run finished, the launcher read
    # reports), and no token was written to any config, record or log file of the run
    assert lines(run_dir / "report.jsonl")
    for path in [*run_dir.rglob("*.json*"), *run_dir.rglob("*.log")]:
        text = path.read_text(errors="replace")
        assert not any(token in text for token in secrets.values()), path
