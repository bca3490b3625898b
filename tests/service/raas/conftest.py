"""Fixtures of the rollout node's service tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from astraflow.raas.endpoint import AgentEndpoint


@pytest.fixture
async def endpoint() -> AsyncIterator[AgentEndpoint]:
    """The agent endpoint serving on loopback in the test's event loop."""
    ep = AgentEndpoint()
    await ep.start()
    yield ep
    await ep.stop()
