"""``RolloutNode``: lease tasks, run workflows, push trajectories, refresh weights. Nothing more.

Three loops and one asyncio task per leased task share one event loop; every failure is
caught at its loop or task boundary, so nothing a workflow, the network or a server does
can crash the node.

    lease loop ─ free slots (coalesced for lease_wait_s) ─ refreshes asked for done? ───┐
        ▲  no task: wait retry_after_s                       dataflow.lease ◄──────┘
        │                                                          │ tasks
        └──── slot freed ◄── runner per task (raas.runner) ◄───────┘
                               workflow ─► submit | fail
    heartbeat ── every ttl * 1/3 ──► dataflow.renew(leases, stats) ─► lost: cancel runner
    refresh ── newer version announced ──► policy.refresh (engine: no generation sees it)

    stop (SIGTERM) ─► lease loop ends ─► runners finish within grace_s ─► release the rest
                  (no grace where every hosted trained policy is final: the dataflow
                  would drop what the runners still make)
                  ─► heartbeat / refresh end ─► engines close ─► exit 0

A crash needs no clean-up: the node's leases expire and the dataflow re-queues the tasks.
Delivery is at-least-once; the dataflow deduplicates submissions on ``(task_id, attempt)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from astraflow.errors import NotFoundError, ServiceUnavailableError
from astraflow.heap import freeze_heap
from astraflow.raas.config import NodeConfig
from astraflow.raas.endpoint import AgentEndpoint, bind_endpoint
from astraflow.raas.hosting import build_tools, build_workflows, host_policy
from astraflow.raas.io import TaskFeed, VersionWatch, WeightFeed
from astraflow.raas.policy import NodePolicy, held_versions
from astraflow.raas.runner import TaskRunner
from astraflow.raas.stats import NodeMeter, detect_hardware
from astraflow.records import (
    LeaseRef,
    LeaseRequest,
    NodeStats,
    PolicyVersion,
    ReleaseRequest,
    RenewRequest,
    Task,
    WatchVersionsRequest,
)
from astraflow.workflows.api import Tool, Workflow

__all__ = ["RolloutNode", "run_node"]

log = logging.getLogger(__name__)

#: Lease time-to-live assumed until the dataflow has named one.
DEFAULT_TTL_S = 30.0
#: Back-off after a failed call to the dataflow service.
ERROR_BACKOFF_S = 1.0


def _secret(value: SecretStr | None) -> str | None:
    return None if value is None else value.get_secret_value()


@dataclass
class _Running:
    task: Task
    secret: str
    """The lease secret: renew, submit, fail and release of this delivery present it."""
    runner: asyncio.Task[None]
    started: float

    def ref(self) -> LeaseRef:
        return LeaseRef(task_id=self.task.task_id, attempt=self.task.attempt, secret=self.secret)


class RolloutNode:
    """One rollout node. ``await node.run()`` serves until ``request_stop()`` (or a signal)."""

    def __init__(self, config: NodeConfig, dataflow: TaskFeed | None = None,
                 weights: WeightFeed | None = None) -> None:  # fmt: skip
        self._dataflow, self._weights = dataflow, weights
        self.config = config
        self.incarnation = uuid.uuid4().hex
        """This process's incarnation (``LeaseRequest.incarnation``): its leases are re-queued
        at once if the node comes back as another process, not at their deadline."""
        self.policies: dict[str, NodePolicy] = {}
        self.workflows: dict[str, Workflow] = {}
        self.tools: dict[str, Tool] = {}
        self.meter = NodeMeter(config.stats_window_s, config.hardware or detect_hardware())
        self._running: dict[tuple[str, int], _Running] = {}
        self._latest: dict[str, int] = {}
        #: trained policies whose newest announced version is final (their trainer finished)
        self._final: set[str] = set()
        self._must_refresh: set[str] = set()
        self._stop = asyncio.Event()
        self._versions_changed = asyncio.Event()
        self._slot_free = asyncio.Event()
        self._ttl_changed = asyncio.Event()
        self._ttl_s = DEFAULT_TTL_S
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._runner: TaskRunner | None = None
        self.endpoint: AgentEndpoint | None = None
        """The OpenAI-compatible endpoint, when a workflow (``agent``) needs one."""

    @property
    def dataflow(self) -> TaskFeed:
        """The dataflow client (opened by :meth:`start`)."""
        assert self._dataflow is not None, "start() first"
        return self._dataflow

    @property
    def weights(self) -> WeightFeed:
        """The weight client (opened by :meth:`start`)."""
        assert self._weights is not None, "start() first"
        return self._weights

    # ----------------------------------------------------------------- lifecycle

    def request_stop(self) -> None:
        """Graceful stop: lease nothing more, finish or hand back what is running."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        """True once a stop was requested."""
        return self._stop.is_set()

    async def run(self, *, own_process: bool = False) -> None:
        """Start, serve until stopped, then stop gracefully and free everything.

        ``own_process``: this process exists for this node (``astraflow raas serve``, a Ray
        actor), so once ready its start-up heap is frozen (``heap.freeze_heap``): a node
        embedded in another program leaves that program's garbage collector alone."""
        try:
            if await self.start():
                if own_process:
                    freeze_heap(f"node {self.config.node_id}")
                await self.serve()
        finally:
            await self.close()

    async def start(self) -> bool:
        """Open clients, host policies, build workflows; False when stopped before ready."""
        cfg = self.config
        if self._dataflow is None:
            from astraflow.dataflow.client import AsyncDataflowClient

            self._dataflow = AsyncDataflowClient(
                cfg.dataflow_url, token=_secret(cfg.dataflow_token), timeout_s=cfg.request_timeout_s
            )
        if self._weights is None:
            from astraflow.weights import WeightClient
            from astraflow.weights.transfer import TransferOptions

            options = TransferOptions(token=_secret(cfg.weights_token))
            self._weights = WeightClient(cfg.weights, options=options)
        if cfg.work_dir is not None:
            work = Path(cfg.work_dir)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix=f"raas-{cfg.node_id}-")
            work = Path(self._tmp.name)
        for name, pcfg in cfg.policies.items():
            policy = await host_policy(name, pcfg, self._weights, work, cfg.seed, self._stop)
            if policy is None:
                return False
            self.policies[name] = policy
        self.workflows = build_workflows(cfg, self.policies)
        self.endpoint = await bind_endpoint(self.workflows)
        self.tools = build_tools(cfg.tools, cfg.seed)
        self._runner = TaskRunner(
            cfg, self._dataflow, self.policies, self.workflows, self.tools, self.meter
        )
        log.info(
            "node ready node=%s pool=%s capacity=%d policies=%s workflows=%s hardware=%r",
            cfg.node_id,
            cfg.pool,
            cfg.capacity,
            sorted(self.policies),
            sorted(self.workflows),
            self.meter.hardware,
        )
        return True

    async def serve(self) -> None:
        """Run the loops until a stop is requested, then drain (grace period, release)."""
        heartbeat = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
        refresher = asyncio.create_task(self._refresh_loop(), name="refresh")
        watcher = asyncio.create_task(self._watch_loop(), name="version-watch")
        try:
            await self._lease_loop()
            await self._drain()
        finally:
            for loop_task in (heartbeat, refresher, watcher):
                loop_task.cancel()
            await asyncio.gather(heartbeat, refresher, watcher, return_exceptions=True)

    async def close(self) -> None:
        """Cancel what still runs and close engines and clients (idempotent)."""
        for running in list(self._running.values()):
            running.runner.cancel()
        await asyncio.gather(*(r.runner for r in self._running.values()), return_exceptions=True)
        if self._runner is not None:
            await self._runner.close()
        if self.endpoint is not None:
            await self.endpoint.stop()
        for policy in self.policies.values():
            await policy.close()
        if self._dataflow is not None:
            await self._dataflow.close()
        if self._weights is not None:
            self._weights.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def stats(self) -> NodeStats:
        """The stats reported with the next lease or heartbeat."""
        tokens = sum(p.generated_tokens for p in self.policies.values())
        stats = self.meter.snapshot(len(self._running), tokens)
        busy: dict[str, float] = {}
        for name, p in self.policies.items():
            figures = p.engine.metrics()
            # cumulative seconds each engine spent generating (its utilisation)
            busy[f"busy_s.{name}"] = float(figures.get("busy_s", 0.0))
            if "mean_batch_size" in figures:  # how well concurrent requests share a batch
                busy[f"batch_size.{name}"] = float(figures["mean_batch_size"])
        busy |= {  # the last weight refresh's duration per policy (the weight-transfer time)
            f"refresh_s.{name}": p.refresh_s
            for name, p in self.policies.items()
            if p.refresh_s is not None
        }
        if self._runner is not None:  # submit requests sent (fewer than tasks: coalesced)
            busy["submit_requests"] = float(self._runner.submits.requests)
        if self.endpoint is not None:  # the agent endpoint's capture figures (segments ...)
            busy.update({f"agent.{k}": v for k, v in self.endpoint.metrics().items()})
        return stats.model_copy(update={"extra": {**stats.extra, **busy}}) if busy else stats

    # ----------------------------------------------------------------- lease loop

    async def _lease_loop(self) -> None:
        cfg = self.config
        while not self._stop.is_set():
            self._check_engines()
            if not await self._fresh_enough():
                await self._pause(ERROR_BACKOFF_S)
                continue
            free = cfg.capacity - len(self._running)
            if free <= 0:
                self._slot_free.clear()
                await self._wait_either(self._slot_free)
                continue
            if free < cfg.capacity:
                free = await self._coalesce()
            whoami = self._whoami()
            try:
                reply = await self.dataflow.lease(
                    LeaseRequest(
                        capacity=free,
                        workflows=sorted(self.workflows),
                        incarnation=self.incarnation,
                        **whoami,
                    )
                )
            except Exception as exc:  # loop boundary: the dataflow may be down for a while
                log.warning("lease failed node=%s error=%r", cfg.node_id, exc)
                await self._pause(ERROR_BACKOFF_S)
                continue
            self._set_ttl(reply.lease_ttl_s)
            self._note_versions(reply.versions)
            for policy, reason in reply.refresh.items():
                log.info("dataflow asks to refresh policy=%s reason=%r", policy, reason)
                self._must_refresh.add(policy)
            for task in reply.tasks:
                secret = reply.secrets.get(task.task_id)
                if secret is None:  # cannot be renewed or submitted: let the lease expire
                    log.warning("lease without a secret task=%s: not run", task.task_id)
                    continue
                self._start(task, secret)
            if not reply.tasks:
                # the refresh runs at the top of the loop, then the next lease (at once also
                # when the refresh loop moved on while the lease was answered)
                if reply.refresh and (
                    self._can_refresh(reply.refresh) or self._held() != whoami["versions"]
                ):
                    continue
                # short when a refresh is due that has no newer version to go to yet
                wait = reply.retry_after_s or cfg.idle_wait_s
                await self._pause(min(wait, ERROR_BACKOFF_S / 20) if reply.refresh else wait)

    def _check_engines(self) -> None:
        """Stop leasing when an engine can serve no more calls (an engine process died): the
        node exits with the error, its leases run out and other nodes (or this one, restarted
        by its launcher) run the tasks, instead of it failing every task it leases."""
        for name, policy in self.policies.items():
            failed = getattr(policy.engine, "failed", None)
            if failed:
                raise ServiceUnavailableError(
                    f"node {self.config.node_id}: the engine of policy {name!r} is gone: {failed}"
                )

    def _can_refresh(self, names: Iterable[str]) -> bool:
        """Some policy of ``names`` is hosted, trained and behind the newest version announced:
        a refresh now gets it closer (else the dataflow waits for a version not yet heard of,
        and leasing again at once would only spin)."""
        return any(
            (policy := self.policies.get(name)) is not None
            and not policy.frozen
            and self._latest.get(name, -1) > policy.version
            for name in names
        )

    async def _coalesce(self) -> int:
        """Wait up to ``lease_wait_s`` for more running tasks to end; the free slots then."""
        cfg = self.config
        deadline = time.monotonic() + cfg.lease_wait_s
        while self._running and not self._stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._slot_free.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slot_free.wait(), remaining)
        return cfg.capacity - len(self._running)

    async def _fresh_enough(self) -> bool:
        """Refresh the policies the dataflow named (its admission owns the staleness rule)."""
        for name, policy in self.policies.items():
            latest = self._latest.get(name, -1)
            if policy.frozen or latest < 0:
                self._must_refresh.discard(name)
                continue
            if name in self._must_refresh:
                try:
                    if await policy.refresh(self.weights, latest):
                        self.meter.refreshes += 1
                except Exception as exc:  # boundary: keep serving, try again shortly
                    log.warning("refresh failed policy=%s want=%d error=%r", name, latest, exc)
                    if isinstance(exc, NotFoundError) and await self._newer_served(name, latest):
                        return await self._fresh_enough()  # at once, to the newer version
                    return False
                self._must_refresh.discard(name)
        return True

    async def _newer_served(self, name: str, missing: int) -> bool:
        """After ``missing`` was not found (a relay that went straight past it, a store that
        collected it): take the newest version the weight source serves, if newer. Without
        this the node would ask for the same missing version until the next announcement,
        and it leases nothing while a refresh it was asked for fails."""
        try:
            newest = await asyncio.to_thread(self.weights.latest, name)
        except Exception as exc:  # boundary: the next attempt asks again
            log.warning("latest failed policy=%s error=%r", name, exc)
            return False
        if newest is None or newest <= missing:
            return False
        log.info("policy=%s version %d is not served; its newest is %d", name, missing, newest)
        self._latest[name] = max(self._latest.get(name, -1), newest)
        return True

    def _set_ttl(self, ttl_s: float) -> None:
        if ttl_s != self._ttl_s:
            self._ttl_s = ttl_s
            self._ttl_changed.set()

    def _held(self) -> dict[str, int]:
        return held_versions(list(self.policies.values()))

    def _whoami(self) -> dict[str, Any]:
        """What every lease and heartbeat says about the node: id, pool, versions, stats."""
        cfg = self.config
        return {"node_id": cfg.node_id, "pool": cfg.pool, "versions": self._held(),
                "stats": self.stats()}  # fmt: skip

    def _note_versions(self, versions: dict[str, PolicyVersion]) -> None:
        changed = False
        for name, announced in versions.items():
            if name not in self.policies or announced.version < self._latest.get(name, -1):
                continue
            if announced.final:  # a later version (a resumed trainer) makes it live again
                self._final.add(name)
            else:
                self._final.discard(name)
            if announced.version > self._latest.get(name, -1):
                self._latest[name] = announced.version
                changed = True
        if changed:
            self._versions_changed.set()

    # ----------------------------------------------------------------- task runners

    def _start(self, task: Task, secret: str) -> None:
        key = (task.task_id, task.attempt)
        if key in self._running:
            return
        assert self._runner is not None, "start() first"
        runner = asyncio.create_task(self._runner.run(task, secret), name=f"task:{task.task_id}")
        self._running[key] = _Running(task, secret, runner, time.monotonic())
        runner.add_done_callback(lambda _: self._finished(key))

    def _finished(self, key: tuple[str, int]) -> None:
        self._running.pop(key, None)
        self._slot_free.set()

    # ----------------------------------------------------------------- heartbeat, refresh

    async def _heartbeat_loop(self) -> None:
        cfg = self.config
        last = time.monotonic()
        while True:
            wait = last + self._ttl_s * cfg.heartbeat_fraction - time.monotonic()
            if wait > 0:  # woken early when the dataflow names a new ttl: recompute
                self._ttl_changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._ttl_changed.wait(), wait)
                continue
            last = time.monotonic()
            leases = [r.ref() for r in self._running.values()]
            try:
                reply = await self.dataflow.renew(RenewRequest(leases=leases, **self._whoami()))
            except Exception as exc:  # loop boundary: try again next beat
                log.warning("heartbeat failed node=%s error=%r", cfg.node_id, exc)
                continue
            self._set_ttl(reply.lease_ttl_s)
            self._note_versions(reply.versions)
            for ref in reply.lost:
                running = self._running.get((ref.task_id, ref.attempt))
                if running is not None:
                    log.warning(
                        "lease lost task=%s attempt=%d: cancelled", ref.task_id, ref.attempt
                    )
                    self.meter.lost += 1
                    running.runner.cancel()

    async def _watch_loop(self) -> None:
        """Hear of each new version of a trained, eagerly refreshed policy as it is announced,
        so the refresh loop pulls it while tasks still generate with the one before (from
        lease and heartbeat replies alone, a node busy with its tasks hears of a version only
        when they end, and then pulls it on the critical path)."""
        cfg = self.config
        feed = self.dataflow
        watched = [name for name, policy in self.policies.items()
                   if not policy.frozen and cfg.policies[name].refresh == "eager"]  # fmt: skip
        if cfg.watch_versions_s <= 0 or not watched or not isinstance(feed, VersionWatch):
            return
        while not self._stop.is_set():
            known = {name: max(self._latest.get(name, -1), self.policies[name].version)
                     for name in watched}  # fmt: skip
            try:
                versions = await feed.watch_versions(
                    WatchVersionsRequest(known=known, timeout_s=cfg.watch_versions_s)
                )
            except NotFoundError:  # a dataflow service without the route: leases tell instead
                log.info("the dataflow service has no version watch: versions come with leases")
                return
            except Exception as exc:  # loop boundary: the dataflow may be down for a while
                log.debug("version watch failed node=%s error=%r", cfg.node_id, exc)
                await self._pause(ERROR_BACKOFF_S)
                continue
            self._note_versions(versions)

    async def _refresh_loop(self) -> None:
        while True:
            await self._versions_changed.wait()
            self._versions_changed.clear()
            for name, policy in self.policies.items():
                want = self._latest.get(name, -1)
                eager = self.config.policies[name].refresh == "eager"
                if policy.frozen or not eager or want <= policy.version:
                    continue
                try:
                    if await policy.refresh(self.weights, want):
                        self.meter.refreshes += 1
                except Exception as exc:  # loop boundary: retried at the next announcement
                    log.warning("refresh failed policy=%s want=%d error=%r", name, want, exc)
                    if isinstance(exc, NotFoundError) and await self._newer_served(name, want):
                        self._versions_changed.set()  # the newer one, at once

    # ----------------------------------------------------------------- graceful stop

    async def _drain(self) -> None:
        """Let running tasks finish within the grace period; hand back the rest."""
        runners = [r.runner for r in self._running.values()]
        trained = sorted(name for name, p in self.policies.items() if not p.frozen)
        if runners and trained and self._final.issuperset(trained):
            # the run is over for this node: what its tasks still make would be dropped
            log.info("stopping: %d tasks running, handed back now (the trainers of %s have "
                     "finished)", len(runners), ", ".join(trained))  # fmt: skip
        elif runners:
            log.info("stopping: %d tasks running, grace %.1fs", len(runners), self.config.grace_s)
            await asyncio.wait(runners, timeout=self.config.grace_s)
        left = list(self._running.values())
        for running in left:
            running.runner.cancel()
        await asyncio.gather(*(r.runner for r in left), return_exceptions=True)
        # always sent, even with nothing to hand back: the service stops counting this node
        refs = [r.ref() for r in left]
        try:
            reply = await self.dataflow.release(
                ReleaseRequest(node_id=self.config.node_id, leases=refs)
            )
            log.info("released leases=%d requeued=%d", len(refs), reply.requeued)
        except Exception as exc:  # boundary: the leases expire instead
            log.warning("release failed leases=%d error=%r", len(refs), exc)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _wait_either(self, event: asyncio.Event) -> None:
        waiters = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._stop.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    def __repr__(self) -> str:
        return f"RolloutNode({self.config.node_id!r}, pool={self.config.pool!r})"


async def run_node(config: NodeConfig, stop: threading.Event, *, poll_s: float = 0.1) -> None:
    """Serve a node until ``stop`` is set, then stop it gracefully (what SIGTERM does).

    The one entry of ``astraflow raas serve`` and of a node hosted in another process (a Ray
    actor): ``stop`` may be set from any thread.
    """
    node = RolloutNode(config)

    async def watch() -> None:
        while not stop.is_set():
            await asyncio.sleep(poll_s)
        node.request_stop()

    watcher = asyncio.create_task(watch(), name="stop-watch")
    try:
        await node.run(own_process=True)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
