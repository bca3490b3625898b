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
def test_reduced_quickstart_learns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "qs"
    secrets = {"node": "node-secret-1", "trainer": "trainer-secret-2", "admin": "admin-secret-3"}
    weight_secrets = {"READ": "weights-read-secret-4", "PUBLISH": "weights-publish-secret-5"}
    for role, token in weight_secrets.items():  # the weight server's tokens, from the env
        monkeypatch.setenv(f"ASTRAFLOW_WEIGHTS_{role}_TOKEN", token)
    secrets |= weight_secrets
    config = reduced_quickstart(
        run_dir,
        *(f"dataflow.auth.{role}={token}" for role, token in secrets.items() if role.islower()),
        "serve_weights=true",  # nodes pull over HTTP from an authenticated weight server
        steps=250,
    )
    result = LocalRun(config).run()

    assert result.reason == "finished", result
    assert_quickstart_learned(run_dir, steps=250)
    assert processes_mentioning(str(run_dir)) == []
    # with tokens set, every component authenticated (the run finished, the launcher read
    # reports), and no token was written to any config, record or log file of the run
    assert lines(run_dir / "report.jsonl")
    node_logs = "".join(p.read_text() for p in (run_dir / "logs").glob("node-*.log"))
    assert "pulled policy=policy" in node_logs and "refused" not in node_logs
    # the node, its engine process and the trainer froze their start-up heaps once ready
    assert "heap frozen component=node" in node_logs
    assert "heap frozen component=engine process policy" in node_logs
    trainer_log = (run_dir / "logs/trainer-policy.log").read_text()
    assert "heap frozen component=trainer policy" in trainer_log
    for path in [*run_dir.rglob("*.json*"), *run_dir.rglob("*.log")]:
        text = path.read_text(errors="replace")
        assert not any(token in text for token in secrets.values()), path
