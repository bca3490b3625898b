"""Turn a ``RunConfig`` into the configs each component is started with.

Nothing here starts anything: the local and Ray launchers both start components from a
``Plan``, so a run means the same thing wherever it runs. Every config is written to
``<run_dir>/components/`` as JSON (``astraflow <component> --config FILE`` reads it back).

    <run_dir>/
      run.json              resolved RunConfig
      components/*.json     one config per component process
      dataflow/             the dataflow's SQLite state
      weights/              the weight store
      trainers/<policy>/    metrics.jsonl, checkpoints
      nodes/<node_id>/      node scratch
      eval/<policy>.jsonl   held-out figures per evaluated version (accuracy, avg@k, pass@k)
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow.config import dump_config, fields_of, validate
from astraflow.dataflow.config import DataflowConfig, PolicySettings, RegulationConfig
from astraflow.errors import ConfigError
from astraflow.evaluation.config import EvalConfig, EvalSettings, ScoringSettings
from astraflow.launch.checks import check_run, raise_problems, workflow_names, workflow_spec
from astraflow.launch.config import PolicySection, PoolSection, RunConfig, WarmupSection
from astraflow.models import ModelSpec
from astraflow.plugins import PluginSpec
from astraflow.progress import track
from astraflow.raas.config import NodeConfig
from astraflow.raas.config import PolicyConfig as RolloutConfig
from astraflow.trainer.config import TrainerConfig, WarmupSettings

__all__ = [
    "NODE_GRACE_S",
    "Plan",
    "make_plan",
    "node_config",
    "node_stop_timeout",
    "sync_round_tasks",
]

#: A launched node's grace for running tasks on stop (``pools[].node.grace_s`` overrides it).
NODE_GRACE_S = 10.0
#: What a node may take beyond its grace to stop: cancel, hand leases back, close engines.
NODE_CLOSE_S = 15.0


@dataclass
class Plan:
    """Every component config of a run (nodes are made per pool on demand)."""

    config: RunConfig
    run_dir: Path
    dataflow: DataflowConfig
    trainers: dict[str, TrainerConfig]
    evals: dict[str, EvalConfig]
    weights_root: Path
    vocab_sizes: dict[str, int] = field(default_factory=dict)
    sync_round_tasks: int | None = None
    """Tasks per sync round (sync mode only): the dataflow's round and the trainers' batch."""

    @property
    def dataflow_url(self) -> str:
        """URL of the dataflow service."""
        return f"http://{self.dataflow.host}:{self.dataflow.port}"

    def component_file(self, name: str) -> Path:
        """Where the config of component ``name`` is written."""
        return self.run_dir / "components" / f"{name}.json"

    def write(self) -> None:
        """Write run.json and every component config."""
        dump_config(self.config, self.run_dir / "run.json")
        dump_config(self.dataflow, self.component_file("dataflow"))
        for policy, cfg in self.trainers.items():
            dump_config(cfg, self.component_file(f"trainer-{policy}"))
        for policy, ecfg in self.evals.items():
            dump_config(ecfg, self.component_file(f"eval-{policy}"))


def make_plan(config: RunConfig, *, port: int, base_dir: Path | None = None) -> Plan:
    """The plan for ``config`` with the dataflow on ``port``; relative paths resolve in
    ``base_dir`` (the config file's directory).

    Raises ``ConfigError`` naming every plug-in spec that does not resolve or validate
    (checked before anything is built or written)."""
    raise_problems(check_run(config), "run config")
    run_dir = config.run_dir.resolve()
    weights_root = run_dir / "weights"
    vocab = {name: p.vocab_size or _vocab_size(p.model) for name, p in config.policies.items()}
    rounds = sync_round_tasks(config)
    dataflow = _dataflow_config(config, run_dir, port, vocab, rounds)
    trainers = {
        name: _trainer_config(config, name, run_dir, weights_root, dataflow, base_dir, rounds)
        for name in config.trained
    }
    evals = {
        ev.policy: validate(
            EvalConfig,
            {
                **fields_of(ev, EvalSettings),
                "policy": ev.policy,
                "weights": str(weights_root),
                "generator": ev.generator,
                "workflow": workflow_spec(config, ev.workflow),
                "sets": [
                    {
                        **fields_of(s, ScoringSettings),
                        "name": s.name,
                        "generator": s.generator,
                        "workflow": workflow_spec(config, s.workflow or ev.workflow),
                    }
                    for s in ev.sets
                ],
                "out": str(run_dir / "eval" / f"{ev.policy}.jsonl"),
                "seed": config.seed,
            },
            source=f"eval {ev.policy}",
        )
        for ev in config.eval
    }
    return Plan(config, run_dir, dataflow, trainers, evals, weights_root, vocab, rounds)


def node_config(
    plan: Plan, pool: PoolSection, node_id: str | None = None, weights: str | None = None
) -> NodeConfig:
    """Config of one node of ``pool`` (a fresh id unless given)."""
    config = plan.config
    node_id = node_id or f"{pool.name}-{secrets.token_hex(3)}"
    used = {p for src in config.sources for p in src.policies}
    policies = {
        name: _hosted(section, _rollout(section.rollout, pool.policies.get(name)))
        for name, section in config.policies.items()
        if name in used
    }
    data: dict[str, Any] = {
        **dict(pool.node),
        "dataflow_url": plan.dataflow_url,
        "weights": weights or str(plan.weights_root),
        "policies": policies,
        "workflows": {w: workflow_spec(config, w) for w in workflow_names(config)},
        "tools": config.tools,
        "node_id": node_id,
        "pool": pool.name,
        "capacity": pool.capacity,
        "work_dir": str(plan.run_dir / "nodes" / node_id),
        "seed": config.seed,
        "grace_s": _grace(pool),
    }
    return validate(NodeConfig, data, source=f"pool {pool.name!r} node")


def node_stop_timeout(config: RunConfig) -> float:
    """How long a launcher waits for a stopping node before killing it: the longest grace of
    any pool's nodes, plus the time to close (so a graceful stop is never cut short)."""
    return max((_grace(p) for p in config.pools), default=NODE_GRACE_S) + NODE_CLOSE_S


def _grace(pool: PoolSection) -> float:
    """The pool's ``node.grace_s`` when set, else :data:`NODE_GRACE_S`."""
    return pool.node.grace_s if "grace_s" in pool.node.model_fields_set else NODE_GRACE_S


def _rollout(base: RolloutConfig, override: RolloutConfig | None) -> RolloutConfig:
    """A policy's rollout settings with the keys a pool gives replaced."""
    if override is None:
        return base
    return base.model_copy(update={k: getattr(override, k) for k in override.model_fields_set})


def _hosted(section: PolicySection, rollout: RolloutConfig) -> RolloutConfig:
    """A frozen policy's nodes load its model themselves: no trainer publishes weights."""
    if not section.frozen:
        return rollout
    update: dict[str, Any] = {"frozen": True}
    if rollout.model is None:
        update["model"] = section.model
    return rollout.model_copy(update=update)


def _dataflow_config(
    config: RunConfig, run_dir: Path, port: int, vocab: dict[str, int], rounds: int | None
) -> DataflowConfig:
    section = config.dataflow
    sync = config.mode == "sync"
    policies = {
        name: {
            **fields_of(p, PolicySettings),
            "vocab_size": vocab[name],
            "max_staleness": 0 if sync else p.max_staleness,
        }
        for name, p in config.policies.items()
    }
    regulation = RegulationConfig(
        **dict(section.regulation), mode=config.mode, sync_round_tasks=rounds
    )
    data = {
        "run_dir": str(run_dir / "dataflow"),
        "host": section.host,
        "port": port,
        "seed": config.seed,
        "policies": policies,
        "sources": config.sources,
        "selector": section.selector,
        "filters": section.filters,
        "sampler": section.sampler,
        "lease": section.lease,
        "regulation": regulation,
        "report": section.report,
        "dashboard": section.dashboard,
        # auth tokens are not written here: the launcher passes them in the environment
    }
    return validate(DataflowConfig, data, source="dataflow")


def sync_round_tasks(config: RunConfig) -> int | None:
    """Tasks per sync round, decided once for the dataflow and every trainer (None: async).

    ``sync_round_tasks`` when set, else enough tasks for one batch of EVERY trainer: the task
    selector spreads a round over the sources by weight, so a policy whose sources get a
    share ``w`` of it needs ``batch groups / w`` tasks; the round is the largest of these
    (one policy, or sources that feed every policy: its batch in groups; two policies with a
    source each: both batches)."""
    if config.mode != "sync":
        return None
    if config.sync_round_tasks is not None:
        return config.sync_round_tasks
    total = sum(s.weight for s in config.sources)
    need = 1
    for policy in config.trained:
        groups = config.policies[policy].trainer.batch.max_samples // _group_size(config, policy)
        share = sum(s.weight for s in config.sources if policy in s.policies) / total
        if share > 0:
            need = max(need, math.ceil(groups / share - 1e-9))
    return need


def _group_size(config: RunConfig, policy: str) -> int:
    """The largest group size of the sources that produce samples of ``policy``."""
    return max((s.group_size for s in config.sources if policy in s.policies), default=1)


def _trainer_config(
    config: RunConfig,
    name: str,
    run_dir: Path,
    weights_root: Path,
    dataflow: DataflowConfig,
    base_dir: Path | None,
    rounds: int | None,
) -> TrainerConfig:
    section = config.policies[name]
    data: dict[str, Any] = dict(section.trainer)
    data.update(
        policy=name,
        trainer_id=f"trainer-{name}",
        model=section.model,
        dataflow_url=f"http://{dataflow.host}:{dataflow.port}",
        weights=str(weights_root),
        weights_options=config.weights,
        run_dir=str(run_dir / "trainers" / name),
        seed=config.seed,
    )
    if rounds is not None:  # one round is one batch: the dataflow serves what it holds
        samples = rounds * _group_size(config, name)
        data["batch"] = section.trainer.batch.model_copy(
            update={"min_samples": 1, "max_samples": samples}
        )
    if section.warmup is not None:
        data["warmup"] = _warmup(section.warmup, run_dir / f"warmup-{name}.jsonl", base_dir)
    return validate(TrainerConfig, data, source=f"policies.{name}.trainer")


def _warmup(section: WarmupSection, out: Path, base_dir: Path | None) -> dict[str, Any]:
    if section.pairs is not None:
        path = Path(section.pairs)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file():
            raise ConfigError(f"warmup.pairs: file not found: {path}")
    else:
        path = out
        if not path.exists():
            _write_pairs(section.generator, path)
    return {
        **fields_of(section, WarmupSettings),
        "pairs": str(path),
    }


def _write_pairs(spec: PluginSpec | None, path: Path) -> None:
    from astraflow.workflows.tasks import GENERATORS

    assert spec is not None
    rows = GENERATORS.build(spec).rows()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    size = spec.kwargs.get("size")
    total = size if isinstance(size, int) else None  # per-episode generators make more rows
    with tmp.open("w") as f, track(f"warm-up data ({spec.type})", total=total) as bar:
        for row in rows:
            if "prompt" not in row or "completion" not in row:
                raise ConfigError(
                    f"warmup generator {spec.type!r} rows need 'prompt' and 'completion'"
                )
            f.write(json.dumps({"prompt": row["prompt"], "completion": row["completion"]}) + "\n")
            bar.advance()
    tmp.replace(path)


def _vocab_size(spec: ModelSpec) -> int:
    """The model's vocabulary size (token ids must stay below it)."""
    if spec.model_type is not None:
        if "vocab_size" in spec.config:
            return int(spec.config["vocab_size"])
        from astraflow.models import build_tokenizer

        return len(build_tokenizer(spec))
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {"trust_remote_code": spec.trust_remote_code}
    if spec.gguf_file:
        kwargs["gguf_file"] = spec.gguf_file
    try:
        return int(AutoConfig.from_pretrained(spec.name_or_path, **kwargs).vocab_size)
    except OSError as exc:
        raise ConfigError(f"cannot read the config of model {spec.name_or_path!r}: {exc}") from exc
