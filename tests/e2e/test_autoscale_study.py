"""``benchmarks/autoscale_study.py --quick``: the MCP maintainer arm end to end (smoke)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import autoscale_study

pytestmark = pytest.mark.e2e


def test_quick_study_resizes_through_mcp_and_writes_its_figure(tmp_path: Path) -> None:
    out = tmp_path / "study"
    assert autoscale_study.main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    (arm,) = data["arms"]
    assert arm["arm"] == "mcp" and arm["timeline"]
    # one node cannot keep up with the trainer: the maintainer grows the pool through the tool
    assert arm["resizes"] and not any(r["error"] for r in arm["resizes"])
    assert arm["resizes"][0]["delta"] == 1
    assert max(r["desired"] or 0 for r in arm["timeline"]) >= 2
    assert [p["phase"] for p in arm["phases"]][:2] == ["base", "trainer 2x faster"]
    assert out.with_suffix(".png").stat().st_size > 10_000
