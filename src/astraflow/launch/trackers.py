"""Experiment trackers a run logs to: TensorBoard, Weights & Biases, MLflow (the ``logging``
section of a run config), each through its own library, imported only when enabled.

    Tracker.params(run config, resolved config)        once, at start
    Tracker.log(figures, step=policy version, wall_time) every forwarded group of figures
    Tracker.close()                                     at the end of the run

A tracker that fails to start or to log is dropped with a warning (``launch.telemetry``):
trackers never stop a run.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import Field, model_validator

from astraflow.config import ConfigModel

__all__ = [
    "LoggingSection",
    "MlflowSettings",
    "TensorBoardSettings",
    "Tracker",
    "WandbSettings",
    "build_trackers",
]

log = logging.getLogger(__name__)


def _enabled_shorthand(value: Any) -> Any:
    """``tensorboard: true`` means ``tensorboard: {enabled: true}``."""
    return {"enabled": value} if isinstance(value, bool) else value


class _TrackerSettings(ConfigModel):
    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return _enabled_shorthand(value)


class TensorBoardSettings(_TrackerSettings):
    """TensorBoard event files (``tensorboard --logdir RUN_DIR/tensorboard``)."""

    enabled: bool = False
    """Write TensorBoard event files."""
    dir: Path | None = None
    """Event file directory (default: ``<run_dir>/tensorboard/run``)."""


class WandbSettings(_TrackerSettings):
    """Weights & Biases; ``offline`` (the default) needs no network or account."""

    enabled: bool = False
    """Log to a W&B run."""
    project: str = "astraflow"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); None: the account's default."""
    name: str | None = None
    """Run name (default: the run directory's name)."""
    mode: Literal["offline", "online"] = "offline"
    """``offline`` writes ``<dir>/wandb/offline-run-*`` (``wandb sync`` uploads it later)."""
    dir: Path | None = None
    """Directory the ``wandb/`` folder goes in (default: the run directory)."""


class MlflowSettings(_TrackerSettings):
    """MLflow; by default a local file store under the run directory."""

    enabled: bool = False
    """Log to an MLflow run."""
    tracking_uri: str | None = None
    """Tracking server or store (default: ``file:<run_dir>/mlruns``)."""
    experiment: str = "astraflow"
    """Experiment name (created when missing)."""
    run_name: str | None = None
    """Run name (default: the run directory's name)."""


class LoggingSection(ConfigModel):
    """Experiment trackers: every figure of the run, stepped by policy version and wall time."""

    tensorboard: TensorBoardSettings = Field(default_factory=TensorBoardSettings)
    """TensorBoard event files."""
    wandb: WandbSettings = Field(default_factory=WandbSettings)
    """Weights & Biases (offline by default)."""
    mlflow: MlflowSettings = Field(default_factory=MlflowSettings)
    """MLflow (a local file store by default)."""
    report_every_s: float = Field(default=5.0, gt=0)
    """Seconds between two dataflow-report figures sent to the trackers."""

    @property
    def any(self) -> bool:
        """Whether any tracker is enabled."""
        return self.tensorboard.enabled or self.wandb.enabled or self.mlflow.enabled


class Tracker(Protocol):
    """One experiment tracker."""

    name: str

    def params(self, run: dict[str, Any], resolved: dict[str, Any]) -> None:
        """Log the run config (as given) and the resolved config as the run's parameters."""

    def log(self, figures: dict[str, float], step: int, wall_time: float) -> None:
        """Log figures measured at policy version ``step`` and ``wall_time`` (epoch seconds)."""

    def close(self) -> None:
        """Flush and finish the run."""


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """Nested config → ``{"a.b.c": "value"}`` (lists by index)."""
    if isinstance(data, dict):
        items = list(data.items())
    elif isinstance(data, list):
        items = list(enumerate(data))
    else:
        return {prefix: json.dumps(data) if not isinstance(data, str) else data}
    out: dict[str, str] = {}
    for key, value in items:
        out |= flatten(value, f"{prefix}.{key}" if prefix else str(key))
    return out


