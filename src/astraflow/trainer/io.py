"""The trainer's two seams: the dataflow (batches, acks, versions) and the weight store.

``BatchSource`` is what the trainer uses of ``astraflow.dataflow.client.DataflowClient`` and
``WeightSink`` what it uses of ``astraflow.weights.WeightStore``; both are imported only in
:func:`connect`, on rank 0. Calls to the dataflow retry while it is unreachable (its state is
durable, so waiting out a restart is correct) until the trainer is asked to stop.
"""

from __future__ import annotations

import copy
import logging
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from astraflow.errors import ServiceUnavailableError
from astraflow.records import (
    AckRequest,
    AnnounceReply,
    Batch,
    HandBackReply,
    HandBackRequest,
    PolicyVersion,
    TakeBatchRequest,
)
from astraflow.trainer.config import TrainerConfig

__all__ = ["BatchSource", "WeightSink", "connect", "publish_assets", "retrying"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@runtime_checkable
class BatchSource(Protocol):
    """The trainer's side of the dataflow service."""

    def take_batch(self, request: TakeBatchRequest) -> Batch | None:
        """A batch of whole groups, or None when the long-poll timed out."""
        ...

    def ack(self, request: AckRequest) -> None:
        """The step on this batch is committed: never serve it again."""
        ...

    def hand_back(self, request: HandBackRequest) -> HandBackReply:
        """A stopping trainer gives back the batches it will not train."""
        ...

    def announce(self, version: PolicyVersion) -> AnnounceReply:
        """Record a published version as the policy's latest."""
        ...

    def versions(self) -> dict[str, PolicyVersion]:
        """Latest announced version per policy."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


@runtime_checkable
class WeightSink(Protocol):
    """The trainer's side of the weight store."""

    def publish_assets(self, policy: str, directory: str | Path) -> None:
        """Store config + tokenizer files once."""
        ...

    def publish(
        self, policy: str, version: int, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]
    ) -> Future[Any]:
        """Start publishing ``version``; resolves when its manifest is written."""
        ...

    def latest(self, policy: str) -> int | None:
        """Newest complete version (None: nothing published)."""
        ...

    def manifest_ref(self, policy: str, version: int) -> str:
        """What to announce for ``version`` (manifest path relative to the store root)."""
        ...

    def close(self) -> None:
        """Wait for pending publishes and release."""
        ...


def connect(config: TrainerConfig) -> tuple[BatchSource, WeightSink]:
    """The real dataflow client and weight store named by ``config`` (rank 0 only)."""
    from astraflow.dataflow.client import DataflowClient
    from astraflow.weights import WeightStore

    token = config.dataflow_token
    client = DataflowClient(
        config.dataflow_url,
        token=None if token is None else token.get_secret_value(),
        timeout_s=config.dataflow_timeout_s,
    )
    store = WeightStore(config.weights, config=config.weights_options)
    return client, store


def publish_assets(store: WeightSink, policy: str, model: Any, tokenizer: Any, dtype: Any) -> None:
    """Save the model config (dtype = the published one), generation config and tokenizer."""
    with tempfile.TemporaryDirectory(prefix="astraflow-assets-") as tmp:
        model_config = copy.deepcopy(model.config)
        model_config.dtype = dtype
        model_config.save_pretrained(tmp)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        store.publish_assets(policy, tmp)


def retrying(
    call: Callable[[], T],
    *,
    what: str,
    stop: threading.Event,
    max_wait_s: float = 10.0,
) -> T:
    """Run ``call``, retrying while the service is unavailable (the client already retried).

    Gives up (re-raises) once ``stop`` is set.
    """
    wait = 0.5
    while True:
        try:
            return call()
        except ServiceUnavailableError as exc:
            if stop.is_set():
                raise
            log.warning("%s failed, retrying in %.1fs: %s", what, wait, exc)
            stop.wait(wait)
            wait = min(max_wait_s, wait * 2)
