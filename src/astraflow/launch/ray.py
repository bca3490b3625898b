"""``astraflow run --cluster ray``: the same components, each hosted by a Ray actor.

:class:`RayRun` is the launcher of ``launch.local`` (same plan, start order, supervision,
pools, autoscaler, ordered shutdown, summary); only the host differs. A component's actor
runs the component's own entry in its worker process, the one its CLI command runs:

    RayRun.run ─► ray.init(ray.address | $RAY_ADDRESS | a local Ray for this run)
        ─► [several machines: the dataflow's actor is placed first; the plan uses the address
            of the machine it landed on, and nodes pull weights from a weight-server actor]
        ─► Launcher.run: dataflow ─► [weights] ─► trainers ─► pools ─► evaluators ─► ...
        ─► ray.shutdown ─► (a local Ray) wait for its processes, kill what lingers

    ComponentActor (max_concurrency: run blocks, stop and where still answer)
      where() ── placed: machine address, a free port there, pid
      run(entry, config JSON) ── the component until it ends ──► 0 | exception (code 1)
      stop() ── sets the stop event: what SIGTERM does to the component's process

Only JSON text and plain strings are handed to actors. Output goes to
``<run_dir>/logs/<name>.log`` like a local process's. On one machine, components share the
run directory and nodes read weights from it; on several, the run directory must be on a
filesystem the machines running the dataflow, trainers and evaluators share (rollout nodes
need none: they meet the rest only at the dataflow and weight-server URLs).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from astraflow.errors import AstraflowError, ConfigError
from astraflow.launch.config import RaySection
from astraflow.launch.local import ComponentSpec, Launcher, RunResult
from astraflow.launch.plan import make_plan
from astraflow.launch.processes import Component, tail_file

__all__ = ["ComponentActor", "RayComponent", "RayRun"]

log = logging.getLogger(__name__)

#: Exit code of a component whose actor the cluster could not place in time.
UNPLACED = 3
#: Environment variables handed to every actor (tokens, caches), as local processes inherit.
_FORWARDED_PREFIX = "ASTRAFLOW_"

# ---------------------------------------------------------------------------- actor side


def _run_dataflow(config: str, options: dict[str, str], stop: threading.Event) -> None:
    from astraflow.dataflow.config import DataflowConfig
    from astraflow.dataflow.server import serve

    serve(DataflowConfig.model_validate_json(config), stop)


def _run_weights(config: str, options: dict[str, str], stop: threading.Event) -> None:
    from astraflow.weights.server import serve_in_thread

    with serve_in_thread(options["root"], options["host"], int(options["port"])) as url:
        log.info("weights serving url=%s root=%s", url, options["root"])
        stop.wait()


def _run_trainer(config: str, options: dict[str, str], stop: threading.Event) -> None:
    from astraflow.heap import freeze_heap
    from astraflow.trainer.config import TrainerConfig
    from astraflow.trainer.loop import Trainer

    trainer = Trainer(TrainerConfig.model_validate_json(config))
    try:
        trainer.start()
        freeze_heap(f"trainer {trainer.config.policy}")  # the actor's worker is its own
        trainer.run(stop)
    finally:
        trainer.close()


def _run_node(config: str, options: dict[str, str], stop: threading.Event) -> None:
    from astraflow.raas.config import NodeConfig
    from astraflow.raas.node import run_node

    asyncio.run(run_node(NodeConfig.model_validate_json(config), stop))


def _run_eval(config: str, options: dict[str, str], stop: threading.Event) -> None:
    from astraflow.evaluation.config import EvalConfig
    from astraflow.evaluation.runner import Evaluator

    Evaluator(EvalConfig.model_validate_json(config)).run(stop)


ENTRIES: dict[str, Callable[[str, dict[str, str], threading.Event], None]] = {
    "dataflow": _run_dataflow,
    "weights": _run_weights,
    "trainer": _run_trainer,
    "node": _run_node,
    "eval": _run_eval,
}


class ComponentActor:
    """Hosts one component in this Ray worker process (one actor per component)."""

    def __init__(self, name: str, log_path: str, cwd: str) -> None:
        from astraflow.observability import setup_logging

        self.name = name
        self.stop_event = threading.Event()
        if os.path.isdir(cwd):  # relative paths mean what they mean to the launcher
            os.chdir(cwd)
        path = Path(log_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as out:  # like a local process: stdout and stderr to its log
            out.write(
                f"\n=== start {name} (ray actor pid {os.getpid()}) at {time.ctime()}\n".encode()
            )
            out.flush()
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
        setup_logging("INFO", "text", component=name)

    def where(self) -> dict[str, Any]:
        """Where the actor was placed: machine address, a free port there, pid."""
        ip = str(ray.util.get_node_ip_address())
        with socket.socket() as s:
            s.bind((ip, 0))
            port = int(s.getsockname()[1])
        return {"ip": ip, "port": port, "pid": os.getpid()}

    def run(self, entry: str, config: str, options: dict[str, str]) -> int:
        """Run the component until it ends or :meth:`stop` is called; 0, or it raises."""
        log.info("component=%s entry=%s pid=%d", self.name, entry, os.getpid())
        try:
            ENTRIES[entry](config, options, self.stop_event)
        except BaseException:
            log.exception("component=%s failed", self.name)
            raise
        log.info("component=%s exited", self.name)
        return 0

    def stop(self) -> None:
        """Graceful stop (what SIGTERM does to the component's process)."""
        self.stop_event.set()


_Actor = ray.remote(max_concurrency=4, max_restarts=0)(ComponentActor)

# ---------------------------------------------------------------------------- driver side


@dataclass
class RayComponent:
    """A component hosted by a Ray actor, as the launcher's :class:`Component`."""

    name: str
    kind: str
    """The component kind, which names its entry (``ENTRIES``)."""
    config: str
    """The component's config as JSON text."""
    options: dict[str, str]
    actor_options: dict[str, Any]
    log_path: Path
    cwd: str
    place_timeout_s: float | None = None
    """Fail when not placed within this long while the cluster's free resources cannot hold
    it (None: wait for resources indefinitely)."""
    restart: bool = True
    max_restarts: int = 3
    restarts: int = 0
    exit_code: int | None = None
    stopping: bool = False
    pid: int | None = None
    """The actor's worker process once placed (on its machine)."""
    actor: Any = None
    _where: Any = None
    _ref: Any = None
    _code: int | None = None
    _error: str = ""
    _since: float = 0.0
    _warned: bool = False

    def place(self) -> None:
        """Ask the cluster for the actor (idempotent; placement happens in the background)."""
        if self.actor is None:
            self.actor = _Actor.options(**self.actor_options).remote(
                self.name, str(self.log_path), self.cwd
            )
            self._where = self.actor.where.remote()
            self._since = time.monotonic()

    def adopt(self, other: RayComponent) -> None:
        """Run in ``other``'s (placed, idle) actor."""
        self.actor, self._where, self._since = other.actor, other._where, other._since

    def endpoint(self, timeout_s: float) -> tuple[str, int]:
        """Place the actor and return its machine's address and a free port there."""
        self.place()
        while True:
            try:
                where = ray.get(self._where, timeout=1.0)
                break
            except GetTimeoutError as exc:
                waited = time.monotonic() - self._since
                if waited > timeout_s and not self._placed_or_fits():
                    raise AstraflowError(f"{self.name}: {self._unplaced(waited)}") from exc
        return str(where["ip"]), int(where["port"])

    def start(self) -> None:
        """Run the component in a placed (or, after a crash, a fresh) actor."""
        if self._ref is not None:
            self.kill()
            self.actor = None
        self.place()
        self._ref = self.actor.run.remote(self.kind, self.config, self.options)
        self._code, self._error, self.exit_code = None, "", None
        log.info("started %s as a ray actor %s", self.name, self.actor_options)

    def poll(self) -> int | None:
        """The exit code once the component has ended (its actor is then released)."""
        if self._code is not None or self._ref is None:
            return self._code
        ready, _ = ray.wait([self._ref], timeout=0)
        if ready:
            try:
                code = int(ray.get(self._ref))
            except RayTaskError as exc:
                code, self._error = 1, str(exc)
            except RayActorError as exc:
                code, self._error = -9, f"the actor's process died: {exc}"
            return self._finish(code)
        if self.pid is None and self._placement_overdue():
            self.restarts = self.max_restarts  # more attempts would not find resources either
            self._error = self._unplaced(self.place_timeout_s or 0)
            return self._finish(UNPLACED)
        return None

    def _placement_overdue(self) -> bool:
        if ray.wait([self._where], timeout=0)[0]:
            try:
                self.pid = int(ray.get(self._where)["pid"])
            except RayActorError:
                return False  # the run call reports the death
            return False
        waited = time.monotonic() - self._since
        if self.place_timeout_s is None or self._placed_or_fits():
            if waited > 60 and not self._warned:
                self._warned = True
                log.warning("%s is not running yet: %s", self.name, self._unplaced(waited))
            return False
        return waited > self.place_timeout_s

    def _placed_or_fits(self) -> bool:
        """Whether the actor is placed, or the cluster's free resources hold its ask now.

        Either way, an actor not yet answering is one whose worker process is still
        starting (slow on a loaded machine), not one waiting for resources: the placement
        timeout does not count against it. Ray's actor table (GCS) says whether a worker
        process was given to the actor; where that private API is missing, the free
        resources decide alone.
        """
        try:
            from ray._private.state import actors as actor_table

            entry = actor_table(self.actor._actor_id.hex())
            if int(entry.get("Pid") or 0) > 0:
                return True
        except Exception:  # a Ray without that table: decide by the free resources
            pass
        free = ray.available_resources()
        ask = dict(self.actor_options.get("resources") or {})
        ask["CPU"] = float(self.actor_options.get("num_cpus") or 0)
        ask["GPU"] = float(self.actor_options.get("num_gpus") or 0)
        return all(float(free.get(key, 0.0)) >= amount for key, amount in ask.items() if amount)

    def _unplaced(self, waited: float) -> str:
        asked = {k: v for k, v in self.actor_options.items() if k != "runtime_env"}
        return (
            f"not placed on the Ray cluster after {waited:.0f}s: it asks for {asked}; "
            f"the cluster has {ray.available_resources()} available"
        )

    def _finish(self, code: int) -> int:
        self._code = code
        self.kill()  # free its resources; the actor's process exits
        return code

    def terminate(self) -> None:
        """Set the component's stop event (an actor not yet placed is simply removed)."""
        if self.actor is None or self._code is not None:
            return
        if self.pid is None and not ray.wait([self._where], timeout=0)[0]:
            self.kill()
            return
        self.actor.stop.remote()  # a dead actor: the call fails quietly, poll() reports it

    def kill(self) -> None:
        """End the actor's process at once."""
        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)

    def wait(self, timeout_s: float | None) -> int | None:
        """Wait for the component to end; its exit code, or None on time-out."""
        if self._ref is None:
            return self._code
        ray.wait([self._ref], timeout=timeout_s)
        return self.poll()

    def tail(self, lines: int = 20) -> str:
        """Last lines of its log, and how its actor ended."""
        text = tail_file(self.log_path, lines)
        return f"{text}\n{self._error}".strip() if self._error else text


