"""Node config validation, the ``astraflow raas serve`` flags, and start-up checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from astraflow.cli.main import build_parser
from astraflow.cli.raas import config_data
from astraflow.config import validate
from astraflow.errors import ConfigError, PluginError
from astraflow.raas.config import NodeConfig
from astraflow.raas.engines.base import ENGINES, EngineContext, build_engine
from astraflow.raas.hosting import build_workflows

BASE = {"dataflow_url": "http://127.0.0.1:1", "weights": "/tmp/w", "policies": {"p": {}}}


def test_node_config_names_every_problem() -> None:
    with pytest.raises(ConfigError, match="unknown key 'capacityy'"):
        validate(NodeConfig, {**BASE, "capacityy": 3}, source="node.yaml")
    with pytest.raises(ConfigError, match="capacity"):
        validate(NodeConfig, {**BASE, "capacity": 0}, source="node.yaml")
    with pytest.raises(ConfigError, match="policies"):
        validate(NodeConfig, {**BASE, "policies": {}}, source="node.yaml")
    with pytest.raises(ConfigError, match="not a valid name"):
        validate(NodeConfig, {**BASE, "policies": {"bad name": {}}}, source="node.yaml")
    with pytest.raises(ConfigError, match=r"policies\.p\.refresh"):
        validate(NodeConfig, {**BASE, "policies": {"p": {"refresh": "budget"}}}, source="x")
    config = validate(NodeConfig, BASE, source="node.yaml")
    assert config.policies["p"].engine.model_dump() == {"type": "transformers"}
    assert {k: v.model_dump() for k, v in config.workflows.items()} == {"rlvr": {"type": "rlvr"}}
    assert config.node_id


def test_flags_override_the_file_and_set_overrides_flags(tmp_path: Path) -> None:
    file = tmp_path / "node.yaml"
    file.write_text(
        "dataflow_url: http://file:1\nweights: /file\ncapacity: 2\npool: file-pool\n"
        "policies: {solver: {refresh: lazy}}\nworkflows: {rlvr: {sampling: {top_k: 4}}}\n"
    )
    args = build_parser().parse_args(
        [
            "raas",
            "serve",
            "--config",
            str(file),
            "--dataflow",
            "http://flag:2",
            "--capacity",
            "5",
            "--policy",
            "solver=/models/m.gguf",
            "--policy",
            "judge=/models/judge",
            "--engine",
            "vllm",
            "--set",
            "capacity=7",
            "--set",
            "policies.judge.frozen=true",
        ]
    )
    data: dict[str, Any] = config_data(args)
    config = validate(NodeConfig, data, source="test")
    assert config.dataflow_url == "http://flag:2" and config.weights == "/file"
    assert config.capacity == 7 and config.pool == "file-pool"
    solver = config.policies["solver"]
    assert solver.refresh == "lazy" and solver.engine.type == "vllm"
    assert solver.model is not None and solver.model.gguf_file == "m.gguf"
    assert solver.model.name_or_path == "/models"
    assert config.policies["judge"].is_frozen
    assert config.workflows["rlvr"].model_dump() == {"type": "rlvr", "sampling": {"top_k": 4}}


def test_raas_help_does_not_import_torch() -> None:
    code = (
        "import sys\nfrom astraflow.cli.main import main\n"
        "try:\n    main(['raas', 'serve', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\nprint('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--policy NAME[=MODEL]" in out.stdout and out.stdout.strip().endswith("ok")


def test_unknown_engine_and_bad_engine_options_are_named(tmp_path: Path) -> None:
    context = EngineContext(policy="p", tokenizer=None, work_dir=tmp_path)
    with pytest.raises(PluginError, match="unknown engine 'tensorrt'"):
        build_engine({"type": "tensorrt"}, context)
    with pytest.raises(PluginError, match="unknown key 'batch'"):
        build_engine({"type": "transformers", "batch": 3}, context)
    assert {"transformers", "vllm", "sglang", "openai"} <= set(ENGINES.names())


def test_a_workflow_must_find_its_policies_on_the_node() -> None:
    config = NodeConfig.model_validate({**BASE, "workflows": {"rlvr": {"policy": "solver"}}})
    with pytest.raises(ConfigError, match=r"calls policies \['solver'\]"):
        build_workflows(config, {"p": object()})  # type: ignore[dict-item]
    ok = build_workflows(config, {"solver": object()})  # type: ignore[dict-item]
    assert list(ok) == ["rlvr"] and list(ok["rlvr"].policies) == ["solver"]
