"""What the docs and the packaging promise matches the code."""

from __future__ import annotations

import tomllib
from pathlib import Path

from astraflow.workflows.registry import WORKFLOWS

ROOT = Path(__file__).resolve().parents[3]


def test_every_workflow_is_in_the_workflows_table() -> None:
    import astraflow.workflows  # noqa: F401  # registers the built-ins

    text = (ROOT / "docs" / "interfaces.md").read_text()
    rows = {
        line.split("|")[1].strip().strip("`")
        for line in text.splitlines()
        if line.startswith("| `") and line.count("|") == 4
    }
    names = {  # the shipped ones (tests register their own too)
        n for n in WORKFLOWS.names() if WORKFLOWS.resolve(n).__module__.startswith("astraflow.")
    }
    assert names and names <= rows, f"missing from docs/interfaces.md: {sorted(names - rows)}"


def test_optional_imports_are_in_an_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = " ".join(" ".join(v) for v in project["optional-dependencies"].values())
    for package in ("tensorboard", "ray", "math-verify"):  # metrics.tensorboard, launch, math
        assert package in extras, f"{package} is used but in no extra"


def test_tensorboard_metrics_write_events(tmp_path: Path) -> None:
    from astraflow.trainer.config import MetricsConfig
    from astraflow.trainer.metrics import build_sinks

    sinks = build_sinks(tmp_path, MetricsConfig(tensorboard=True), {})
    assert len(sinks) == 2, "tensorboard is installed with the metrics extra"
    for sink in sinks:
        sink.write({"version": 1.0, "loss": 0.5})
        sink.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
