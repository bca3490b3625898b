"""The trainer loop: take → loss → step → publish → announce → ack, pipelined on rank 0.

    ┌─► rank 0: the prefetched batch (or take_batch now) ──(None: poll again)──┐
    │   rank 0: start taking the next batch in the background (pipeline.py)   │
    │   broadcast the batch (msgpack bytes) to every rank                       │
    │   all ranks: loss → backward → optimizer step  (step.py; or the plug-in   │
    │     ``trainer.update`` that wraps it, updates.py)                         │
    │   all ranks: gather full state dict → rank 0: wait for the previous       │
    │     version's publish, copy, hand write → announce → ack to the publisher │
    │   all ranks: checkpoint v+1 if due (the ack waits for it)                 │
    └──────────────────────── v = v+1; metrics ◄────────────────────────────────┘

The critical path holds only the take's wait (when the prefetch did not finish first), the
step, the host copy of the new weights and, when the previous version's publish is slower
than a step, the rest of it. A batch is acked after the version holding its update is written
and announced (and checkpointed, when one is due); each step's timeline (``wait_s``,
``compute_s``, ``publish_s`` on the critical path; ``publish_write_s``, ``announce_s``,
``ack_s`` of the previous version, in the background) is in the metrics. Start-up and resume
(version 0, reconciling with the store) are in :meth:`Trainer.start`; the state itself in
runtime.py. Versions only grow: a resumed trainer whose checkpoint is older than the store's
latest version continues after that version (see docs/interfaces.md §3).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from astraflow.config import dump_config
from astraflow.errors import AstraflowError, ConflictError, NotFoundError, ValidationError
from astraflow.models import torch_dtype
from astraflow.plugins import PluginSpec
from astraflow.records import (
    AckRequest,
    Batch,
    HandBackRequest,
    PolicyVersion,
    TakeBatchRequest,
    pack,
    unpack,
)
from astraflow.trainer.backends.base import TrainBackend, build_backend
from astraflow.trainer.config import TrainerConfig
from astraflow.trainer.io import BatchSource, WeightSink, connect, publish_assets, retrying
from astraflow.trainer.metrics import MetricsSink, build_sinks, drop_unpublished_metrics
from astraflow.trainer.pipeline import Prefetcher, Publisher, PublishTimes
from astraflow.trainer.runtime import Runtime, build_runtime
from astraflow.trainer.updates import check_stats

__all__ = ["Trainer"]

log = logging.getLogger(__name__)

_STOP: Final = b"S"
_NONE: Final = b"N"
_BATCH: Final = b"B"
#: Longest single long-poll, so a stop request is seen within a few seconds.
_POLL_S: Final = 5.0


class Trainer:
    """One policy's trainer; every rank builds one, rank 0 talks to the outside world."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        backend: TrainBackend | None = None,
        dataflow: BatchSource | None = None,
        store: WeightSink | None = None,
        sinks: Sequence[MetricsSink] | None = None,
        on_step: Callable[[dict[str, float]], None] | None = None,
    ) -> None:
        self.config = config
        self.backend = backend if backend is not None else build_backend(config)
        self.dataflow = dataflow
        self.store = store
        self._sinks = list(sinks) if sinks is not None else None
        self._on_step = on_step
        self._rt: Runtime | None = None
        self._wait_s = 0.0
        self._unsaved = False  # updates published since the last checkpoint
        self._assets_published = False  # by this process, before the warm-up
        self._prefetch = Prefetcher()
        self._publisher = Publisher()
        update = PluginSpec.coerce(config.update).type if config.update else None
        self._step_name = f"trainer update {update!r}" if update else "the built-in update"

    @property
    def runtime(self) -> Runtime:
        """Model, optimizer and version (after :meth:`start`)."""
        if self._rt is None:
            raise RuntimeError("call Trainer.start() first")
        return self._rt

    @property
    def version(self) -> int:
        """The newest version these weights are (or follow)."""
        return self.runtime.version

    # ------------------------------------------------------------------ start-up

    def start(self) -> None:
        """Build or resume the state; on rank 0 reconcile with the store and the dataflow."""
        rank0 = self.backend.rank == 0
        if rank0 and (self.dataflow is None or self.store is None):
            self.dataflow, self.store = connect(self.config)
        rt = self._rt = build_runtime(
            self.config, self.backend, on_fresh=self._publish_assets_early if rank0 else None
        )
        floor, publish = -1, False
        if rank0:
            run_dir = Path(self.config.run_dir)
            dump_config(self.config, run_dir / "trainer_config.json")
            floor, publish = self._reconcile(rt)
            if self._sinks is None:
                drop_unpublished_metrics(run_dir / "metrics.jsonl", floor)
                self._sinks = build_sinks(
                    run_dir, self.config.metrics, self.config.model_dump(mode="json")
                )
        shared = self.backend.broadcast_bytes(json.dumps([floor, publish]).encode())
        floor, publish = json.loads(shared)
        if publish:  # a first start: the initial weights become version `floor` (0)
            self._publish_initial(rt, floor)
        elif floor > rt.version:
            log.warning(
                "policy=%s checkpoint version=%d is older than the latest published=%d: its "
                "later updates are lost; continuing at version %d",
                self.config.policy, rt.version, floor, floor + 1,
            )  # fmt: skip
            rt.version = floor
        log.info(
            "trainer ready policy=%s version=%d rank=%d world_size=%d",
            self.config.policy, rt.version, self.backend.rank, self.backend.world_size,
        )  # fmt: skip

    def _reconcile(self, rt: Runtime) -> tuple[int, bool]:
        """Rank 0: re-ack and re-announce what a crash left undone; decide the version floor.

        Returns the highest version used for this policy (store or dataflow), or the version
        to publish the initial weights as when the store has none (with True).
        """
        assert self.dataflow is not None and self.store is not None
        policy = self.config.policy
        stop = threading.Event()
        if rt.resumed and rt.last_batch_id:
            self._ack(rt.last_batch_id, stop)  # its update is in the checkpoint: never re-serve
        latest = self.store.latest(policy)
        current = retrying(self.dataflow.versions, what="versions", stop=stop).get(policy)
        announced = current.version if current is not None else -1
        if latest is None:
            return max(rt.version, announced + 1), True
        if announced < latest:  # crashed between publish and announce
            self._announce(latest, stop, final=latest == self.config.max_steps)
        if not rt.resumed:
            log.warning(
                "policy=%s the weight store already holds versions up to %d but there is no "
                "checkpoint in %s: training starts from fresh weights",
                policy, latest, self.config.checkpoint_dir,
            )  # fmt: skip
        return max(latest, announced), False

    # ------------------------------------------------------------------ the loop

    def run(self, stop: threading.Event | None = None) -> int:
        """Train until ``stop`` is set or ``max_steps`` is reached; returns the last version.

        Raises:
            PublishError: a version could not be published, announced or acked.
        """
        rt = self.runtime
        stop = stop if stop is not None else threading.Event()
        while True:
            batch = self._take(stop)
            if batch is _STOP:
                break
            if not isinstance(batch, Batch):
                continue
            self._prefetch_next(stop)
            stats = check_stats(rt.step.run(batch.samples, rt.version), self._step_name)
            publish_s, previous = self._commit(batch, stop)
            self._record(stats, publish_s, previous)
        if self.backend.rank == 0:
            self._publisher.wait()  # the last version is written, announced, its batch acked
            if self._prefetch.abandoned:
                self._hand_back()
        if self._unsaved:
            rt.save()
            self._unsaved = False
        log.info("trainer stopped policy=%s version=%d", self.config.policy, rt.version)
        return rt.version

    def _room(self, version: int) -> bool:
        """A batch trained on ``version`` stays within ``max_steps``."""
        limit = self.config.max_steps
        return limit is None or version < limit

    def _take(self, stop: threading.Event) -> Batch | bytes | None:
        """Rank 0: the prefetched batch, else a long-poll now; every rank gets the batch (or
        stop / nothing). A batch prefetched before a stop request is still trained; a stop
        request does not wait for a long-poll still in flight (see pipeline.py)."""
        rt = self.runtime
        batch: Batch | None = None
        payload = _STOP
        if self.backend.rank == 0:
            start = time.perf_counter()
            if self._prefetch.in_flight:
                batch = self._prefetch.result(stop)
            if batch is None and not stop.is_set() and self._room(rt.version):
                version = rt.version
                self._prefetch.start(lambda: self._poll(stop, version))
                batch = self._prefetch.result(stop)
            self._wait_s += time.perf_counter() - start
            if batch is not None:
                payload = _BATCH + pack(batch) if self.backend.world_size > 1 else _BATCH
            elif not stop.is_set() and self._room(rt.version):
                payload = _NONE
        data = self.backend.broadcast_bytes(payload if self.backend.rank == 0 else None)
        kind = data[:1]
        if kind == _STOP:
            return _STOP
        if kind == _NONE:
            return None
        return batch if batch is not None else unpack(Batch, data[1:])

    def _prefetch_next(self, stop: threading.Event) -> None:
        """Rank 0: take the batch of the next step while this one computes."""
        version = self.runtime.version + 1  # the weights the next batch will be trained on
        if self.backend.rank == 0 and not stop.is_set() and self._room(version):
            self._prefetch.start(lambda: self._poll(stop, version))

    def _poll(self, stop: threading.Event, version: int) -> Batch | None:
        dataflow = self.dataflow
        assert dataflow is not None
        cfg = self.config
        request = TakeBatchRequest(
            policy=cfg.policy,
            trainer_id=cfg.trainer_id,
            trainer_version=version,
            min_samples=cfg.batch.min_samples,
            max_samples=cfg.batch.max_samples,
            timeout_s=min(cfg.batch.take_timeout_s, _POLL_S),
            holding=self._prefetch.holding(),
        )
        try:
            batch = retrying(lambda: dataflow.take_batch(request), what="take_batch", stop=stop)
        except ConnectionError:
            if stop.is_set():
                return None
            raise
        if batch is not None:
            self._prefetch.taken(batch.batch_id)
            self._check(batch)
        return batch

    def _hand_back(self) -> None:
        """A stop left a take waiting: end it and give back what it may have brought (every
        trained batch is acked by now), so its groups are served again at once, not at their
        ack deadline."""
        assert self.dataflow is not None
        request = HandBackRequest(policy=self.config.policy, trainer_id=self.config.trainer_id)
        try:
            n = self.dataflow.hand_back(request).batches
        except AstraflowError as exc:
            log.warning("could not hand back the prefetched batch (it is served again at its "
                        "ack deadline): %s", exc)  # fmt: skip
            return
        if n:
            log.info("handed back %d untrained batch(es) policy=%s", n, self.config.policy)

    def _check(self, batch: Batch) -> None:
        if batch.policy != self.config.policy:
            raise ValidationError(
                f"batch {batch.batch_id} is for policy {batch.policy!r}, "
                f"this trainer trains {self.config.policy!r}",
                field="policy",
            )
        vocab = getattr(getattr(self.runtime.model, "config", None), "vocab_size", None)
        if vocab is not None:
            for sample in batch.samples:
                sample.check_vocab(int(vocab))

    def _commit(self, batch: Batch, stop: threading.Event) -> tuple[float, PublishTimes | None]:
        """Hand the new version to the publisher, checkpoint if due.

        Returns the seconds this took on the critical path (state dict, waiting for the
        previous version's publish, host copy) and the previous version's background times.
        """
        rt = self.runtime
        version = rt.version + 1
        start = time.perf_counter()
        tensors = self.backend.full_state_dict(rt.model, rt.publish_dtype)
        previous = written = None
        if self.backend.rank == 0:
            assert self.store is not None
            previous = self._publisher.wait()  # at most one publish in flight
            written = self.store.publish(self.config.policy, version, tensors)  # host copy
        del tensors
        publish_s = time.perf_counter() - start
        rt.version, rt.last_batch_id = version, batch.batch_id
        every = self.config.checkpoint.every
        self._unsaved = not (every and version % every == 0)
        saved, ok = threading.Event(), [False]  # a due checkpoint is written before the ack
        if self.backend.rank == 0:
            final = version == self.config.max_steps

            def ack() -> None:
                saved.wait()
                if not ok[0]:
                    raise RuntimeError(f"checkpoint of version {version} failed: not acked")
                self._ack(batch.batch_id, stop)

            self._publisher.submit(
                version, written, lambda: self._announce(version, stop, final=final), ack
            )
        try:
            if not self._unsaved:
                rt.save()
            ok[0] = True
        finally:
            saved.set()
        return publish_s, previous

    def _publish_assets_early(self, model: Any, tokenizer: Any) -> None:
        """Rank 0, fresh weights: publish the assets (config, tokenizer) before the warm-up
        when the store has no version of this policy yet, so that rollout nodes and
        evaluators build their engines while the trainer warms up, not after version 0."""
        assert self.store is not None
        policy = self.config.policy
        if self.store.latest(policy) is None:
            dtype = torch_dtype(self.config.publish_dtype)
            publish_assets(self.store, policy, model, tokenizer, dtype)
            self._assets_published = True

    def _publish_initial(self, rt: Runtime, version: int) -> None:
        """Publish assets (unless done before the warm-up) and the initial weights as
        ``version``, announce, checkpoint."""
        tensors = self.backend.full_state_dict(rt.model, rt.publish_dtype)  # all ranks
        if self.backend.rank == 0:
            assert self.store is not None
            policy = self.config.policy
            if not self._assets_published:
                publish_assets(self.store, policy, rt.model, rt.tokenizer, rt.publish_dtype)
            self.store.publish(policy, version, tensors).result()
            self._announce(version, threading.Event())
        del tensors
        rt.version = version
        rt.save()  # these weights are a version now: never warm up or publish them again

    def _announce(self, version: int, stop: threading.Event, *, final: bool = False) -> None:
        """Announce ``version``; ``final``: the last one (max_steps), so the dataflow stops
        buffering this policy and other policies' trainers are never held up by it."""
        dataflow = self.dataflow
        assert dataflow is not None and self.store is not None
        record = PolicyVersion(
            policy=self.config.policy,
            version=version,
            manifest=self.store.manifest_ref(self.config.policy, version),
            final=final,
        )
        retrying(lambda: dataflow.announce(record), what="announce", stop=stop)
        log.info("announced policy=%s version=%d%s", self.config.policy, version,
                 " (final)" if final else "")  # fmt: skip

    def _ack(self, batch_id: str, stop: threading.Event) -> None:
        dataflow = self.dataflow
        assert dataflow is not None
        request = AckRequest(batch_id=batch_id, trainer_id=self.config.trainer_id)
        try:
            retrying(lambda: dataflow.ack(request), what="ack", stop=stop)
        except (NotFoundError, ConflictError) as exc:  # already acked before a crash
            log.info("ack batch=%s not needed: %s", batch_id, exc)
        self._prefetch.acked(batch_id)

    def _record(
        self, stats: dict[str, float], publish_s: float, previous: PublishTimes | None
    ) -> None:
        if self.backend.rank != 0:
            return
        record = {"version": float(self.runtime.version), "time": time.time()}
        record |= stats
        record["wait_s"], self._wait_s = self._wait_s, 0.0
        record["compute_s"] = stats["step_s"]
        record["publish_s"] = publish_s
        if previous is not None:  # the version before this one, finished in the background
            record["publish_write_s"] = previous.write_s
            record["announce_s"] = previous.announce_s
            record["ack_s"] = previous.ack_s
        record["tokens_per_s"] = stats["tokens"] / max(stats["step_s"], 1e-9)
        for sink in self._sinks or ():
            sink.write(record)
        if self._on_step is not None:
            self._on_step(record)
        log.info(
            "step policy=%s version=%d loss=%.4f reward=%.3f samples=%d wait_s=%.2f batch=%s",
            self.config.policy, self.runtime.version, stats["loss"], stats["reward_mean"],
            int(stats["samples"]), record["wait_s"], self.runtime.last_batch_id,
        )  # fmt: skip

    def close(self) -> None:
        """Flush metrics, wait for pending publishes, release connections and the group."""
        self._prefetch.close()
        self._publisher.close()
        for sink in self._sinks or ():
            sink.close()
        if self.store is not None:
            self.store.close()
        if self.dataflow is not None:
            self.dataflow.close()
        self.backend.close()