class RayRun(Launcher):
    """A run whose components are Ray actors; the same supervision as :class:`LocalRun`."""

    def _prepare(self) -> None:
        self.machines = 1
        self.cwd = os.getcwd()
        self._placed: dict[str, RayComponent] = {}

    def run(self, stop: threading.Event | None = None) -> RunResult:
        """Join (or start) the Ray cluster, run as :meth:`Launcher.run` does, leave it."""
        ranked = [n for n in self.config.trained if self.config.policies[n].processes > 1]
        if ranked:
            self.client.close()
            raise ConfigError(
                f"policies {ranked}: processes > 1 (FSDP2 ranks) are not placed as Ray "
                "actors yet; use --cluster local or processes: 1"
            )
        shaped = [p.name for p in self.config.pools if p.speed < 1 or p.link is not None]
        if shaped:
            self.client.close()
            raise ConfigError(
                f"pools {shaped}: speed < 1, link and relay are set up by the local launcher "
                "only; use --cluster local (or give Ray nodes real hardware and links)"
            )
        try:
            with ray_cluster(self.config.ray) as machines:
                self.machines = machines
                if machines > 1 and self.plan.dataflow.host in ("127.0.0.1", "localhost"):
                    self._place_dataflow()
                return super().run(stop)
        finally:
            self.client.close()

    def _place_dataflow(self) -> None:
        """Several machines: the dataflow listens on the address of the one it lands on."""
        host, port = self._endpoint("dataflow")
        section = self.config.dataflow.model_copy(update={"host": host})
        config = self.config.model_copy(update={"dataflow": section})
        self.client.close()
        self._bind(
            make_plan(config, port=self.config.dataflow.port or port, base_dir=self.base_dir)
        )
        log.info("dataflow placed url=%s machines=%d", self.plan.dataflow_url, self.machines)

    def _serve_weights(self) -> bool:
        return self.config.serve_weights or self.machines > 1

    def _endpoint(self, name: str) -> tuple[str, int]:
        """Place ``name``'s actor now; it listens on its machine's address."""
        comp = self._host(ComponentSpec(name, name, ()))
        self._placed[name] = comp
        return comp.endpoint(self.config.ray.place_timeout_s)

    def _component(self, spec: ComponentSpec) -> Component:
        comp = self._host(spec)
        placed = self._placed.pop(spec.name, None)
        if placed is not None:  # its actor was placed early, to learn its address
            comp.adopt(placed)
        return comp

    def _host(self, spec: ComponentSpec) -> RayComponent:
        res = self.config.ray.actor_resources(spec.kind, spec.pool)
        env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_PREFIX)}
        env.update(spec.env)
        options: dict[str, Any] = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus}
        if res.resources:
            options["resources"] = dict(res.resources)
        if env:
            options["runtime_env"] = {"env_vars": env}
        return RayComponent(
            spec.name, spec.kind,
            spec.config.model_dump_json() if spec.config is not None else "",
            dict(spec.options), options, self.plan.run_dir / "logs" / f"{spec.name}.log",
            self.cwd, None if spec.kind == "node" else self.config.ray.place_timeout_s,
            restart=spec.restart, max_restarts=spec.max_restarts,
        )  # fmt: skip


