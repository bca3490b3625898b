"""Contract snapshots: the /v1 JSON schemas, the plug-in Protocols and the client methods.

A breaking change shows up here as a diff. After an intended change, regenerate with
``ASTRAFLOW_UPDATE_SNAPSHOTS=1 pytest tests/contract`` and review the diff.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

import pytest

from astraflow.data_algorithms import protocols
from astraflow.dataflow.client import AsyncDataflowClient, DataflowClient
from astraflow.records import wire_schemas

SNAPSHOTS = Path(__file__).parent / "snapshots"


def _check(name: str, value: Any) -> None:
    path = SNAPSHOTS / name
    text = json.dumps(value, indent=1, sort_keys=True) + "\n"
    if os.environ.get("ASTRAFLOW_UPDATE_SNAPSHOTS"):
        path.write_text(text)
    if not path.exists():
        pytest.fail(f"no snapshot {path}; run with ASTRAFLOW_UPDATE_SNAPSHOTS=1 to create it")
    assert json.loads(path.read_text()) == json.loads(text), (
        f"{name} changed: review, then regenerate with ASTRAFLOW_UPDATE_SNAPSHOTS=1"
    )


def _methods(cls: type) -> dict[str, str]:
    return {
        name: str(inspect.signature(fn))
        for name, fn in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def test_wire_schemas() -> None:
    _check("wire_schemas.json", dict(wire_schemas()))


def test_plugin_protocols() -> None:
    found = {
        name: _methods(cls)
        for name in ("TaskSelector", "TrajectoryFilter", "BatchSampler", "TaskCatalog")
        for cls in [getattr(protocols, name)]
    }
    views = {
        name: {f: str(t) for f, t in inspect.get_annotations(getattr(protocols, name)).items()}
        for name in ("SourceView", "TaskRef", "GroupResult", "GroupView", "BatchQuery")
    }
    _check("plugin_protocols.json", {"protocols": found, "views": views})
    assert all(len(m) <= 5 for m in found.values())  # small Protocols


def test_client_methods_match() -> None:
    sync, asynchronous = _methods(DataflowClient), _methods(AsyncDataflowClient)
    assert sync.keys() == asynchronous.keys()
    _check("dataflow_client.json", sync)
