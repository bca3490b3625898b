"""Per-step metrics: a JSONL file in the run directory, plus TensorBoard / W&B when installed.

Every sink gets the same flat ``{name: float}`` record per version (``version``, ``time`` and
the step's figures); the CLI adds a rich progress line (library code never prints).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

from astraflow.trainer.config import MetricsConfig

__all__ = ["JsonlSink", "MetricsSink", "build_sinks", "drop_unpublished_metrics"]

log = logging.getLogger(__name__)


@runtime_checkable
class MetricsSink(Protocol):
    """Receives one record per published version."""

    def write(self, record: dict[str, float]) -> None:
        """Record the metrics of one step."""
        ...

    def close(self) -> None:
        """Flush and release."""
        ...


class JsonlSink:
    """Appends one JSON object per step to ``<run_dir>/metrics.jsonl`` (flushed each line)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, float]) -> None:
        """Append a line; non-finite values become null (JSON has no NaN)."""
        clean = {k: (v if math.isfinite(v) else None) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _TensorBoardSink:
    def __init__(self, logdir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(logdir))

    def write(self, record: dict[str, float]) -> None:
        step = int(record.get("version", 0))
        for key, value in record.items():
            if key != "version":
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _WandbSink:
    def __init__(self, project: str, config: dict[str, Any]) -> None:
        import importlib

        wandb: Any = importlib.import_module("wandb")  # optional, untyped
        self._run = wandb.init(project=project, config=config)

    def write(self, record: dict[str, float]) -> None:
        self._run.log(record, step=int(record.get("version", 0)))

    def close(self) -> None:
        self._run.finish()


def drop_unpublished_metrics(path: Path, floor: int) -> int:
    """Drop the lines of ``path`` (``metrics.jsonl``) whose version is above ``floor``, the
    newest version the store or the dataflow knows, and any torn line; return how many.

    A step's line is written while its version is still being published in the background,
    so a crash can leave the line of a version that was never published. The restarted
    trainer trains that version number again: without this, its line would repeat.
    """
    if not path.exists():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)

    def kept(line: str) -> bool:
        try:
            return int(json.loads(line)["version"]) <= floor
        except (ValueError, KeyError, TypeError):  # torn by the crash, or not a step's line
            return False

    keep = [line for line in lines if line.strip() and kept(line)]
    dropped = sum(1 for line in lines if line.strip()) - len(keep)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(x if x.endswith("\n") else x + "\n" for x in keep),
                       encoding="utf-8")  # fmt: skip
        os.replace(tmp, path)
        log.warning(
            "dropped %d line(s) of %s: versions above %d were never published (a crash)",
            dropped, path, floor,
        )  # fmt: skip
    return dropped


def build_sinks(
    run_dir: Path, config: MetricsConfig, run_config: dict[str, Any]
) -> list[MetricsSink]:
    """The JSONL sink, plus TensorBoard / W&B when asked for and importable."""
    sinks: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl")]
    if config.tensorboard:
        try:
            sinks.append(_TensorBoardSink(run_dir / "tensorboard"))
        except ImportError:
            log.warning("metrics.tensorboard is set but tensorboard is not installed: skipped")
    if config.wandb_project:
        try:
            sinks.append(_WandbSink(config.wandb_project, run_config))
        except ImportError:
            log.warning("metrics.wandb_project is set but wandb is not installed: skipped")
    return sinks
