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
      eval/<policy>.jsonl   held-out accuracy per version
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow.config import dump_config, validate
from astraflow.dataflow.config import DataflowConfig
from astraflow.errors import ConfigError
from astraflow.evaluation.config import EvalConfig
from astraflow.launch.config import PoolSection, RunConfig, WarmupSection
from astraflow.models import ModelSpec
from astraflow.plugins import PluginSpec
from astraflow.raas.config import NodeConfig
from astraflow.trainer.config import TrainerConfig

__all__ = ["Plan", "make_plan", "node_config"]


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
    ``base_dir`` (the config file's directory)."""
    run_dir = config.run_dir.resolve()
    weights_root = run_dir / "weights"
    vocab = {name: p.vocab_size or _vocab_size(p.model) for name, p in config.policies.items()}
    dataflow = _dataflow_config(config, run_dir, port, vocab)
    trainers = {
        name: _trainer_config(config, name, run_dir, weights_root, dataflow, base_dir)
        for name in config.trained
    }
    evals = {
        ev.policy: validate(
            EvalConfig,
            {
                "policy": ev.policy,
                "weights": str(weights_root),
                "generator": ev.generator.model_dump(),
                "workflow": _workflow_spec(config, ev.workflow),
                "max_new_tokens": ev.max_new_tokens,
                "every_s": ev.every_s,
                "batch_size": ev.batch_size,
                "out": str(run_dir / "eval" / f"{ev.policy}.jsonl"),
                "seed": config.seed,
            },
            source=f"eval {ev.policy}",
        )
        for ev in config.eval
    }
    return Plan(config, run_dir, dataflow, trainers, evals, weights_root, vocab)


def node_config(
    plan: Plan, pool: PoolSection, node_id: str | None = None, weights: str | None = None
) -> NodeConfig:
    """Config of one node of ``pool`` (a fresh id unless given)."""
    config = plan.config
    node_id = node_id or f"{pool.name}-{secrets.token_hex(3)}"
    used = {p for src in config.sources for p in src.policies}
    policies = {
        name: {**config.policies[name].rollout, **pool.policies.get(name, {})}
        for name in config.policies
        if name in used
    }
    data: dict[str, Any] = {
        "dataflow_url": plan.dataflow_url,
        "weights": weights or str(plan.weights_root),
        "policies": policies,
        "workflows": {w: _workflow_spec(config, w) for w in _workflow_names(config)},
        "tools": config.tools,
        "node_id": node_id,
        "pool": pool.name,
        "capacity": pool.capacity,
        "work_dir": str(plan.run_dir / "nodes" / node_id),
        "seed": config.seed,
        **pool.node,
    }
    return validate(NodeConfig, data, source=f"pool {pool.name!r} node")


def _workflow_names(config: RunConfig) -> list[str]:
    return sorted({src.workflow for src in config.sources} | set(config.workflows))


def _workflow_spec(config: RunConfig, name: str) -> dict[str, Any]:
    spec = dict(config.workflows.get(name, {}))
    spec.setdefault("type", name)
    return spec


def _dataflow_config(
    config: RunConfig, run_dir: Path, port: int, vocab: dict[str, int]
) -> DataflowConfig:
    section = config.dataflow
    sync = config.mode == "sync"
    policies = {
        name: {
            "vocab_size": vocab[name],
            "max_staleness": 0 if sync else p.max_staleness,
            "max_buffered": p.max_buffered,
        }
        for name, p in config.policies.items()
    }
    regulation = section.regulation.model_dump()
    if sync:
        regulation["mode"] = "sync"
        regulation["sync_round_tasks"] = config.sync_round_tasks or _round_tasks(config)
    data = {
        "run_dir": str(run_dir / "dataflow"),
        "host": section.host,
        "port": port,
        "seed": config.seed,
        "policies": policies,
        "sources": [s.model_dump(mode="json") for s in config.sources],
        "selector": _plugin(section.selector),
        "filters": [_plugin(f) for f in section.filters],
        "sampler": _plugin(section.sampler),
        "lease": section.lease.model_dump(),
        "regulation": regulation,
        "report": section.report.model_dump(),
        # auth tokens are not written here: the launcher passes them in the environment
    }
    return validate(DataflowConfig, data, source="dataflow")


def _round_tasks(config: RunConfig) -> int:
    """Tasks per sync round: the first trained policy's batch size in groups."""
    first = config.policies[config.trained[0]]
    samples = int(first.trainer.get("batch", {}).get("max_samples", 256))
    group = max(s.group_size for s in config.sources if config.trained[0] in s.policies)
    return max(1, samples // group)


def _plugin(spec: Any) -> Any:
    return spec.model_dump() if isinstance(spec, PluginSpec) else spec


def _trainer_config(
    config: RunConfig,
    name: str,
    run_dir: Path,
    weights_root: Path,
    dataflow: DataflowConfig,
    base_dir: Path | None,
) -> TrainerConfig:
    section = config.policies[name]
    data: dict[str, Any] = dict(section.trainer)
    data.update(
        policy=name,
        trainer_id=f"trainer-{name}",
        model=section.model.model_dump(),
        dataflow_url=f"http://{dataflow.host}:{dataflow.port}",
        weights=str(weights_root),
        weights_options=dict(config.weights),
        run_dir=str(run_dir / "trainers" / name),
        seed=config.seed,
    )
    if config.mode == "sync":
        samples = (config.sync_round_tasks or _round_tasks(config)) * max(
            s.group_size for s in config.sources if name in s.policies
        )
        batch = dict(data.get("batch", {}))
        batch.update(min_samples=1, max_samples=max(samples, batch.get("max_samples", 1)))
        data["batch"] = batch
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
        "pairs": str(path),
        "steps": section.steps,
        "lr": section.lr,
        "batch_size": section.batch_size,
    }


def _write_pairs(spec: PluginSpec | None, path: Path) -> None:
    from astraflow.workflows.tasks import GENERATORS

    assert spec is not None
    rows = GENERATORS.build(spec).rows()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for row in rows:
            if "prompt" not in row or "completion" not in row:
                raise ConfigError(
                    f"warmup generator {spec.type!r} rows need 'prompt' and 'completion'"
                )
            f.write(json.dumps({"prompt": row["prompt"], "completion": row["completion"]}) + "\n")
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
