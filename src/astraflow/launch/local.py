"""Run every component of a run, supervise them, stop them cleanly: the launcher's one loop.

    plan ─► dataflow ─(healthy)─► [weight server] ─► trainers ─► nodes per pool ─► evaluators
                                                                  │
    every tick: notice exits (restart trainers; replace lost nodes) · match each pool to its
    desired size (admin API / autoscaler) · record the report · tick callback (live view)
                                                                  │
    end: every trainer done, max_time_s, or stop ─► nodes + trainers ─► evaluators ─► dataflow

:class:`Launcher` holds that loop and no component logic; a subclass only says how one
component is hosted (:meth:`Launcher._component`): :class:`LocalRun` starts
``astraflow <component> --config FILE`` processes, ``launch.ray.RayRun`` Ray actors. The
launcher talks to the dataflow service only through its client, like any other component.
Starting it again with the same run directory resumes the run (the dataflow reopens its
SQLite state, trainers their checkpoints).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from astraflow.config import dump_config
from astraflow.dataflow.client import DataflowClient
from astraflow.dataflow.config import ENV_TOKENS
from astraflow.errors import AstraflowError, ServiceUnavailableError
from astraflow.launch.config import PoolSection, RunConfig
from astraflow.launch.plan import Plan, make_plan, node_config, node_stop_timeout
from astraflow.launch.pools import PoolManager
from astraflow.launch.processes import Component, ComponentGroup, Proc
from astraflow.launch.regions import Regions
from astraflow.launch.status import RunStatus, StatusCollector
from astraflow.launch.telemetry import RunFeed
from astraflow.records import Role
from astraflow.weights.access import ENV_WEIGHT_TOKENS, WeightRole, WeightsAuthConfig

__all__ = ["ComponentSpec", "Launcher", "LocalRun", "RunResult"]

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


@dataclass(frozen=True)
class ComponentSpec:
    """One component to start, whatever hosts it (a process, a Ray actor)."""

    name: str
    """Unique in the run; also names its config file and its log."""
    kind: str
    """'dataflow', 'weights', 'trainer', 'node' or 'eval' (``config.COMPONENT_KINDS``)."""
    command: tuple[str, ...]
    """The ``astraflow`` subcommand that runs it, e.g. ``("raas", "serve")``."""
    config: BaseModel | None = None
    """Its config (written to the plan's component file, read with ``--config``)."""
    options: dict[str, str] = field(default_factory=dict)
    """Command-line options of ``command`` (the weight server: root, host, port)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment (thread counts)."""
    ranks: int = 1
    """Processes (FSDP2 ranks) of a trainer."""
    restart: bool = True
    """Restart in place after a crash (False: replaceable, the pool manager replaces it)."""
    max_restarts: int = 3
    """Restarts before the run fails."""
    pool: str | None = None
    """The rollout pool of a node."""
    cpus: tuple[int, ...] = ()
    """CPU ids a local process is pinned to (``placement``; empty: anywhere)."""


class Launcher:
    """The supervision every launcher shares; subclasses host the components."""

    def __init__(
        self,
        config: RunConfig,
        *,
        base_dir: Path | None = None,
        port: int | None = None,
        on_tick: Callable[[RunStatus], None] | None = None,
        tick_s: float = 1.0,
    ) -> None:
        self._prepare()
        self.config = config
        self.base_dir = base_dir
        self.on_tick = on_tick
        self.tick_s = tick_s
        self.group = ComponentGroup(on_failure=self._failed)
        self.failures: list[str] = []
        self.weights_url: str | None = None
        self.regions = Regions(config)
        self._weight_tokens = _weight_tokens()
        self._read_token = secrets.token_urlsafe(24)
        """The dashboard's read token for this run, when tokens are set but no read one."""
        self.feed: RunFeed | None = None
        self.started = time.monotonic()
        self._spares: dict[str, list[str]] | None = None
        """Node ids of earlier launches of this run, per pool, not used again yet."""
        port = port or config.dataflow.port or _free_port()
        self._bind(make_plan(config, port=port, base_dir=base_dir))

    def _bind(self, plan: Plan) -> None:
        """Use ``plan`` (and the dataflow URL it names) from now on."""
        self.plan = plan
        self.client = DataflowClient(
            plan.dataflow_url, token=self._tokens().get("admin"), timeout_s=10.0, retries=2
        )
        self.pools = PoolManager(
            self.client, self.config.pools, self.start_node, self.stop_node, self._node_alive,
            self.config.autoscale,
        )  # fmt: skip
        self.status = StatusCollector(self.client, plan.run_dir, list(self.config.policies))

    # ------------------------------------------------------------------ hosting (subclasses)

    def _prepare(self) -> None:
        """Set up what the subclass's hosting needs, before the plan is made."""

    def _component(self, spec: ComponentSpec) -> Component:
        """The (not yet started) component that runs ``spec``."""
        raise NotImplementedError

    def _endpoint(self, name: str) -> tuple[str, int]:
        """Address and free port where component ``name`` will listen."""
        return self.plan.dataflow.host, _free_port()

    def _serve_weights(self) -> bool:
        """Whether nodes pull weights from a weight server (else from the directory)."""
        return self.config.serve_weights or self.regions.remote

    # ------------------------------------------------------------------ components

    def _start(self, spec: ComponentSpec) -> Component:
        if spec.config is not None:
            dump_config(spec.config, self.plan.component_file(spec.name))
        tokens = self._tokens()
        roles = _TOKEN_ROLES.get(spec.kind, ())
        # secrets travel in the environment, never in the component config files
        secret_env = {ENV_TOKENS[r]: tokens[r] for r in roles if r in tokens}
        secret_env |= self._weight_token_env(spec.kind)
        cpus = tuple(self.config.placement.get(spec.kind, ()))  # type: ignore[call-overload]
        threads = self._threads(spec.kind, cpus)
        env = {**spec.env, **threads, **secret_env}
        spec = dataclasses.replace(spec, env=env, cpus=cpus)
        return self.group.add(self._component(spec))

    def _threads(self, kind: str, cpus: tuple[int, ...]) -> dict[str, str]:
        """OMP/MKL threads of ``kind``: the configured count, else one per placed CPU."""
        threads = self.config.threads.get(kind)  # type: ignore[call-overload]
        if threads is None and cpus:
            threads = len(cpus)
        if threads is None:
            return {}
        return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}

    def _weight_token_env(self, kind: str) -> dict[str, str]:
        """The weight-server tokens of ``kind``; the other roles' variables blanked, so that
        nothing inherits a token its role does not need from the launcher's environment."""
        roles = _WEIGHT_TOKEN_ROLES.get(kind, ())
        return {
            env: self._weight_tokens[role] if role in roles else ""
            for role, env in ENV_WEIGHT_TOKENS.items()
        }

    def _tokens(self) -> dict[Role, str]:
        """Bearer tokens per role: the run config's, else the launcher's environment; a
        service with tokens but no read token gets a fresh one for this run (the dashboard's)."""
        tokens = self.config.dataflow.auth.tokens()
        if tokens and "read" not in tokens:
            tokens["read"] = self._read_token
        return tokens

    def dashboard_link(self) -> tuple[str, str | None] | None:
        """The dashboard's URL and the read token that opens it (None: the service is open);
        None when the dashboard is off."""
        if not self.config.dataflow.dashboard.enabled:
            return None
        host = self.plan.dataflow.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"http://{host}:{self.plan.dataflow.port}/dashboard", self._tokens().get("read")

    def start_dataflow(self) -> None:
        """Start the dataflow service and wait until it answers."""
        proc = self._start(
            ComponentSpec("dataflow", "dataflow", ("dataflow", "serve"), self.plan.dataflow)
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AstraflowError(f"the dataflow service exited at start:\n{proc.tail()}")
            try:
                self.client.health()
                return
            except ServiceUnavailableError:
                time.sleep(0.25)
        raise AstraflowError(f"the dataflow service did not answer in 120 s:\n{proc.tail()}")

    def start_weight_server(self) -> None:
        """Serve the weight store over HTTP (for nodes on other machines)."""
        host, port = self._endpoint("weights")
        options = {"root": str(self.plan.weights_root), "host": host, "port": str(port)}
        self._start(ComponentSpec("weights", "weights", ("weights", "serve"), options=options))
        self.weights_url = f"http://{host}:{port}"

    def start_trainer(self, policy: str) -> None:
        """Start the trainer of ``policy`` (FSDP2 ranks under torchrun)."""
        cfg = self.plan.trainers[policy]
        self._start(
            ComponentSpec(
                f"trainer-{policy}", "trainer", ("train",), cfg,
                ranks=self.config.policies[policy].processes, max_restarts=5,
            )
        )  # fmt: skip
        log.info("trainer policy=%s run_dir=%s", policy, cfg.run_dir)

    def start_regions(self) -> None:
        """Put each remote pool behind its WAN link, with its weight relay if it has one."""
        assert self.weights_url is not None or not self.regions.remote
        for pool in self.regions.open_links(self.plan.dataflow_url, self.weights_url or ""):
            host, port = self._endpoint(f"relay-{pool.name}")
            options = {
                "upstream": self.regions.links[pool.name].url("weights"),
                "root": str(self.plan.run_dir / "relays" / pool.name),
                "host": host, "port": str(port), "poll_s": "0.5",
                **({"policy": self.config.trained[0]} if self.config.trained else {}),
            }  # fmt: skip
            self._start(ComponentSpec(f"relay-{pool.name}", "relay", ("weights", "relay"),
                                      options=options, env=self.regions.threads_env))  # fmt: skip
            self.regions.relays[pool.name] = f"http://{host}:{port}"

    def start_node(self, pool: PoolSection) -> str:
        """Start one node of ``pool``; returns its node id."""
        node_id = self._spare_id(pool.name)
        cfg = node_config(self.plan, pool, node_id=node_id, weights=self.weights_url)
        cfg = self.regions.node_urls(pool, cfg)
        self._start(
            ComponentSpec(
                f"node-{cfg.node_id}", "node", ("raas", "serve"), cfg,
                restart=False, pool=pool.name,
            )
        )  # fmt: skip
        return cfg.node_id

    def _spare_id(self, pool: str) -> str | None:
        """The id of a node of ``pool`` that an earlier launch of this run started (most recent
        first), to start this launch's nodes under: a node coming back under its id as a new
        process has the dead one's leases re-queued at once (the dataflow's node incarnations)
        instead of holding the resumed run back until they expire. None: a fresh id."""
        if self._spares is None:
            self._spares = _earlier_nodes(self.plan.run_dir)
        ids = self._spares.get(pool)
        return ids.pop(0) if ids else None

    def stop_node(self, node_id: str) -> None:
        """Retire a node gracefully (it hands its leases back and exits)."""
        proc = self.group.procs.get(f"node-{node_id}")
        if proc is not None:
            proc.stopping = True
            proc.terminate()

    def _node_alive(self, node_id: str) -> bool:
        return self.group.alive(f"node-{node_id}")

    def start_evals(self) -> None:
        """Start one evaluator per evaluated policy."""
        one = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env = {} if "eval" in self.config.threads else one  # light: one thread by default
        for policy, cfg in self.plan.evals.items():
            self._start(ComponentSpec(f"eval-{policy}", "eval", ("eval",), cfg, env=env))

    def _failed(self, proc: Component) -> None:
        self.failures.append(proc.name)

    # ------------------------------------------------------------------ run

    def run(self, stop: threading.Event | None = None) -> RunResult:
        """Start everything, supervise until done, stop everything; always cleans up."""
        stop = stop or threading.Event()
        self.started = time.monotonic()
        reason = "failed"
        status: RunStatus | None = None
        try:
            resuming = self._check_resume()
            self.regions.check()
            self.plan.write()
            self.start_dataflow()
            self.feed = RunFeed.for_run(self.config, self.plan.run_dir, self.client, resuming)
            if self._serve_weights():
                self.start_weight_server()
            self.start_regions()
            for policy in self.plan.trainers:
                self.start_trainer(policy)
            self.pools.start()
            self.start_evals()
            reason, status = self._supervise(stop)
        except BaseException:
            self._close_feed()
            raise
        finally:
            self.shutdown()
        if status is not None:
            # after shutdown: evaluators score the final version on their way out (the
            # dataflow is stopped: its last report stands, no retries against it)
            status = self.status.collect(
                {name: self.pools.count(name) for name in self.pools.pools}, {}, ask=False
            )
            self._write_summary(reason, status)
        self._close_feed()
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
                    {name: self.group.alive(name) for name in self.group.procs},
                )
                if status.report is not None:
                    report_log.write(status.report.model_dump_json() + "\n")
                    report_log.flush()
                    self.regions.throttle_ready(status.report.nodes, self._pids())
                if self.feed is not None:
                    self.feed.tick(status.report)
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

    def _close_feed(self) -> None:
        if self.feed is not None:
            self.feed.close()
            self.feed = None

    def _pids(self) -> dict[str, int | None]:
        """OS process id per component name (None where not a local process)."""
        return {name: getattr(proc, "pid", None) for name, proc in self.group.procs.items()}

    def _trainers_done(self) -> bool:
        trainers = self.group.of_kind("trainer")
        return bool(trainers) and all(p.exit_code == 0 for p in trainers)

    def shutdown(self) -> None:
        """Stop components in order: nodes and trainers together, then evaluators (they score
        the trainers' final version on their way out), relays, weight server, dataflow.

        Where every trainer has already exited (a finished run), the evaluators' final version
        is published: they stop together with the nodes instead of after them."""
        self.pools.closing = True
        evals = self.group.of_kind("eval")
        finished = self._trainers_done()
        # nodes hand their leases back while trainers finish their step and checkpoint; both
        # need only the dataflow and the weights, so neither waits for the other
        self.group.stop_together([
            (self.group.of_kind("node"), node_stop_timeout(self.config)),
            (self.group.of_kind("trainer"), 60),
            *([(evals, 60)] if finished else []),
        ])  # fmt: skip
        if not finished:
            self.group.stop(evals, timeout_s=60)
        self.group.stop(self.group.of_kind("relay"), timeout_s=10)
        self.group.stop(self.group.of_kind("weights"), timeout_s=10)
        self.group.stop(self.group.of_kind("dataflow"), timeout_s=15)
        self.group.kill_all()
        self.regions.close(self.plan.run_dir)

    def _check_resume(self) -> bool:
        """Whether this run resumes one (logs what changed since its last start)."""
        previous = self.plan.run_dir / "run.json"
        if not previous.exists():
            return False
        old = json.loads(previous.read_text())
        new = json.loads(self.config.model_dump_json())
        changed = sorted(k for k in new.keys() | old.keys() if old.get(k) != new.get(k))
        log.info(
            "resuming run in %s%s", self.plan.run_dir,
            f" (changed since last start: {', '.join(changed)})" if changed else "",
        )  # fmt: skip
        return True

    def _write_summary(self, reason: str, status: RunStatus) -> None:
        from astraflow.launch.plots import write_plots

        summary = {"reason": reason, "elapsed_s": round(time.monotonic() - self.started, 2),
                   **status.summary()}  # fmt: skip
        (self.plan.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        try:
            write_plots(self.plan.run_dir)
        except (OSError, ValueError) as exc:
            log.warning("could not write plots: %s", exc)


def _earlier_nodes(run_dir: Path) -> dict[str, list[str]]:
    """The node ids each pool had in earlier launches of ``run_dir`` (their component files),
    the most recently started first."""
    found: list[tuple[float, str, str]] = []
    for path in run_dir.glob("components/node-*.json"):
        try:
            data = json.loads(path.read_text())
            started = path.stat().st_mtime
        except (OSError, ValueError):
            continue
        node_id, pool = data.get("node_id"), data.get("pool")
        if isinstance(node_id, str) and isinstance(pool, str) and path.stem == f"node-{node_id}":
            found.append((started, pool, node_id))
    spares: dict[str, list[str]] = {}
    for _, pool, node_id in sorted(found, reverse=True):
        spares.setdefault(pool, []).append(node_id)
    return spares


class LocalRun(Launcher):
    """A run on this machine: one process per component (``astraflow <component>``)."""

    python: str = sys.executable
    """The Python that runs ``astraflow <component>``."""

    def _component(self, spec: ComponentSpec) -> Component:
        args = list(spec.command)
        for key, value in spec.options.items():
            args += [f"--{key.replace('_', '-')}", value]
        if spec.config is not None:
            args += ["--config", str(self.plan.component_file(spec.name))]
        if spec.ranks > 1:
            argv = [self.python, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={spec.ranks}", "-m", "astraflow", *args]  # fmt: skip
        else:
            argv = [self.python, "-m", "astraflow", *args]
        if spec.kind == "node":
            self.regions.slow_down(spec.pool, spec.name, spec.name.removeprefix("node-"))
        return Proc(
            spec.name, spec.kind, argv, self.plan.run_dir / "logs" / f"{spec.name}.log",
            env=spec.env, restart=spec.restart, max_restarts=spec.max_restarts, cpus=spec.cpus,
        )  # fmt: skip


#: Which bearer tokens each kind of component is given (by role).
_TOKEN_ROLES: dict[str, tuple[Role, ...]] = {
    "dataflow": ("node", "trainer", "admin", "read"),
    "trainer": ("trainer",),
    "node": ("node",),
}


#: Which weight-server tokens each kind of component is given (by role).
_WEIGHT_TOKEN_ROLES: dict[str, tuple[WeightRole, ...]] = {
    "weights": ("read", "publish"),
    "node": ("read",),
    "eval": ("read",),
    "relay": ("read",),
}


def _weight_tokens() -> dict[WeightRole, str]:
    """The weight server's tokens: the launcher's environment's, else fresh ones for this run
    (a weight server the launcher starts is never open; the tokens live only in memory and in
    the environment of the components that need them)."""
    given = WeightsAuthConfig().tokens()
    return {role: given.get(role) or secrets.token_urlsafe(24) for role in ENV_WEIGHT_TOKENS}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
