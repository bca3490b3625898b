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
