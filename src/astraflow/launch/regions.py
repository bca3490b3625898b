"""Heterogeneous and remote pools of a local run: CPU quotas, WAN links, regional relays.

For each pool of the run config::

    speed < 1   each node process is moved into its own cgroup (``launch.cgroups``) with a
                CPU quota once the dataflow has seen it (ready): the quota slows rollout,
                as a GPU power cap does, not the process's imports and engine start-up
    link        an emulated WAN link (``astraflow.link``) runs in the launcher, forwarding the
                dataflow service and the weight server; the pool's nodes get the link's URLs
    relay       a ``astraflow weights relay`` process pulls through the link into
                ``<run_dir>/relays/<pool>``; the pool's nodes pull weights from it instead

At the end the bytes each link carried go to ``<run_dir>/links.json``, and each quota's
``cpu.stat`` (periods throttled) to ``<run_dir>/cgroups.json``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from astraflow.launch.cgroups import CpuQuotas, check_cpu_cgroups, move_to_cgroup
from astraflow.launch.config import PoolSection, RunConfig
from astraflow.link import Link
from astraflow.raas.config import NodeConfig

__all__ = ["Regions"]

log = logging.getLogger(__name__)


class Regions:
    """The links, relays and CPU quotas of one run's pools."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.pools = {p.name: p for p in config.pools}
        self.links: dict[str, Link] = {}
        self.relays: dict[str, str] = {}
        self._quotas: CpuQuotas | None = None
        self._pending: dict[str, tuple[str, Path]] = {}  # component name -> (node id, cgroup)

    @property
    def remote(self) -> bool:
        """Whether any pool sits behind a link (then weights are served over HTTP)."""
        return any(p.link is not None for p in self.config.pools)

    @property
    def threads_env(self) -> dict[str, str]:
        """Environment of a relay: one torch thread (it only copies and compares bits)."""
        return {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

    def check(self) -> None:
        """Fail before anything starts when a slowed pool cannot get its CPU quota."""
        slowed = [p.name for p in self.config.pools if p.speed < 1]
        if slowed:
            check_cpu_cgroups()
            self._quotas = CpuQuotas(str(self.config.run_dir.resolve()))

    def open_links(self, dataflow_url: str, weights_url: str) -> list[PoolSection]:
        """Start every pool's link; returns the pools that want a relay."""
        with_relay = []
        for pool in self.config.pools:
            if pool.link is None:
                continue
            link = Link.for_urls(pool.link, {"dataflow": dataflow_url, "weights": weights_url})
            link.start()
            self.links[pool.name] = link
            log.info(
                "pool=%s behind a link delay_ms=%s rate_mbit=%s dataflow=%s weights=%s",
                pool.name, pool.link.delay_ms, pool.link.rate_mbit,
                link.url("dataflow"), link.url("weights"),
            )  # fmt: skip
            if pool.relay:
                with_relay.append(pool)
        return with_relay

    def node_urls(self, pool: PoolSection, cfg: NodeConfig) -> NodeConfig:
        """``cfg`` with the URLs a node of ``pool`` reaches the services by."""
        link = self.links.get(pool.name)
        if link is None:
            return cfg
        weights = self.relays.get(pool.name) or link.url("weights")
        return cfg.model_copy(update={"dataflow_url": link.url("dataflow"), "weights": weights})

    def slow_down(self, pool: str | None, name: str, node_id: str) -> None:
        """Make a cgroup for component ``name`` (node ``node_id``) of a slowed ``pool``; the
        process joins it once ready (``throttle_ready``)."""
        section = self.pools.get(pool or "")
        if section is None or section.speed >= 1:
            return
        assert self._quotas is not None, "check() first"
        cpus = self.config.threads.get("node") or os.cpu_count() or 1
        self._pending[name] = (node_id, self._quotas.create(name, section.speed * cpus))

    def throttle_ready(self, seen: Iterable[str], pids: Mapping[str, int | None]) -> None:
        """Move each slowed node the dataflow has seen (node ids ``seen``) into its cgroup;
        ``pids``: process id per component name."""
        seen = set(seen)
        for name, (node_id, cgroup) in list(self._pending.items()):
            pid = pids.get(name)
            if node_id not in seen or pid is None:
                continue
            try:
                move_to_cgroup(cgroup, pid)
            except OSError as exc:  # the process ended meanwhile: nothing to slow
                log.info("node %s not moved into %s: %s", node_id, cgroup, exc)
            else:
                log.info("node %s (pid %d) now runs under %s", node_id, pid, cgroup)
            del self._pending[name]

    def close(self, run_dir: Path) -> None:
        """Close the links (writing what they carried) and remove the cgroups."""
        if self.links:
            carried = {
                name: {"config": json.loads(link.config.model_dump_json()),
                       "up": link.stats.up, "down": link.stats.down,
                       "connections": link.stats.connections}
                for name, link in self.links.items()
            }  # fmt: skip
            (run_dir / "links.json").write_text(json.dumps(carried, indent=2) + "\n")
        for link in self.links.values():
            link.close()
        self.links.clear()
        if self._quotas is not None:
            stats = self._quotas.stats()
            (run_dir / "cgroups.json").write_text(json.dumps(stats, indent=2) + "\n")
            self._quotas.close()
