"""Task sources: JSONL / Parquet files, Hugging Face ``datasets`` and registered generators.

Each row becomes tasks with a stable id ``<source>/<row_id>@e<epoch>`` (row id from the
configured id field, else the row index); the row is the task payload, and ``meta`` carries
``row_id``, ``index`` and ``epoch``. The :class:`Catalog` is what a ``TaskSelector`` reads.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from astraflow.config import read_jsonl
from astraflow.data_algorithms.protocols import SourceView, TaskRef
from astraflow.dataflow.config import SourceConfig
from astraflow.errors import ConfigError
from astraflow.records import Task

__all__ = ["Catalog", "TaskSource", "load_source"]

log = logging.getLogger(__name__)

#: Rows taken from a generator source that sets no ``limit``.
DEFAULT_GENERATOR_ROWS = 10_000


class TaskSource:
    """Rows of one source with their stable ids."""

    def __init__(self, config: SourceConfig, rows: Sequence[Mapping[str, Any]]) -> None:
        self.config = config
        self.name = config.name
        self._rows = rows
        self.ids = self._ids(rows)
        self.index_of = {rid: i for i, rid in enumerate(self.ids)}
        if len(self.index_of) != len(self.ids):
            dupes = sorted(r for r, n in Counter(self.ids).items() if n > 1)
            raise ConfigError(
                f"source {self.name!r}: id field {config.id_field!r} repeats ids "
                f"{', '.join(dupes[:5])}"
            )
        if rows:
            _check_json(self.name, self.row(0))

    def _ids(self, rows: Sequence[Mapping[str, Any]]) -> list[str]:
        field = self.config.id_field
        if field is None:
            return [str(i) for i in range(len(rows))]
        ids = []
        for i in range(len(rows)):
            row = rows[i]
            if field not in row or row[field] is None:
                raise ConfigError(f"source {self.name!r}: row {i} has no id field {field!r}")
            ids.append(str(row[field]))
        return ids

    def __len__(self) -> int:
        return len(self.ids)

    def row(self, index: int) -> dict[str, Any]:
        """The payload of row ``index``."""
        return dict(self._rows[index])

    def task(self, ref: TaskRef) -> Task:
        """The task for a selector's choice (attempt 0)."""
        row_id = self.ids[ref.index]
        return Task(
            task_id=f"{self.name}/{row_id}@e{ref.epoch}",
            workflow=self.config.workflow,
            payload=self.row(ref.index),
            group_size=self.config.group_size,
            source=self.name,
            meta={"row_id": row_id, "index": ref.index, "epoch": ref.epoch},
        )


def _check_json(name: str, row: Mapping[str, Any]) -> None:
    for key, value in row.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"source {name!r}: field {key!r} is not JSON-serialisable ({exc}); "
                "task payloads travel as JSON"
            ) from exc


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read parquet: {exc}") from exc
    rows: list[dict[str, Any]] = table.to_pylist()
    return rows


_SAVED_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")


def _load_hf(config: SourceConfig) -> Any:
    import datasets

    path = config.path
    if path is None:
        raise ConfigError(
            f"source {config.name!r}: type hf needs 'path' (or a datasets object from Python)"
        )
    try:
        saved = Path(path)
        if saved.is_dir() and any((saved / f).exists() for f in _SAVED_MARKERS):
            ds = datasets.load_from_disk(path)
            return ds[config.split] if isinstance(ds, datasets.DatasetDict) else ds
        return datasets.load_dataset(path, config.hf_config, split=config.split)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"source {config.name!r}: cannot load dataset {path!r}: {exc}") from exc


def _generate(config: SourceConfig, seed: int) -> list[dict[str, Any]]:
    try:
        from astraflow.workflows.tasks import GENERATORS  # type: ignore[import-not-found,unused-ignore]  # written by the workflows component
    except ImportError as exc:
        raise ConfigError(
            f"source {config.name!r}: generator sources need astraflow.workflows.tasks: {exc}"
        ) from exc
    assert config.generator is not None
    gen = GENERATORS.build(config.generator, seed=seed)
    rows: Iterable[dict[str, Any]] = gen.rows()
    return [dict(r) for r in itertools.islice(rows, config.limit or DEFAULT_GENERATOR_ROWS)]


def load_source(config: SourceConfig, *, dataset: Any = None, seed: int = 0) -> TaskSource:
    """Load one source; ``dataset`` (a ``datasets.Dataset`` or a list of rows) overrides path."""
    rows: Sequence[Mapping[str, Any]]
    if dataset is not None:
        rows = dataset
    elif config.type == "jsonl":
        rows = [row for _, row in read_jsonl(_existing(config))]
    elif config.type == "parquet":
        rows = _read_parquet(_existing(config))
    elif config.type == "hf":
        rows = _load_hf(config)
    else:
        rows = _generate(config, seed)
    if config.type == "generator" and config.id_field is None and rows and "id" in rows[0]:
        config = config.model_copy(update={"id_field": "id"})
    if config.limit is not None and len(rows) > config.limit:
        rows = rows.select(range(config.limit)) if hasattr(rows, "select") else rows[: config.limit]
    source = TaskSource(config, rows)
    log.info("task source loaded source=%s type=%s rows=%d", config.name, config.type, len(source))
    return source


def _existing(config: SourceConfig) -> Path:
    assert config.path is not None
    path = Path(config.path)
    if not path.is_file():
        raise ConfigError(f"source {config.name!r}: file not found: {path}")
    return path


class Catalog:
    """The sources, as a ``TaskCatalog`` a selector reads (with per-call eligibility)."""

    def __init__(self, sources: Sequence[TaskSource], eligible: frozenset[str] | None = None):
        self._sources = {s.name: s for s in sources}
        names = frozenset(self._sources) if eligible is None else eligible
        self._views = {
            s.name: SourceView(
                name=s.name,
                size=len(s),
                epochs=s.config.epochs,
                weight=s.config.weight,
                eligible=s.name in names,
            )
            for s in sources
        }

    def restrict(self, eligible: Iterable[str]) -> Catalog:
        """The same sources, with only ``eligible`` ones open to selection."""
        return Catalog(list(self._sources.values()), frozenset(eligible))

    @property
    def sources(self) -> Mapping[str, SourceView]:
        """Every source by name, in config order."""
        return self._views

    def source(self, name: str) -> TaskSource:
        """The loaded source ``name``."""
        return self._sources[name]

    def row(self, source: str, index: int) -> Mapping[str, Any]:
        """Row ``index`` of ``source``."""
        return self._sources[source].row(index)

    def row_id(self, source: str, index: int) -> str:
        """Stable id of row ``index`` of ``source``."""
        return self._sources[source].ids[index]

    def task(self, ref: TaskRef) -> Task:
        """The task for a selector's choice."""
        return self._sources[ref.source].task(ref)
