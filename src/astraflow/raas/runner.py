"""``TaskRunner``: one leased task, from workflow to submitted samples (or a failure report).

    task ─► workflow(task, policies, tools) within task_timeout_s
             ├─ samples ─► check + stamp (node, pool, attempt, time) ─► dataflow.submit
             └─ exception / timeout / rejected samples ─► dataflow.fail (re-queued or failed)

Cancellation (lease lost, node stopping) propagates and reports nothing: the dataflow
re-queues the task when its lease is released or expires.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from astraflow.errors import LeaseLostError, ValidationError, WorkflowError
from astraflow.raas.config import NodeConfig
from astraflow.raas.io import TaskFeed
from astraflow.raas.policy import NodePolicy
from astraflow.raas.stats import NodeMeter
from astraflow.raas.submits import SubmitCoalescer
from astraflow.records import FailRequest, Sample, SubmitRequest, Task
from astraflow.workflows.api import Tool, Workflow

__all__ = ["TaskRunner"]

log = logging.getLogger(__name__)


class TaskRunner:
    """Runs leased tasks for one node (each call to ``run`` is one asyncio task)."""

    def __init__(
        self,
        config: NodeConfig,
        dataflow: TaskFeed,
        policies: Mapping[str, NodePolicy],
        workflows: Mapping[str, Workflow],
        tools: Mapping[str, Tool],
        meter: NodeMeter,
    ) -> None:
        self.config = config
        self._dataflow = dataflow
        self.policies = policies
        self.workflows = workflows
        self.tools = tools
        self.meter = meter
        self.running = 0
        """Tasks inside :meth:`run` (those waiting for their submit included)."""
        self.submits = SubmitCoalescer(dataflow, config.submit_wait_s, running=lambda: self.running)
        """Tasks that end together submit in one request (sent once all running wait)."""

    async def run(self, task: Task, secret: str) -> None:
        """Run ``task`` to a submit or a fail report (both carry the lease ``secret``); only
        cancellation propagates."""
        self.running += 1
        try:
            await self._run(task, secret)
        finally:
            self.running -= 1
            self.submits.poke()  # the held submissions may be all that is left

    async def _run(self, task: Task, secret: str) -> None:
        started = time.monotonic()
        timeout = self.config.task_timeout_s
        try:
            workflow = self.workflows.get(task.workflow)
            if workflow is None:
                raise WorkflowError(f"node {self.config.node_id} does not run {task.workflow!r}")
            handles = {name: self.policies[name] for name in workflow.policies}
            samples = await asyncio.wait_for(workflow(task, handles, self.tools), timeout)
            samples = self._stamp(task, samples, started)
        except TimeoutError:
            await self._fail(task, secret, f"workflow {task.workflow!r} timed out after {timeout}s")
            return
        except Exception as exc:  # a task boundary: a bad rollout is data, not a crash
            log.warning("task failed task=%s attempt=%d error=%r", task.task_id, task.attempt, exc)
            await self._fail(task, secret, f"{type(exc).__name__}: {exc}")
            return
        await self._submit(task, secret, samples, started)

    def _stamp(self, task: Task, samples: Any, started: float) -> list[Sample]:
        """Check what the workflow returned and add node, pool and timing to each sample."""
        if not isinstance(samples, list) or not samples:
            raise WorkflowError(f"workflow {task.workflow!r} returned no samples")
        out = []
        for s in samples:
            if not isinstance(s, Sample):
                raise WorkflowError(f"workflow {task.workflow!r} returned {type(s).__name__}")
            if s.task_id != task.task_id or s.policy not in self.policies:
                raise WorkflowError(
                    f"workflow {task.workflow!r} returned a sample of task {s.task_id!r} for "
                    f"policy {s.policy!r} (task {task.task_id!r}, hosted {sorted(self.policies)})"
                )
            meta = {
                **s.meta,
                "node": self.config.node_id,
                "pool": self.config.pool,
                "attempt": task.attempt,
                "task_s": round(time.monotonic() - started, 4),
            }
            out.append(s.model_copy(update={"meta": meta}))
        return out

    async def _submit(self, task: Task, secret: str, samples: list[Sample], started: float) -> None:
        request = SubmitRequest(
            node_id=self.config.node_id,
            task_id=task.task_id,
            attempt=task.attempt,
            secret=secret,
            samples=samples,
        )
        try:
            reply = await self.submits.submit(request)
        except LeaseLostError as exc:
            log.info(
                "submit after lease loss task=%s attempt=%d: %s", task.task_id, task.attempt, exc
            )
            return
        except ValidationError as exc:
            await self._fail(task, secret, f"samples rejected: {exc}")
            return
        except Exception as exc:  # boundary: the lease expires and the task is re-queued
            log.warning("submit failed task=%s error=%r", task.task_id, exc)
            return
        self.meter.task_done(len(samples), time.monotonic() - started)
        log.debug(
            "submitted task=%s attempt=%d samples=%d accepted=%s",
            task.task_id,
            task.attempt,
            len(samples),
            reply.accepted,
        )

    async def close(self) -> None:
        """Send the submissions still held and wait for those in flight."""
        await self.submits.close()

    async def _fail(self, task: Task, secret: str, error: str) -> None:
        self.meter.task_failed()
        request = FailRequest(
            node_id=self.config.node_id,
            task_id=task.task_id,
            attempt=task.attempt,
            secret=secret,
            error=error[:4000],
        )
        try:
            await self._dataflow.fail(request)
        except Exception as exc:  # boundary: the lease expires and the task is re-queued
            log.warning("fail report failed task=%s error=%r", task.task_id, exc)
