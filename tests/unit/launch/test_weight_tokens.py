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


def test_dashboard_link_and_its_read_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from astraflow.cli.progress import RunView

    for role in ("NODE", "TRAINER", "ADMIN", "READ"):
        monkeypatch.delenv(f"ASTRAFLOW_{role}_TOKEN", raising=False)
    open_run = LocalRun(reduced_quickstart(tmp_path / "open"))
    url, token = open_run.dashboard_link() or ("", "")
    assert url.startswith("http://127.0.0.1:") and url.endswith("/dashboard") and token is None
    run = LocalRun(reduced_quickstart(tmp_path / "auth", "dataflow.auth.admin=admin-tok-5"))
    url, token = run.dashboard_link() or ("", "")
    assert token is not None and len(token) >= 24  # fresh for this run: tokens but no read one
    assert run._tokens()["read"] == token  # the dataflow gets it in its environment
    assert token not in run.plan.dataflow.model_dump_json()  # never in its config file
    RunView(run.config).dashboard((url, token))  # not a terminal: the bare address only
    printed = capsys.readouterr().out
    assert url in printed and token not in printed
    off = LocalRun(reduced_quickstart(tmp_path / "off", "dataflow.dashboard.enabled=false"))
    assert off.dashboard_link() is None
