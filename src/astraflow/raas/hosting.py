"""Bringing a node's policies and workflows up: tokenizer, engine, first weights.

A policy with its own ``model`` starts from it (version 0) and switches to the weight
store's versions once there are any. A policy without one is built from the store:
assets (HF config + tokenizer) via ``fetch_assets``, then the latest version in full;
until the trainer has published them, the node waits (and can still be stopped). A fresh
trainer publishes the assets before its warm-up, so the engine is built while it warms up.

    fetch_assets ─► tokenizer ─► engine(config, context) ─► load(latest) ─► NodePolicy
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from astraflow.errors import AstraflowError, ConfigError
from astraflow.plugins import PluginSpec
from astraflow.raas.config import NodeConfig, PolicyConfig
from astraflow.raas.engines.base import EngineContext, build_engine
from astraflow.raas.io import WeightFeed
from astraflow.raas.policy import NodePolicy
from astraflow.workflows.api import Tool, Workflow

__all__ = ["build_tools", "build_workflows", "host_policy"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds between looks at the weight store while a policy's assets are not there yet.
POLL_S = 2.0
#: The same for its first weights once the assets are there: the trainer publishes the
#: assets before its warm-up and version 0 after it, and the first batch waits for this look.
WEIGHTS_POLL_S = 0.25


async def _until_available(
    fn: Callable[[], T | None], what: str, stop: asyncio.Event, every_s: float = POLL_S
) -> T | None:
    """Call ``fn`` (in a thread) every ``every_s`` until it returns a value; None when
    stopped first."""
    warned = False
    while not stop.is_set():
        try:
            value = await asyncio.to_thread(fn)
        except (AstraflowError, OSError) as exc:
            value = None
            reason = str(exc)
        else:
            reason = "not published yet"
        if value is not None:
            return value
        if not warned:
            log.warning("waiting for %s: %s", what, reason)
            warned = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
    return None


async def host_policy(
    name: str,
    cfg: PolicyConfig,
    weights: WeightFeed,
    work_dir: Path,
    seed: int,
    stop: asyncio.Event,
) -> NodePolicy | None:
    """Build one policy's engine and load its first weights; None if stopped meanwhile."""
    from astraflow.models import build_tokenizer

    assets: Path | None = None
    if cfg.model is not None:
        tokenizer = await asyncio.to_thread(build_tokenizer, cfg.model)
    else:
        dest = work_dir / name / "assets"
        assets = await _until_available(
            lambda: weights.fetch_assets(name, dest), f"assets of policy {name!r}", stop
        )
        if assets is None:
            return None
        tokenizer = await asyncio.to_thread(_auto_tokenizer, assets)
    context = EngineContext(
        policy=name,
        tokenizer=tokenizer,
        work_dir=work_dir / name / "engine",
        model=cfg.model,
        assets_dir=assets,
        seed=seed,
    )
    context.work_dir.mkdir(parents=True, exist_ok=True)
    engine = await asyncio.to_thread(build_engine, cfg.engine, context)
    policy = NodePolicy(name, tokenizer, engine, frozen=cfg.is_frozen, from_store=False)
    if cfg.is_frozen:
        return policy
    if cfg.model is not None:
        latest = await asyncio.to_thread(weights.latest, name)
    else:
        latest = await _until_available(
            lambda: weights.latest(name), f"weights of policy {name!r}", stop, WEIGHTS_POLL_S
        )
        if latest is None:
            await policy.close()
            return None
    if latest is not None:
        await policy.load(weights, latest)
    log.info("hosting policy=%s engine=%s version=%d", name, cfg.engine.type, policy.version)
    return policy


def _auto_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def build_workflows(config: NodeConfig, policies: Mapping[str, NodePolicy]) -> dict[str, Workflow]:
    """Build every configured workflow from the registry; each must find its policies here."""
    from astraflow.workflows.registry import WORKFLOWS

    out: dict[str, Workflow] = {}
    for name, spec in config.workflows.items():
        workflow = WORKFLOWS.build(spec, seed=config.seed)
        missing = sorted(set(workflow.policies) - set(policies))
        if missing:
            raise ConfigError(
                f"workflow {name!r} calls policies {missing} that this node does not host "
                f"(hosted: {sorted(policies)})"
            )
        out[name] = workflow
    return out


def build_tools(specs: Mapping[str, PluginSpec], seed: int) -> dict[str, Tool]:
    """Tools offered to every workflow, by name, from ``workflows.tools.TOOLS``."""
    if not specs:
        return {}
    from astraflow.workflows.tools import TOOLS

    return {name: TOOLS.build(spec, seed=seed) for name, spec in specs.items()}
