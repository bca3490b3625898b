"""Progress bars of long operations (``astraflow.progress``) on a terminal; silent otherwise."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from astraflow.progress import ProgressEvent, listen

__all__ = ["show_progress"]


class _Bars:
    """Turns progress events into rich tasks (one bar per tracked operation)."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: dict[int, TaskID] = {}
        self.lock = threading.Lock()

    def __call__(self, event: ProgressEvent) -> None:
        with self.lock:
            task = self.tasks.get(event.key)
            if task is None:
                task = self.progress.add_task(event.description, total=event.total)
                self.tasks[event.key] = task
            self.progress.update(
                task, description=event.description, completed=event.completed, total=event.total
            )
            if event.finished:
                self.progress.stop_task(task)
                del self.tasks[event.key]


@contextmanager
def show_progress(console: Console | None = None) -> Iterator[bool]:
    """Show tracked operations as bars while the block runs, when stdout is a terminal.

    Yields whether bars are shown (False: not a terminal, nothing is printed)."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield False
        return
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
    with progress, listen(_Bars(progress)):
        yield True
