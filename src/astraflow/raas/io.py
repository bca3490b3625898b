"""What a rollout node needs from the dataflow service and the weight store (its two seams).

The real ones are ``astraflow.dataflow.client.AsyncDataflowClient`` and
``astraflow.weights.WeightClient``; tests may hand a node others that satisfy these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from astraflow import records as rec
from astraflow.raas.engines.base import WeightSource

__all__ = ["TaskFeed", "VersionWatch", "WeightFeed"]


class TaskFeed(Protocol):
    """The node's side of the dataflow service."""

    async def lease(self, req: rec.LeaseRequest) -> rec.LeaseReply:
        """Tasks for free slots (maybe none, with the reason)."""
        ...

    async def renew(self, req: rec.RenewRequest) -> rec.RenewReply:
        """Heartbeat: extend the node's leases; names the ones it lost."""
        ...

    async def submit(self, req: rec.SubmitRequest) -> rec.SubmitReply:
        """A task's samples (idempotent on ``(task_id, attempt)``)."""
        ...

    async def fail(self, req: rec.FailRequest) -> rec.FailReply:
        """A task that could not be completed."""
        ...

    async def release(self, req: rec.ReleaseRequest) -> rec.ReleaseReply:
        """Hand leases back (graceful stop)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


@runtime_checkable
class VersionWatch(Protocol):
    """A feed that can long-poll for new versions (the node hears of them as announced)."""

    async def watch_versions(self, req: rec.WatchVersionsRequest) -> dict[str, rec.PolicyVersion]:
        """The latest versions once one in ``req.known`` is newer, or at the timeout."""
        ...


class WeightFeed(WeightSource, Protocol):
    """The node's side of the weight store: versions, assets, full loads and delta pulls."""

    def latest(self, policy: str) -> int | None:
        """Newest complete version (None: nothing published)."""
        ...

    def fetch_assets(self, policy: str, dest_dir: str | Path) -> Path:
        """Copy the policy's HF config and tokenizer files into ``dest_dir``."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...