class TensorBoardTracker:
    """Scalars via ``torch.utils.tensorboard.SummaryWriter``; configs as text."""

    name = "tensorboard"

    def __init__(self, settings: TensorBoardSettings, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = settings.dir or run_dir / "tensorboard" / "run"
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def params(self, run: dict[str, Any], resolved: dict[str, Any]) -> None:
        for tag, config in (("config/run", run), ("config/resolved", resolved)):
            text = json.dumps(config, indent=2).replace("\n", "\n    ")
            self.writer.add_text(tag, "    " + text, global_step=0)
        self.writer.flush()

    def log(self, figures: dict[str, float], step: int, wall_time: float) -> None:
        for tag, value in figures.items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=wall_time)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run; each row carries ``version`` (the x axis of every figure) and ``wall_time``."""

    name = "wandb"

    def __init__(self, settings: WandbSettings, run_dir: Path) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        root = settings.dir or run_dir
        root.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=settings.project, entity=settings.entity,
            name=settings.name or run_dir.name, dir=str(root), mode=settings.mode,
        )  # fmt: skip
        self.run.define_metric("version")
        self.run.define_metric("wall_time")
        for prefix in ("trainer", "eval", "dataflow"):
            self.run.define_metric(f"{prefix}/*", step_metric="version")

    def params(self, run: dict[str, Any], resolved: dict[str, Any]) -> None:
        config = {"run": run, "resolved": resolved}
        self.run.config.update(config, allow_val_change=True)  # type: ignore[no-untyped-call]  # wandb leaves it unannotated

    def log(self, figures: dict[str, float], step: int, wall_time: float) -> None:
        self.run.log({**figures, "version": step, "wall_time": wall_time})

    def close(self) -> None:
        self.run.finish()


#: Characters MLflow accepts in a metric or parameter name (others become '_').
_MLFLOW_NAME = re.compile(r"[^A-Za-z0-9_\-. /]")


class MlflowTracker:
    """An MLflow run through ``MlflowClient`` (no global active run)."""

    name = "mlflow"

    def __init__(self, settings: MlflowSettings, run_dir: Path) -> None:
        uri = settings.tracking_uri
        if uri is None:  # the local file store: MLflow asks for an explicit opt-in since 3.x
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(settings.experiment)
        experiment = (
            found.experiment_id if found else self.client.create_experiment(settings.experiment)
        )
        run = self.client.create_run(experiment, run_name=settings.run_name or run_dir.name)
        self.run_id: str = run.info.run_id

    def params(self, run: dict[str, Any], resolved: dict[str, Any]) -> None:
        from mlflow.entities import Param

        flat = {_MLFLOW_NAME.sub("_", k): v[:6000] for k, v in flatten(resolved).items()}
        params = [Param(k, v) for k, v in sorted(flat.items())]
        for i in range(0, len(params), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_dict(self.run_id, run, "config/run.json")
        self.client.log_dict(self.run_id, resolved, "config/resolved.json")

    def log(self, figures: dict[str, float], step: int, wall_time: float) -> None:
        from mlflow.entities import Metric

        ms = int(wall_time * 1000)
        metrics = [Metric(_MLFLOW_NAME.sub("_", k), v, ms, step) for k, v in figures.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def build_trackers(settings: LoggingSection, run_dir: Path) -> list[Tracker]:
    """The enabled trackers; one that cannot start is skipped with a warning."""
    wanted: list[tuple[str, Any]] = [
        ("tensorboard", lambda: TensorBoardTracker(settings.tensorboard, run_dir)),
        ("wandb", lambda: WandbTracker(settings.wandb, run_dir)),
        ("mlflow", lambda: MlflowTracker(settings.mlflow, run_dir)),
    ]
    out: list[Tracker] = []
    for name, make in wanted:
        if not getattr(settings, name).enabled:
            continue
        try:
            out.append(make())
        except Exception as exc:  # the boundary of an optional tracker: the run goes on
            log.warning("tracker %s could not start, logging to it is off: %s: %s",
                        name, type(exc).__name__, exc)  # fmt: skip
    return out
