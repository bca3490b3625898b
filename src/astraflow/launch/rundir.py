"""A finished (or running) run's directory, read back for ``astraflow eval`` and ``export``.

    <run_dir>/run.json                  policies of the run
    <run_dir>/components/eval-<p>.json  the evaluator config the run used for policy p
    <run_dir>/weights/<p>/v<N>/         published versions

Every lookup checks its input first and names what is missing (the directory, the policy,
the version), so a mistyped argument never writes anything.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from astraflow.config import apply_overrides, read_yaml, validate
from astraflow.errors import ConfigError, NotFoundError
from astraflow.evaluation.config import EvalConfig
from astraflow.weights.files import StoreFiles

__all__ = ["RunDir"]


class RunDir:
    """The run in ``path``: its policies, published versions and evaluator configs."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).resolve()
        if not self.path.is_dir():
            raise NotFoundError(f"run directory {self.path} does not exist")
        run_json = self.path / "run.json"
        if not run_json.is_file():
            raise NotFoundError(f"{self.path} is not an astraflow run directory (no run.json)")
        try:
            data: Any = json.loads(run_json.read_text())
            self.policies: list[str] = list(data["policies"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{run_json}: not a run config ({exc})") from exc
        self.weights = self.path / "weights"

    def policy(self, name: str | None) -> str:
        """``name`` checked against the run's policies (None: the run's only policy)."""
        if name is None:
            if len(self.policies) != 1:
                raise ConfigError(
                    f"run {self.path} has policies {self.policies}: choose one with --policy"
                )
            return self.policies[0]
        if name not in self.policies:
            raise NotFoundError(
                f"run {self.path} has no policy {name!r} (policies: {', '.join(self.policies)})"
            )
        return name

    def versions(self, policy: str) -> list[int]:
        """Versions of ``policy`` kept in the run's weight store, oldest first."""
        if not self.weights.is_dir():
            return []
        return StoreFiles(self.weights, create=False).versions(policy)

    def version(self, policy: str, version: int | None) -> int:
        """``version`` checked against the store (None: the newest)."""
        kept = self.versions(policy)
        if not kept:
            raise NotFoundError(f"run {self.path}: policy {policy!r} has no published version")
        if version is None:
            return kept[-1]
        if version not in kept:
            raise NotFoundError(
                f"run {self.path}: policy {policy!r} has no version {version} in its weight "
                f"store (kept: {_span(kept)})"
            )
        return version

    def evaluated(self) -> list[str]:
        """Policies the run evaluated (those with an evaluator config)."""
        return sorted(
            p.name.removeprefix("eval-").removesuffix(".json")
            for p in (self.path / "components").glob("eval-*.json")
        )

    def eval_config(self, policy: str, overrides: Sequence[str] = ()) -> EvalConfig:
        """The run's evaluator config of ``policy``, re-rooted in this directory, with
        ``--set`` overrides applied."""
        path = self.path / "components" / f"eval-{policy}.json"
        if not path.is_file():
            raise NotFoundError(
                f"run {self.path} has no evaluation of policy {policy!r} (evaluated: "
                f"{', '.join(self.evaluated()) or 'none'}); add an 'eval' entry to the run config"
            )
        data = read_yaml(path)
        data |= {"weights": str(self.weights), "out": str(self.path / "eval" / f"{policy}.jsonl")}
        return validate(EvalConfig, apply_overrides(data, overrides), source=str(path))


def _span(versions: list[int]) -> str:
    if len(versions) <= 6:
        return ", ".join(map(str, versions))
    return f"{len(versions)} versions, {versions[0]} .. {versions[-1]}"
