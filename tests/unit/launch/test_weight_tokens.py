"""The launcher hands each component only the weight-server tokens of its role, in the
environment; a weight server it starts is never open."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.launch.local import LocalRun
from fixtures.launch import reduced_quickstart


def _env(run: LocalRun, kind: str) -> dict[str, str]:
    return run._weight_token_env(kind)


def test_roles_get_only_their_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASTRAFLOW_WEIGHTS_READ_TOKEN", "r-1")
    monkeypatch.setenv("ASTRAFLOW_WEIGHTS_PUBLISH_TOKEN", "p-2")
    run = LocalRun(reduced_quickstart(tmp_path / "run", "serve_weights=true"))
    read, publish = "ASTRAFLOW_WEIGHTS_READ_TOKEN", "ASTRAFLOW_WEIGHTS_PUBLISH_TOKEN"
    assert _env(run, "weights") == {read: "r-1", publish: "p-2"}
    assert _env(run, "node") == {read: "r-1", publish: ""}  # blanked: not inherited either
    assert _env(run, "eval") == {read: "r-1", publish: ""}
    assert _env(run, "dataflow") == {read: "", publish: ""}
    assert _env(run, "trainer") == {read: "", publish: ""}


def test_fresh_tokens_when_none_are_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASTRAFLOW_WEIGHTS_READ_TOKEN", raising=False)
    monkeypatch.delenv("ASTRAFLOW_WEIGHTS_PUBLISH_TOKEN", raising=False)
    first = _env(LocalRun(reduced_quickstart(tmp_path / "a")), "weights")
    second = _env(LocalRun(reduced_quickstart(tmp_path / "b")), "weights")
    assert all(len(token) >= 24 for token in first.values())
    assert first != second and len(set(first.values())) == 2
    for path in (p for p in tmp_path.rglob("*") if p.is_file()):  # in memory and env only
        assert not any(token in path.read_text(errors="replace") for token in first.values())
