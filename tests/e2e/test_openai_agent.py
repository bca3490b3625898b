"""The shipped OpenAI-SDK agent example, reduced, end to end: every component a real process.

The agent program imports only ``openai``; the node serves it an OpenAI-compatible endpoint,
records its calls token-exactly and submits them; the trainer trains on them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from astraflow.config import load_config
from astraflow.launch.config import RunConfig
from astraflow.launch.local import LocalRun
from fixtures.launch import ROOT, lines, processes_mentioning

pytestmark = pytest.mark.e2e

pytest.importorskip("openai")


@pytest.mark.timeout(300)
def test_reduced_openai_agent_example_trains(tmp_path: Path) -> None:
    run_dir = tmp_path / "agent"
    steps = 6
    config = load_config(
        RunConfig,
        ROOT / "examples" / "openai_agent.yaml",
        [
            f"run_dir={run_dir}",
            "policies.policy.warmup.steps=20",
            f"policies.policy.trainer.max_steps={steps}",
            "policies.policy.trainer.batch.min_samples=16",
            "policies.policy.trainer.batch.max_samples=16",
            "sources.0.group_size=4",
            "max_time_s=240",
        ],
    )
    result = LocalRun(config).run()
    assert result.reason == "finished", result
    metrics = [json.loads(x) for x in lines(run_dir / "trainers/policy/metrics.jsonl")]
    assert [int(m["version"]) for m in metrics] == list(range(1, steps + 1))
    assert all(0.0 <= m["reward_mean"] <= 1.0 for m in metrics)
    # step 1 trains on version-0 samples only: the logprobs the endpoint captured are the
    # trainer's own, token for token (re-tokenised text would move these ratios)
    first = metrics[0]
    assert abs(first["is_ratio_mean"] - 1.0) < 1e-3, first
    assert first["is_ratio_max"] < 1.01 and first["is_ratio_min"] > 0.99, first
    node_logs = "".join(p.read_text() for p in (run_dir / "logs").glob("node-*.log"))
    assert "agent endpoint serving" in node_logs
    assert "task failed" not in node_logs
    assert processes_mentioning(str(run_dir)) == []
