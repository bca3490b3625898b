"""Contract snapshots: the /v1 JSON schemas, the plug-in Protocols, the client methods, and
the protocols plug-in authors implement or call (Workflow, PolicyHandle, Tool, Reward,
TaskGenerator, Engine, trainer backend) with the records they pass.

A breaking change shows up here as a diff. After an intended change, regenerate with
``ASTRAFLOW_UPDATE_SNAPSHOTS=1 pytest tests/contract`` and review the diff.
"""

from __future__ import annotations

import dataclasses
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


def _protocol(cls: type) -> dict[str, Any]:
    """Methods (signatures), properties (return annotations) and attributes of a Protocol."""
    members: dict[str, Any] = {}
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") and name != "__call__":
            continue
        if isinstance(member, property) and member.fget is not None:
            members[name] = f"property -> {inspect.signature(member.fget).return_annotation}"
        elif inspect.isfunction(member):
            kind = "async " if inspect.iscoroutinefunction(member) else ""
            members[name] = f"{kind}def {inspect.signature(member)}"
    members |= {
        name: f"attribute: {annotation}"
        for name, annotation in inspect.get_annotations(cls).items()
        if not name.startswith("_")
    }
    return members


def _record(cls: type) -> dict[str, str]:
    """Fields of a dataclass or pydantic model handed to plug-in code, with their types."""
    if dataclasses.is_dataclass(cls):
        return {f.name: str(f.type) for f in dataclasses.fields(cls)}
    fields = getattr(cls, "model_fields")  # noqa: B009  # pydantic models
    return {name: str(info.annotation) for name, info in fields.items()}


def test_author_protocols() -> None:
    from astraflow.raas.engines import base as engines
    from astraflow.trainer.backends.base import TrainBackend
    from astraflow.workflows import agent, api
    from astraflow.workflows.rewards import Reward
    from astraflow.workflows.tasks import TaskGenerator

    protocols = {
        "Workflow": api.Workflow,
        "PolicyHandle": api.PolicyHandle,
        "Tool": api.Tool,
        "Reward": Reward,
        "TaskGenerator": TaskGenerator,
        "Engine": engines.Engine,
        "WeightSource": engines.WeightSource,
        "TrainBackend": TrainBackend,
        "AgentGateway": agent.AgentGateway,
        "GatewayUser": agent.GatewayUser,
    }
    records = {
        "Generation": api.Generation,
        "SamplingParams": api.SamplingParams,
        "GenerationRequest": engines.GenerationRequest,
        "EngineOutput": engines.EngineOutput,
        "EngineContext": engines.EngineContext,
    }
    _check(
        "author_protocols.json",
        {
            "protocols": {name: _protocol(cls) for name, cls in protocols.items()},
            "records": {name: _record(cls) for name, cls in records.items()},
        },
    )
