"""Progress of long operations: events reach listeners; nothing is shown without a terminal."""

from __future__ import annotations

import io

from rich.console import Console

from astraflow.cli.bars import show_progress
from astraflow.progress import ProgressEvent, listen, track


def test_tracked_operations_reach_listeners_only_while_listening() -> None:
    seen: list[ProgressEvent] = []
    with listen(seen.append), track("export policy v3", total=3) as bar:
        bar.advance()
        bar.advance(2)
    with track("unheard", total=1) as bar:  # no listener: a no-op
        bar.advance()
    assert [(e.completed, e.total, e.finished) for e in seen] == [
        (0.0, 3, False), (1.0, 3, False), (3.0, 3, False), (3.0, 3, True),
    ]  # fmt: skip
    assert {e.description for e in seen} == {"export policy v3"}


def test_bars_stay_silent_when_not_a_terminal() -> None:
    out = io.StringIO()
    with show_progress(Console(file=out, force_terminal=False)) as shown, track("x", 10) as bar:
        bar.advance(10)
    assert shown is False and out.getvalue() == ""


def test_bars_render_on_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with show_progress(console) as shown, track("warm-up", total=10) as bar:
        bar.advance(10)
    assert shown is True and "warm-up" in out.getvalue() and "10/10" in out.getvalue()


def test_run_status_lines_are_never_wrapped_in_a_log() -> None:
    """Without a terminal ``astraflow run`` prints a plain status line every 10 s: one line each,
    however many policies and pools (rich would wrap them at 80 columns)."""
    from types import SimpleNamespace

    from astraflow.cli.progress import RunView
    from astraflow.launch.status import PolicyStatus, RunStatus

    out = io.StringIO()
    config = SimpleNamespace(run_dir="/runs/a-run-directory-with-a-long-name/" + "x" * 60)
    policies = {f"policy-{i}": PolicyStatus(version=100 + i, reward=0.5, eval_accuracy=0.25,
                                            waiting=0.1) for i in range(3)}  # fmt: skip
    status = RunStatus(elapsed_s=42.0, report=None, policies=policies,
                       pools={"local": (1, 1500.0), "remote30": (2, 99.5)})  # fmt: skip
    with RunView(config, plain_every_s=0.0, console=Console(file=out, width=80)) as view:
        view.update(status)
        view.update(status)
        view.final(SimpleNamespace(status=status, reason="finished", elapsed_s=180.0,
                                   run_dir=config.run_dir, failed=[]))  # fmt: skip
    lines = out.getvalue().splitlines()
    status_lines = [line for line in lines if line.startswith("[    42s]")]
    assert len(status_lines) == 3 and all(len(line) > 80 for line in status_lines)
    for line in status_lines:  # every policy and pool on the one line
        assert "policy-2: v102" in line and line.endswith("pool remote30: 2 nodes 99.5 samples/s")
    assert any(line.startswith("run finished after 180s; outputs in /runs/") and
               line.endswith("x" * 60) for line in lines)  # fmt: skip
