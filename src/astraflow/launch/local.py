"""Run every component of a run as a local process, supervise them, stop them cleanly.

    plan ─► dataflow ─(healthy)─► [weight server] ─► trainers ─► nodes per pool ─► evaluators
                                                                  │
    every tick: notice exits (restart trainers; replace lost nodes) · match each pool to its
    desired size (admin API / autoscaler) · record the report · tick callback (live view)
                                                                  │
    end: every trainer done, max_time_s, or stop ─► nodes ─► evaluators ─► trainers ─► dataflow

The launcher holds no component logic: it starts ``astraflow <component> --config FILE``
processes from a :class:`~astraflow.launch.plan.Plan` and talks to the dataflow service only
through its client, like any other component. Starting it again with the same run
directory resumes the run (the dataflow reopens its SQLite state, trainers their checkpoints).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow.config import dump_config
from astraflow.dataflow.client import DataflowClient
from astraflow.errors import AstraflowError, ServiceUnavailableError
from astraflow.launch.config import PoolSection, RunConfig
from astraflow.launch.plan import Plan, make_plan, node_config
from astraflow.launch.pools import PoolManager
from astraflow.launch.processes import Proc, ProcessGroup
from astraflow.launch.status import RunStatus, StatusCollector

__all__ = ["LocalRun", "RunResult"]

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """How a run ended."""

    reason: str
    """'finished' (every trainer reached max_steps), 'max_time', 'stopped' or 'failed'."""
    run_dir: Path
    elapsed_s: float
    status: RunStatus | None = None
    failed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether the run ended without a failed component."""
        return self.reason != "failed"


