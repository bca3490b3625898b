"""The GPU agent recipes (``examples/gpu/*.yaml``): marked as GPU-only, and valid as configs.

They cannot run here (vLLM on a GPU, Qwen2.5 weights from the hub); what can be checked is
that each passes ``astraflow config check`` and that its environment spec builds a factory
(the environment's own ``Config`` validates the keyword arguments).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.config import load_config
from astraflow.envs import EnvFactory
from astraflow.launch.checks import check_run
from astraflow.launch.config import RunConfig

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "gpu"
RECIPES = sorted(EXAMPLES.glob("*.yaml"))


def test_there_is_a_gpu_recipe_per_workload() -> None:
    names = {p.stem for p in RECIPES}
    assert {"textcraft", "household", "shop", "search_agent", "nim_two_policies"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_gpu_recipe_passes_config_check(path: Path) -> None:
    head = path.read_text().split("\n", 2)[0]
    assert "requires: gpu" in head, f"{path.name}: the first line must say 'requires: gpu'"
    config = load_config(RunConfig, path, [])
    assert check_run(config) == []
    engines = {p.rollout.engine.type for p in config.policies.values()}
    assert engines == {"vllm"}
    for spec in config.workflows.values():
        env = spec.kwargs.get("env")
        if env is not None:
            EnvFactory(env)
