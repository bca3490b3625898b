"""Task sources (JSONL, Parquet, datasets), config validation, and import hygiene."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from astraflow.config import load_config
from astraflow.data_algorithms import TaskRef
from astraflow.dataflow.config import DataflowConfig, SourceConfig
from astraflow.dataflow.service import DataflowService
from astraflow.dataflow.sources import load_source
from astraflow.errors import ConfigError
from fixtures.dataflow import arith_rows, make_config, write_rows


def source(**kw: Any) -> SourceConfig:
    base: dict[str, Any] = {
        "name": "s",
        "type": "jsonl",
        "path": "x",
        "workflow": "rlvr",
        "policies": ["solver"],
    }
    base.update(kw)
    return SourceConfig.model_validate(base)


def test_jsonl_ids_epochs_and_limit(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "t.jsonl", arith_rows(5))
    src = load_source(source(path=str(path), id_field="id", group_size=4))
    task = src.task(TaskRef("s", 3, 2))
    assert task.task_id == "s/q3@e2" and task.group_size == 4 and task.source == "s"
    assert task.payload["question"] == "3+0=" and task.meta == {
        "row_id": "q3",
        "index": 3,
        "epoch": 2,
    }
    by_index = load_source(source(path=str(path), limit=2))
    assert len(by_index) == 2 and by_index.task(TaskRef("s", 1, 0)).task_id == "s/1@e0"


def test_parquet_and_datasets_give_the_same_tasks(tmp_path: Path) -> None:
    rows = arith_rows(6)
    jsonl = load_source(source(path=str(write_rows(tmp_path / "t.jsonl", rows)), id_field="id"))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    parquet = load_source(source(type="parquet", path=str(tmp_path / "t.parquet"), id_field="id"))
    ds = datasets.Dataset.from_list(rows)
    hf = load_source(source(type="hf", path=None, id_field="id"), dataset=ds)
    ds.save_to_disk(str(tmp_path / "saved"))
    saved = load_source(source(type="hf", path=str(tmp_path / "saved"), id_field="id"))
    for i in range(6):
        ref = TaskRef("s", i, 0)
        assert jsonl.task(ref) == parquet.task(ref) == hf.task(ref) == saved.task(ref)


def test_source_errors_name_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not valid JSON"):
        load_source(source(path=str(bad)))
    with pytest.raises(ConfigError, match="file not found"):
        load_source(source(path=str(tmp_path / "missing.jsonl")))
    dup = write_rows(tmp_path / "dup.jsonl", [{"id": 1}, {"id": 1}, {"id": 2}])
    with pytest.raises(ConfigError, match="repeats ids 1"):
        load_source(source(path=str(dup), id_field="id"))
    with pytest.raises(ConfigError, match="row 0 has no id field 'key'"):
        load_source(source(path=str(dup), id_field="key"))


def test_config_validation_names_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key 'policies.solver.vocab'"):
        load_config(DataflowConfig, base={"policies": {"solver": {"vocab": 3}}})
    with pytest.raises(ValueError, match="undeclared policies"):
        make_config(tmp_path / "a", policies={"other": {"vocab_size": 3}})
    with pytest.raises(ValueError, match="replay' needs policies"):
        make_config(tmp_path / "b", sampler={"type": "replay", "ratio": 0.5})
    with pytest.raises(ValueError, match="needs 'path'"):
        source(path=None)
    with pytest.raises(ValueError, match="source names must be unique"):
        cfg = make_config(tmp_path / "c").model_dump(mode="json")
        cfg["sources"] *= 2
        DataflowConfig.model_validate(cfg)


def test_plugin_config_errors_surface_at_start(tmp_path: Path) -> None:
    cfg = make_config(tmp_path / "d", filters=[{"type": "length", "max_tokns": 3}])
    with pytest.raises(ConfigError, match="unknown key 'max_tokns'"):
        DataflowService(cfg)
    cfg = make_config(tmp_path / "e", selector={"type": "curriculum", "field": "nope"})
    with pytest.raises(ConfigError, match="'nope' is missing from row 'q0'"):
        DataflowService(cfg)


def test_imports_leave_torch_out() -> None:
    code = (
        "import sys, astraflow.dataflow, astraflow.dataflow.client, astraflow.data_algorithms;"
        "assert 'torch' not in sys.modules, 'torch imported';"
        "assert 'starlette' not in sys.modules, 'server imported by the client';"
        "import astraflow.dataflow.server, astraflow.data_algorithms.samplers;"
        "assert 'torch' not in sys.modules, 'torch imported by the server'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_help_explains_serve() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "astraflow.cli.main", "dataflow", "serve", "--help"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "--config FILE" in out and "policies:" in out and "ASTRAFLOW_NODE_TOKEN" in out


def test_generator_source_uses_the_workflows_registry() -> None:
    tasks_mod = pytest.importorskip("astraflow.workflows.tasks", reason="workflows not built")
    if "add1" not in tasks_mod.GENERATORS.names():
        pytest.skip("the add1 generator is not registered (workflows component)")
    cfg = source(type="generator", path=None, generator={"type": "add1", "size": 50}, limit=20)
    first = load_source(cfg, seed=3)
    again = load_source(cfg, seed=3)
    assert len(first) == 20
    assert first.ids == again.ids  # stable ids: a restarted service regenerates the same tasks
    task = first.task(TaskRef("s", 0, 0))
    assert task.task_id == f"s/{first.ids[0]}@e0" and task.payload == again.row(0)
