"""What a running job looks like right now: one snapshot for the live view and the summary.

Built from what the components already publish: the dataflow report (rates, buffers,
trainer waiting), each trainer's ``metrics.jsonl`` and each evaluator's JSONL file (read
incrementally), and the launcher's own process table.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow.dataflow.client import DataflowClient
from astraflow.errors import AstraflowError
from astraflow.records import DataflowReport

__all__ = ["JsonlTail", "PolicyStatus", "RunStatus", "StatusCollector"]


class JsonlTail:
    """Reads the lines appended to a JSONL file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def skip(self) -> None:
        """Skip what the file holds now (read only what is appended from here on)."""
        try:
            self._offset = self.path.stat().st_size
        except FileNotFoundError:
            self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        """New complete records (a half-written last line waits for the next call)."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return out


@dataclass
class PolicyStatus:
    """One policy's progress."""

    version: int = -1
    steps_logged: int = 0
    reward: float | None = None
    """Mean sampled reward of the latest trainer step."""
    eval_accuracy: float | None = None
    eval_version: int | None = None
    first_eval: float | None = None
    """Accuracy of the first evaluated version (the warm-up model)."""
    tokens_per_s: float | None = None
    waiting: float | None = None
    """Fraction of time the trainer waited for batches (dataflow report window)."""
    buffered: int = 0


@dataclass
class RunStatus:
    """A snapshot of the whole run."""

    elapsed_s: float
    report: DataflowReport | None
    policies: dict[str, PolicyStatus]
    pools: dict[str, tuple[int, float]]
    """Per pool: nodes running, samples/s produced."""
    processes: dict[str, bool] = field(default_factory=dict)
    """Component name → alive."""

    def summary(self) -> dict[str, Any]:
        """The figures written to ``summary.json`` at the end of a run."""
        return {
            "policies": {
                name: {
                    "version": p.version,
                    "reward": p.reward,
                    "eval_accuracy": p.eval_accuracy,
                    "first_eval_accuracy": p.first_eval,
                    "eval_version": p.eval_version,
                }
                for name, p in self.policies.items()
            },
            "pools": {
                name: {"nodes": n, "samples_per_s": r} for name, (n, r) in self.pools.items()
            },
        }


class StatusCollector:
    """Keeps per-file read positions between snapshots."""

    def __init__(self, client: DataflowClient, run_dir: Path, policies: list[str]) -> None:
        self.client = client
        self.run_dir = run_dir
        self.policies = {name: PolicyStatus() for name in policies}
        self._metrics = {n: JsonlTail(run_dir / "trainers" / n / "metrics.jsonl") for n in policies}
        self._evals = {n: JsonlTail(run_dir / "eval" / f"{n}.jsonl") for n in policies}
        self.started = time.monotonic()
        self._last_report: DataflowReport | None = None

    def collect(
        self, pools: dict[str, int], processes: dict[str, bool], *, ask: bool = True
    ) -> RunStatus:
        """A fresh snapshot (the report is None while the service does not answer; ``ask``
        False: the service is stopped, the last report it gave stands)."""
        report: DataflowReport | None = None
        if ask:
            try:
                report = self.client.report()
            except AstraflowError:
                report = None
        known = report or self._last_report
        self._last_report = known
        for name, st in self.policies.items():
            for rec in self._metrics[name].read():
                st.steps_logged += 1
                st.version = int(rec.get("version", st.version))
                st.reward = rec.get("reward_mean", st.reward)
                st.tokens_per_s = rec.get("tokens_per_s", st.tokens_per_s)
            for rec in self._evals[name].read():
                st.eval_accuracy = rec.get("accuracy")
                st.eval_version = rec.get("version")
                if st.first_eval is None:
                    st.first_eval = st.eval_accuracy
            if known is not None:
                self._from_report(name, st, known)
        rates = {}
        for pool, nodes in pools.items():
            rate = known.pools[pool].samples_per_s if known and pool in known.pools else 0.0
            rates[pool] = (nodes, rate)
        return RunStatus(time.monotonic() - self.started, report, self.policies, rates, processes)

    @staticmethod
    def _from_report(name: str, st: PolicyStatus, report: DataflowReport) -> None:
        pol = report.policies.get(name)
        if pol is not None:
            st.buffered = pol.buffered_samples
            if pol.latest_version is not None:
                st.version = max(st.version, pol.latest_version)
        waits = [t.waiting_fraction for t in report.trainers.values() if t.policy == name]
        if waits:
            st.waiting = max(waits)