@contextmanager
def ray_cluster(section: RaySection) -> Iterator[int]:
    """Join the cluster ``section`` names, or start a local one (stopped on exit, with every
    process it started); yields the number of machines."""
    if ray.is_initialized():  # the caller's own Ray session: use it, leave it running
        yield _machines()
        return
    address = section.address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    if section.runtime_env:
        kwargs["runtime_env"] = section.runtime_env
    if address is None:
        kwargs.update(num_cpus=section.num_cpus, include_dashboard=False)
    # a local Ray for one run needs no token auth (Ray 2.60 turns it on and writes
    # ~/.ray/auth_token); an explicit RAY_AUTH_MODE is kept
    no_auth = address is None and "RAY_AUTH_MODE" not in os.environ
    import psutil  # type: ignore[import-untyped]  # no stubs; ray ships it (thirdparty_files)

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        if no_auth:
            os.environ["RAY_AUTH_MODE"] = "disabled"
        ray.init(address=address or "local", **kwargs)  # "local": never a `ray start` one
        log.info("ray connected address=%s resources=%s", address, ray.cluster_resources())
        yield _machines()
    finally:
        started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        ray.shutdown()
        if address is None:
            _reap(started, timeout_s=15)
        if no_auth:
            os.environ.pop("RAY_AUTH_MODE", None)


def _machines() -> int:
    return sum(1 for n in ray.nodes() if n.get("Alive"))


def _reap(procs: list[Any], timeout_s: float) -> None:
    """Wait for a local Ray's processes to exit after shutdown; kill the ones that linger."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for proc in alive:
        log.warning("ray process pid=%d still runs after shutdown: killing it", proc.pid)
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=5)
