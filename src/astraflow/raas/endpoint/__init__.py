"""The node's OpenAI-compatible endpoint for agent programs (``agent`` workflow)."""

from __future__ import annotations

from collections.abc import Mapping

from astraflow.raas.endpoint.app import AgentEndpoint
from astraflow.workflows.agent import GatewayUser
from astraflow.workflows.api import Workflow

__all__ = ["AgentEndpoint", "bind_endpoint"]


async def bind_endpoint(workflows: Mapping[str, Workflow]) -> AgentEndpoint | None:
    """Start the node's one endpoint when a workflow needs it, and bind it; else None."""
    users = [w for w in workflows.values() if isinstance(w, GatewayUser)]
    if not users:
        return None
    endpoint = AgentEndpoint()
    await endpoint.start()
    for workflow in users:
        workflow.bind_gateway(endpoint)
    return endpoint
