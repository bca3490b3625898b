"""Fixtures of the rollout node's service tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from astraflow.raas.endpoint import AgentEndpoint


@pytest.fixture
async def endpoint() -> AsyncIterator[AgentEndpoint]:
    """The agent endpoint serving on loopback in the test's event loop."""
    ep = AgentEndpoint()
    await ep.start()
    yield ep
    await ep.stop()


@pytest.fixture
async def node_policy(tmp_path: Path) -> AsyncIterator[Any]:
    """A rollout node's policy: the transformers engine (batching thread) over a tiny model."""
    from astraflow.models import build_tokenizer
    from astraflow.raas.engines.base import EngineContext, build_engine
    from astraflow.raas.policy import NodePolicy
    from fixtures.workflows import workflow_spec

    spec = workflow_spec(seed=3)
    tok = build_tokenizer(spec)
    context = EngineContext(policy="policy", tokenizer=tok, work_dir=tmp_path, model=spec)
    engine = build_engine({"type": "transformers", "device": "cpu"}, context)
    policy = NodePolicy("policy", tok, engine, frozen=False, from_store=False)
    yield policy
    await policy.close()
