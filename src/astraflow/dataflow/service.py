"""``DataflowService``: every rule of the dataflow service, no HTTP (testable without a server).

Each public method is one atomic change: it validates its input first (a bad request changes
nothing), then writes through the store in one transaction that is committed before it
returns. Memory mirrors the store; if a transaction fails, memory is reloaded from it.

    lease ──► regulator.plan (admission, caps) / throttle ──► TaskQueue.lease
    submit ─► validate ─► TaskQueue.accept ─► filters ─► Buffers.add ─► selector.feedback
    take ───► regulator.take                                ack ──► Buffers.ack
    announce ► versions                    sweep ► lease / batch expiry, pool targets
    every change ends with regulator.step (modes.py: async, or sync rounds)
    admin: desired pool sizes (pools.py)

Methods are thread-safe (one lock); the HTTP layer runs them on one writer thread.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from astraflow.data_algorithms.protocols import BatchQuery, GroupResult
from astraflow.dataflow import regulation
from astraflow.dataflow.algorithms import PluginSet
from astraflow.dataflow.buffers import Buffers, validate_samples
from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.modes import Regulator, make_regulator
from astraflow.dataflow.pools import PoolSizing
from astraflow.dataflow.report import Telemetry, build_report
from astraflow.dataflow.sources import Catalog, load_source
from astraflow.dataflow.store import Store
from astraflow.dataflow.tasks import TaskQueue
from astraflow.errors import AstraflowError, ConflictError, NotFoundError
from astraflow.records import (
    AckRequest,
    AnnounceReply,
    DataflowReport,
    FailReply,
    FailRequest,
    HandBackReply,
    HandBackRequest,
    LeaseReply,
    LeaseRequest,
    PolicyVersion,
    PoolSize,
    PoolSizeRequest,
    PoolSizes,
    ReleaseReply,
    ReleaseRequest,
    RenewReply,
    RenewRequest,
    SubmitManyReply,
    SubmitManyRequest,
    SubmitOutcome,
    SubmitReply,
    SubmitRequest,
    TakeBatchRequest,
    TaskQueueReport,
    groups_of,
)

__all__ = ["DataflowService", "TakenBatch"]

log = logging.getLogger(__name__)

TakenBatch = tuple[str, bytes, int]
"""(batch_id, msgpack of ``records.Batch``, number of samples)."""


#: Meta key of the node incarnations (``DataflowService.incarnations``), and how many nodes it
#: remembers (the least recently restarted are forgotten first).
_INCARNATIONS = "node_incarnations"
_MAX_INCARNATIONS = 4096


class DataflowService:
    """Task queue, buffers, versions and report of one run directory."""

    def __init__(
        self,
        config: DataflowConfig,
        *,
        datasets: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.clock = clock
        self._lock = threading.RLock()
        self.on_buffer_change: Callable[[str], None] | None = None
        """Called with a policy after a change that may make a batch available."""
        self.on_round_change: Callable[[], None] | None = None
        """Sync mode: called after a change that may give a held lease a task."""
        datasets = dict(datasets or {})
        self.catalog = Catalog(
            [
                load_source(s, dataset=datasets.pop(s.name, None), seed=config.seed)
                for s in config.sources
            ]
        )
        if datasets:
            raise NotFoundError(f"datasets given for unknown sources: {sorted(datasets)}")
        self.plugins = PluginSet(config)
        self.selector, self.filters = self.plugins.selector, self.plugins.filters
        self.selector.select(self.catalog, 0)  # lets the selector check the catalogue
        self.store = Store(config.db_path)
        self.telemetry = Telemetry(config.report, clock)
        self._last_sweep = 0.0
        self._heard: dict[str, float] = {}
        """When each node's current incarnation was last heard from (in memory only)."""
        try:
            self._load()
        except BaseException:
            self.store.close()
            raise
        log.info("dataflow state loaded run_dir=%s open_tasks=%d buffered_groups=%d",
                 config.run_dir, len(self.queue.open),
                 sum(len(v) for v in self.buffers.live.values()))  # fmt: skip

    def _load(self) -> None:
        self.plugins.load(self.store)
        self.queue = TaskQueue(self.store, self.catalog, self.selector, self.config.lease)
        self.buffers = Buffers(self.store, self.config.policies, self.plugins.sampler)
        self.latest: dict[str, PolicyVersion] = {
            p: PolicyVersion(policy=p, version=v, manifest=m, created_at=t, final=f)
            for p, (v, m, t, f) in self.store.latest_versions().items()
        }
        self._announced_at: dict[str, tuple[int, float]] = {}  # policy -> (version, when)
        self._ahead: dict[int, tuple[int, float]] = {}  # prefetch wait -> (version, began)
        self._ahead_next = 0
        self.pools = PoolSizing(self.store)
        self.incarnations: dict[str, str] = dict(self.store.get_meta(_INCARNATIONS) or {})
        """The process each node's open leases were granted to (``LeaseRequest.incarnation``)."""
        self.regulator: Regulator = make_regulator(
            self.config, self.store, self.queue, self.buffers, self.latest
        )

    def _final(self) -> set[str]:
        """Policies no trainer takes from (no longer buffered): those whose trainer announced
        its final version, and frozen ones (never trained)."""
        frozen = {p for p, c in self.config.policies.items() if c.frozen}
        return frozen | {p for p, v in self.latest.items() if v.final}

    def close(self) -> None:
        """Close the database (everything acknowledged is already committed)."""
        with self._lock:
            self.store.close()

    @contextmanager
    def _change(self) -> Iterator[None]:
        """One atomic change; on failure, roll back and reload memory from the store.

        The regulator's rules run last, in the same transaction. A change inside another
        (``submit_many``: a savepoint per submission) leaves them, and the plugins' state, to
        the outer one: they run once, at its end; a failed inner change takes back its own
        part only (memory reloaded from the store as the outer transaction sees it).
        """
        with self._lock:
            key = self.regulator.lease_key()
            nested = self.store.in_transaction
            completed = False
            try:
                with self.store.transaction():
                    yield
                    if not nested:
                        completed = self.regulator.step(self.latest, self.clock())
                        self.plugins.save(self.store)
            except BaseException:
                self._reload()
                raise
            if completed:  # a batch became servable for every policy: wake every long-poll
                self._notify(set(self.config.policies))
            wake = self.on_round_change
            if wake is not None and self.regulator.more_to_lease(key):
                wake()

    def _reload(self) -> None:
        log.warning("transaction failed; reloading state from the store")
        self._load()

    def _notify(self, policies: set[str]) -> None:
        if self.on_buffer_change is not None:
            for p in policies:
                self.on_buffer_change(p)

    # ------------------------------------------------------------------ expiry

    def sweep(self, *, force: bool = False) -> None:
        """Expire overdue leases (re-queue, attempt + 1) and un-acked batches (re-buffer);
        decide the pool targets (the dead-band rule) that reports then read."""
        now = self.clock()
        interval = min(0.5, self.config.lease.ttl_s / 4)
        if not force and now - self._last_sweep < interval:
            return
        with self._change():
            self._last_sweep = now
            for ot in self.queue.expired(now):
                node, pool = ot.row.node_id or "", ot.row.pool or "default"
                self.queue.requeue(ot, now)
                self.telemetry.book(node, pool).lease_expiries += 1
                log.info("lease expired task=%s node=%s attempt=%d", ot.row.task_id, node,
                         ot.row.attempt)  # fmt: skip
            changed = self.buffers.expire(now)
            self.telemetry.forget_idle(now, self.queue.leased_per_node())
            self.telemetry.decide(now, self.config.lease.ttl_s, self.pools.desired)
        self._notify(changed)

    # ------------------------------------------------------------------ node side

    def lease(self, req: LeaseRequest) -> LeaseReply:
        """Grant up to ``req.capacity`` tasks the node can run (maybe none, with the reason)."""
        self.sweep()
        with self._lock:
            if req.incarnation is not None:
                self._incarnation(req.node_id, req.incarnation)
            self.telemetry.node(req.node_id, req.pool, req.stats)
            sources = [s for s in self.config.sources if s.workflow in req.workflows]
            plan = self.regulator.plan(sources, req.versions, self.latest)
            held = self.queue.held(req.node_id)
            allowance = regulation.lease_allowance(
                self.telemetry.node_rate(req.node_id), self.config.regulation
            )
            decision = regulation.LeaseDecision(
                capacity=req.capacity, workflows=req.workflows, runnable=bool(sources),
                refresh=plan.refresh, full=plan.full, spent=plan.spent, held=held,
                allowance=allowance,
                want=regulation.lease_grant(req.capacity, held, allowance),
            )  # fmt: skip
            tasks = []
            if decision.want and plan.caps:
                with self._change():
                    tasks = self.queue.lease(req.node_id, req.pool, decision.want, plan.caps,
                                             self.clock(), self.regulator.max_new())  # fmt: skip
                    self.regulator.leased(t.task_id for t in tasks)
            reason = decision.reason(len(tasks), self.queue.exhausted())
            if len(tasks) < req.capacity:
                reason = self.regulator.blocked(self.latest) or reason
        return LeaseReply(
            tasks=tasks,
            lease_ttl_s=self.config.lease.ttl_s,
            versions=dict(self.latest),
            refresh=plan.refresh,
            reason=reason,
            retry_after_s=0.0 if tasks else self._retry_after(reason),
            secrets={
                t.task_id: self.queue.secret(req.node_id, t.task_id, t.attempt) for t in tasks
            },
        )

    def _incarnation(self, node_id: str, incarnation: str) -> None:
        """A lease from ``incarnation`` of ``node_id``. From a new process, while the one the
        node's leases were granted to has been quiet for half a lease TTL (or not heard from
        since this service started: a resumed run), those leases are orphans (it crashed;
        nobody will renew or submit them) and are re-queued now instead of at their deadline.
        A process heard from lately keeps its leases: a node id is public, so another client
        presenting a new incarnation under it must not take a live node's work away."""
        now = self.clock()
        if self.incarnations.get(node_id) == incarnation:
            self._heard[node_id] = now
            return
        if now - self._heard.get(node_id, -math.inf) < self.config.lease.ttl_s / 2:
            return  # the current process is alive (or this is not the node it claims to be)
        known = dict(self.incarnations)
        known.pop(node_id, None)
        known[node_id] = incarnation  # the most recent last: the oldest go first past the cap
        while len(known) > _MAX_INCARNATIONS:
            known.pop(next(iter(known)))
        with self._change():
            requeued = self.queue.requeue_node(node_id, now)
            self.store.set_meta(_INCARNATIONS, known)
        self.incarnations = known
        self._heard[node_id] = now
        if len(self._heard) > 2 * _MAX_INCARNATIONS:
            self._heard = {n: t for n, t in self._heard.items() if n in known}
        if requeued:
            log.warning("node %s came back as a new process: the %d leases of the previous one "
                        "are re-queued now, not at their deadline", node_id, requeued)  # fmt: skip

    def _retry_after(self, reason: str) -> float:
        """A lease waiting for the next version (held open until it comes) is asked again at
        once; others after ``lease.retry_after_s``."""
        wait = self.config.lease.retry_after_s
        return min(wait, 0.05) if reason.startswith(regulation.BUDGET) else wait

    def renew(self, req: RenewRequest) -> RenewReply:
        """Extend the node's leases; report the ones it lost."""
        self.sweep()
        with self._change():
            self.telemetry.node(req.node_id, req.pool, req.stats)
            lost = self.queue.renew(req.node_id, req.leases, self.clock())
        if len(lost) < len(req.leases):  # it holds some of them: the holder is alive
            self._heard[req.node_id] = self.clock()
        return RenewReply(
            lease_ttl_s=self.config.lease.ttl_s, lost=lost, versions=dict(self.latest)
        )

    def submit(self, req: SubmitRequest) -> SubmitReply:
        """Store a task's trajectories once (idempotent on ``(task_id, attempt)``)."""
        validate_samples(req, self.config.policies)
        with self._lock:
            self.queue.authorize(req.node_id, req.task_id, req.attempt, req.secret)
            prior = self.store.get_submission(req.task_id, req.attempt)
            if prior is not None:
                first = SubmitReply.model_validate_json(prior)
                return first.model_copy(update={"accepted": False, "duplicate": True})
            ot = self.queue.accept(req.node_id, req.task_id, req.attempt)
            pool = self.telemetry.pool_of(req.node_id) or ot.row.pool or "default"
            now = self.clock()
            kept: dict[str, int] = {}
            dropped: dict[str, str] = {}
            final = self._final()
            with self._change():
                for (policy, _), group in groups_of(req.samples).items():
                    reason = next((r for f in self.filters if (r := f.check(policy, group))), None)
                    if reason is None and policy in final:
                        dropped[policy] = (
                            f"policy {policy!r} is frozen (not trained)"
                            if self.config.policies[policy].frozen
                            else f"the trainer of {policy!r} has finished"
                        )
                        continue
                    if reason is None:
                        self.buffers.add(policy, group, ot.source.name, now)
                        kept[policy] = kept.get(policy, 0) + len(group)
                    else:
                        dropped[policy] = reason
                        self.buffers.count("filtered", policy, len(group))
                    self.selector.feedback(GroupResult(
                        source=ot.source.name, row_id=str(ot.task.meta.get("row_id", "")),
                        epoch=int(ot.task.meta.get("epoch", 0)), task_id=req.task_id,
                        policy=policy, rewards=tuple(s.reward for s in group),
                        kept=reason is None, reason=reason or "",
                    ))  # fmt: skip
                self.queue.complete(ot)
                reply = SubmitReply(accepted=True, kept=kept, dropped=dropped)
                self.store.insert_submission(req.task_id, req.attempt, reply.model_dump_json())
            self.telemetry.completed(req.node_id, pool, len(req.samples))
        self._notify(set(kept))
        return reply

    def submit_many(self, req: SubmitManyRequest) -> SubmitManyReply:
        """Several submissions, each handled as by :meth:`submit`, in order; a submission
        that fails gets its error body in its outcome and the others go on."""
        outcomes = []
        with self._change():  # one transaction, a savepoint per submission
            for one in req.submits:
                try:
                    outcomes.append(SubmitOutcome(reply=self.submit(one)))
                except AstraflowError as exc:
                    outcomes.append(SubmitOutcome(error=exc.to_wire()["error"]))
        return SubmitManyReply(outcomes=outcomes)

    def fail(self, req: FailRequest) -> FailReply:
        """Count a failed attempt: re-queue it, or fail the task after ``max_attempts``."""
        with self._lock:
            ot = self.queue.current(req.node_id, req.task_id, req.attempt, req.secret)  # first
            pool = ot.row.pool or "default"
            with self._change():
                requeued = self.queue.fail(ot, req.error, req.retryable, self.clock())
            self.telemetry.node(req.node_id, pool).failures += 1
        log.info("task failed task=%s attempt=%d node=%s requeued=%s error=%s",
                 req.task_id, req.attempt, req.node_id, requeued, req.error[:200])  # fmt: skip
        return FailReply(requeued=requeued, failed=not requeued)

    def release(self, req: ReleaseRequest) -> ReleaseReply:
        """Re-queue leases a stopping node hands back; the node leaves the active count."""
        with self._change():
            n = self.queue.release(req.node_id, req.leases, self.clock())
            self.telemetry.leave(req.node_id)
        return ReleaseReply(requeued=n)

    # ------------------------------------------------------------------ trainer side

    def _policy(self, policy: str) -> None:
        if policy not in self.config.policies:
            raise NotFoundError(
                f"unknown policy {policy!r}; declared: {', '.join(sorted(self.config.policies))}",
                field="policy",
            )

    def take_batch(self, req: TakeBatchRequest) -> TakenBatch | None:
        """A batch of whole groups for the trainer now, or None (the caller long-polls)."""
        self._policy(req.policy)
        self.sweep()
        query = BatchQuery(req.policy, req.trainer_id, req.trainer_version, req.min_samples,
                           req.max_samples)  # fmt: skip
        with self._change():  # a trainer that takes again holds no earlier batch: free it now
            self.buffers.release(req.policy, req.trainer_id, req.holding)
            taken = self.regulator.take(query, self.clock())
        if taken is None:
            return None
        row, data, n = taken
        with self._lock:
            self.telemetry.served(req.trainer_id, req.policy, n, req.trainer_version)
        return row.batch_id, data, n

    def hand_back(self, req: HandBackRequest) -> HandBackReply:
        """A stopping trainer's open batches of the policy, but those it names as held, go
        back to the buffer now (not at their ack deadline)."""
        self._policy(req.policy)
        with self._change():
            n = self.buffers.release(req.policy, req.trainer_id, req.holding)
        if n:
            log.info("trainer handed back batches policy=%s trainer=%s batches=%d",
                     req.policy, req.trainer_id, n)  # fmt: skip
        return HandBackReply(batches=n)

    def give_back(self, batch_id: str) -> None:
        """A batch taken for a trainer that hung up before it was sent goes back at once."""
        with self._change():
            self.buffers.give_back(batch_id)

    def ack(self, req: AckRequest) -> None:
        """The trainer committed its step on the batch: never serve its groups again."""
        with self._lock:
            batch = self.buffers.find(req.batch_id)  # checked first: unknown ids change nothing
            with self._change():
                self.buffers.ack(batch, self.clock())

    def announce(self, pv: PolicyVersion) -> AnnounceReply:
        """Record a policy's new latest version (idempotent for the same version and manifest)."""
        self._policy(pv.policy)
        with self._lock:
            latest = self.latest.get(pv.policy)
            if latest is not None and (pv.version, pv.manifest) == (
                latest.version,
                latest.manifest,
            ):
                if pv.final and not latest.final:  # the trainer finished at this version
                    latest = latest.model_copy(update={"final": True})
                    with self._change():
                        self.store.insert_version(pv.policy, latest.version, latest.manifest,
                                                  latest.created_at, final=True)  # fmt: skip
                        self.latest[pv.policy] = latest
                        self.regulator.retire(pv.policy)
                    log.info("final version policy=%s version=%d: its samples are no longer "
                             "buffered", pv.policy, latest.version)  # fmt: skip
                return AnnounceReply(latest=latest)
            if latest is not None and pv.version <= latest.version:
                raise ConflictError(
                    f"policy {pv.policy!r} is already at version {latest.version} "
                    f"(manifest {latest.manifest!r}); cannot announce version {pv.version} "
                    f"with manifest {pv.manifest!r}",
                    field="version",
                )
            with self._change():
                self.store.insert_version(
                    pv.policy, pv.version, pv.manifest, pv.created_at, final=pv.final
                )
                self.latest[pv.policy] = pv  # before the change ends: the regulator reads it
                self._announced_at[pv.policy] = (pv.version, self.clock())
                if pv.final:
                    self.regulator.retire(pv.policy)
        log.info("version announced policy=%s version=%d", pv.policy, pv.version)
        return AnnounceReply(latest=pv)

    def versions(self) -> dict[str, PolicyVersion]:
        """Latest announced version per policy."""
        with self._lock:
            return dict(self.latest)

    # ------------------------------------------------------------------ observability

    def wait_started(self, trainer_id: str, policy: str, trainer_version: int = -1) -> int:
        """A take_batch call began waiting; returns a handle for :meth:`wait_ended`.

        A take for a version not announced yet is a prefetch: the trainer is still computing
        the step that makes that version, so its wait counts only from that announcement.
        """
        with self._lock:
            latest = self.latest.get(policy)
            waits = self.telemetry.trainer(trainer_id, policy).waits
            if latest is None or trainer_version <= latest.version:
                return waits.start(self.clock())
            self._ahead_next -= 1  # negative handles: prefetches, outside the tracker
            self._ahead[self._ahead_next] = (trainer_version, self.clock())
            return self._ahead_next

    def wait_ended(self, trainer_id: str, policy: str, handle: int) -> None:
        """The take_batch call ``handle`` returned."""
        with self._lock:
            now = self.clock()
            waits = self.telemetry.trainer(trainer_id, policy).waits
            ahead = self._ahead.pop(handle, None)
            if ahead is None:
                waits.end(handle, now)
                return
            version, began = ahead
            at = self._announced_at.get(policy)
            if at is not None and at[0] >= version:  # the step ended during the long-poll
                waits.add(max(began, at[1]), now)

    def report(self) -> DataflowReport:
        """The pool report (one snapshot; ``/metrics`` renders the same)."""
        with self._lock:
            policies = {
                p: self.buffers.report(p, self.latest.get(p), self.queue.in_flight[p]).model_copy(
                    update={"final": p in self._final()}
                )
                for p in self.config.policies
            }
            tasks = TaskQueueReport(**self.queue.counts(), exhausted=self.queue.exhausted())
            plugins = self.plugins.metrics()
            sync = self.regulator.report(self.latest)
            return build_report(
                self.telemetry, tasks, self.queue.leased_per_node(), policies, plugins,
                self.config.lease.ttl_s, desired=self.pools.desired, sync=sync,
            )  # fmt: skip

    # ------------------------------------------------------------------ admin

    def pool_sizes(self) -> PoolSizes:
        """Desired, observed and dead-band target node counts per pool."""
        return PoolSizing.sizes(self.report())

    def set_pool_size(self, req: PoolSizeRequest) -> PoolSize:
        """Set a pool's desired node count (absolute or relative); returns the pool's sizes."""
        with self._lock:
            seen = self.report().pools.get(req.pool)
            observed, before = 0 if seen is None else seen.nodes, self.pools.desired.get(req.pool)
            with self._change():
                nodes = self.pools.set(req, observed)
            log.info("pool size set pool=%s desired=%d was=%s observed=%d", req.pool, nodes,
                     before, observed)  # fmt: skip
            return self.pool_sizes().pools[req.pool]

    def health(self) -> dict[str, Any]:
        """Liveness and a few counts."""
        with self._lock:
            return {
                "status": "ok",
                "wire": "v1",
                "uptime_s": round(self.clock() - self.telemetry.started, 3),
                "policies": sorted(self.config.policies),
                "tasks": self.queue.counts(),
            }