class LocalRun:
    """A run on this machine: one process per component."""

    def __init__(
        self,
        config: RunConfig,
        *,
        base_dir: Path | None = None,
        port: int | None = None,
        on_tick: Callable[[RunStatus], None] | None = None,
        tick_s: float = 1.0,
        python: str = sys.executable,
    ) -> None:
        self.config = config
        self.plan: Plan = make_plan(
            config, port=port or config.dataflow.port or _free_port(), base_dir=base_dir
        )
        self.on_tick = on_tick
        self.tick_s = tick_s
        self.python = python
        self.group = ProcessGroup(on_failure=self._failed)
        self.failures: list[str] = []
        self.client = DataflowClient(self.plan.dataflow_url, timeout_s=10.0, retries=2)
        self.pools = PoolManager(
            self.client, config.pools, self.start_node, self.stop_node, self._node_alive,
            config.autoscale,
        )  # fmt: skip
        self.weights_url: str | None = None
        self.status = StatusCollector(self.client, self.plan.run_dir, list(config.policies))
        self.started = time.monotonic()

    # ------------------------------------------------------------------ components

    def _argv(self, component: list[str], config_file: Path) -> list[str]:
        return [self.python, "-m", "astraflow", *component, "--config", str(config_file)]

    def _proc(self, name: str, kind: str, argv: list[str], **kw: Any) -> Proc:
        return self.group.add(
            Proc(name, kind, argv, self.plan.run_dir / "logs" / f"{name}.log", **kw)
        )

    def start_dataflow(self) -> None:
        """Start the dataflow service and wait until it answers."""
        proc = self._proc(
            "dataflow", "dataflow",
            self._argv(["dataflow", "serve"], self.plan.component_file("dataflow")),
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if not proc.alive:
                raise AstraflowError(f"the dataflow service exited at start:\n{proc.tail()}")
            try:
                self.client.health()
                return
            except ServiceUnavailableError:
                time.sleep(0.25)
        raise AstraflowError(f"the dataflow service did not answer in 120 s:\n{proc.tail()}")

    def start_weight_server(self) -> None:
        """Serve the weight store over HTTP (for nodes on other machines)."""
        port = _free_port()
        self._proc(
            "weights", "weights",
            [self.python, "-m", "astraflow", "weights", "serve", "--root",
             str(self.plan.weights_root), "--host", self.plan.dataflow.host, "--port", str(port)],
        )  # fmt: skip
        self.weights_url = f"http://{self.plan.dataflow.host}:{port}"

    def start_trainer(self, policy: str) -> None:
        """Start the trainer of ``policy`` (FSDP2 ranks under torchrun)."""
        cfg = self.plan.trainers[policy]
        file = self.plan.component_file(f"trainer-{policy}")
        ranks = self.config.policies[policy].processes
        if ranks > 1:
            argv = [self.python, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={ranks}", "-m", "astraflow", "train",
                    "--config", str(file)]  # fmt: skip
        else:
            argv = self._argv(["train"], file)
        env = _threads_env(self.config.threads.get("trainer"))
        self._proc(f"trainer-{policy}", "trainer", argv, env=env, max_restarts=5)
        log.info("trainer policy=%s run_dir=%s", policy, cfg.run_dir)

    def start_node(self, pool: PoolSection) -> str:
        """Start one node of ``pool``; returns its node id."""
        cfg = node_config(self.plan, pool, weights=self.weights_url)
        file = self.plan.component_file(f"node-{cfg.node_id}")
        dump_config(cfg, file)
        env = _threads_env(self.config.threads.get("node"))
        self._proc(
            f"node-{cfg.node_id}", f"node:{pool.name}",
            self._argv(["raas", "serve"], file), env=env, restart=False,
        )  # fmt: skip
        return cfg.node_id

    def stop_node(self, node_id: str) -> None:
        """Retire a node: SIGTERM (it hands its leases back and exits)."""
        proc = self.group.procs.get(f"node-{node_id}")
        if proc is not None:
            proc.stopping = True
            proc.signal(15)

    def _node_alive(self, node_id: str) -> bool:
        proc = self.group.procs.get(f"node-{node_id}")
        return proc is not None and proc.alive

    def start_evals(self) -> None:
        """Start one evaluator per evaluated policy."""
        env = _threads_env(self.config.threads.get("eval", 1))
        for policy in self.plan.evals:
            self._proc(
                f"eval-{policy}", "eval",
                self._argv(["eval"], self.plan.component_file(f"eval-{policy}")), env=env,
            )  # fmt: skip

    def _failed(self, proc: Proc) -> None:
        self.failures.append(proc.name)

    # ------------------------------------------------------------------ run

    def run(self, stop: threading.Event | None = None) -> RunResult:
        """Start everything, supervise until done, stop everything; always cleans up."""
        stop = stop or threading.Event()
        self.started = time.monotonic()
        reason = "failed"
        status: RunStatus | None = None
        try:
            self._check_resume()
            self.plan.write()
            self.start_dataflow()
            if self.config.serve_weights:
                self.start_weight_server()
            for policy in self.plan.trainers:
                self.start_trainer(policy)
            self.pools.start()
            self.start_evals()
            reason, status = self._supervise(stop)
        finally:
            self.shutdown()
        if status is not None:
            # after shutdown: evaluators score the final version on their way out
            status = self.status.collect(
                {name: self.pools.count(name) for name in self.pools.pools}, {}
            )
            self._write_summary(reason, status)
        self.client.close()
        return RunResult(
            reason, self.plan.run_dir, time.monotonic() - self.started, status, self.failures
        )

    def _supervise(self, stop: threading.Event) -> tuple[str, RunStatus | None]:
        status: RunStatus | None = None
        report_log = (self.plan.run_dir / "report.jsonl").open("a")
        try:
            while True:
                self.group.poll()
                self.pools.tick()
                status = self.status.collect(
                    {name: self.pools.count(name) for name in self.pools.pools},
                    {name: p.alive for name, p in self.group.procs.items()},
                )
                if status.report is not None:
                    report_log.write(status.report.model_dump_json() + "\n")
                    report_log.flush()
                if self.on_tick is not None:
                    self.on_tick(status)
                if self.failures:
                    return "failed", status
                if self._trainers_done():
                    return "finished", status
                limit = self.config.max_time_s
                if limit is not None and time.monotonic() - self.started > limit:
                    return "max_time", status
                if stop.wait(self.tick_s):
                    return "stopped", status
        finally:
            report_log.close()

    def _trainers_done(self) -> bool:
        trainers = self.group.of_kind("trainer")
        return bool(trainers) and all(p.exit_code == 0 for p in trainers)

    def shutdown(self) -> None:
        """Stop components in order: nodes, evaluators, trainers, weight server, dataflow."""
        self.pools.closing = True
        nodes = [p for p in self.group.procs.values() if p.kind.startswith("node")]
        self.group.stop(nodes, timeout_s=20)
        self.group.stop(self.group.of_kind("eval"), timeout_s=60)
        self.group.stop(self.group.of_kind("trainer"), timeout_s=60)
        self.group.stop(self.group.of_kind("weights"), timeout_s=10)
        self.group.stop(self.group.of_kind("dataflow"), timeout_s=15)
        self.group.kill_all()

    def _check_resume(self) -> None:
        previous = self.plan.run_dir / "run.json"
        if not previous.exists():
            return
        old = json.loads(previous.read_text())
        new = json.loads(self.config.model_dump_json())
        changed = sorted(k for k in new.keys() | old.keys() if old.get(k) != new.get(k))
        log.info(
            "resuming run in %s%s", self.plan.run_dir,
            f" (changed since last start: {', '.join(changed)})" if changed else "",
        )  # fmt: skip

    def _write_summary(self, reason: str, status: RunStatus) -> None:
        from astraflow.launch.plots import write_plots

        summary = {"reason": reason, "elapsed_s": round(time.monotonic() - self.started, 2),
                   **status.summary()}  # fmt: skip
        (self.plan.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        try:
            write_plots(self.plan.run_dir)
        except (OSError, ValueError) as exc:
            log.warning("could not write plots: %s", exc)


def _threads_env(threads: int | None) -> dict[str, str]:
    if threads is None:
        return {}
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
