"""Progress of long operations: library code reports it, the CLI decides whether to show it.

    library:  with track("export", total=n) as bar: ... bar.advance()
    CLI:      with show_progress(): ...   (a rich bar on a terminal; nothing otherwise)

With no listener installed (a component under ``astraflow run``, a test, a log file), a
tracker costs a function call and shows nothing, so logs stay free of progress noise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["ProgressEvent", "Tracker", "listen", "track"]


@dataclass(frozen=True)
class ProgressEvent:
    """One change of an operation's progress."""

    key: int
    """Identity of the operation (unique in the process)."""
    description: str
    """What is running, e.g. ``"export policy v12"``."""
    completed: float
    """Units done so far."""
    total: float | None
    """Units in all (None: unknown)."""
    finished: bool = False
    """True once, when the operation ends."""


Listener = Callable[[ProgressEvent], None]

_lock = threading.Lock()
_listeners: list[Listener] = []
_keys = iter(range(1, 1 << 62))


class Tracker:
    """Handle of one tracked operation."""

    def __init__(self, description: str, total: float | None) -> None:
        with _lock:
            self.key = next(_keys)
        self.description = description
        self.total = total
        self.completed = 0.0

    def advance(self, amount: float = 1.0) -> None:
        """Count ``amount`` more units done."""
        self.completed += amount
        _emit(ProgressEvent(self.key, self.description, self.completed, self.total))

    def update(self, *, total: float | None = None, description: str | None = None) -> None:
        """Change the total or the description."""
        self.total = total if total is not None else self.total
        self.description = description or self.description
        _emit(ProgressEvent(self.key, self.description, self.completed, self.total))


def _emit(event: ProgressEvent) -> None:
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        listener(event)


@contextmanager
def track(description: str, total: float | None = None) -> Iterator[Tracker]:
    """Report the progress of the operation run inside the ``with`` block."""
    tracker = Tracker(description, total)
    _emit(ProgressEvent(tracker.key, description, 0.0, total))
    try:
        yield tracker
    finally:
        _emit(
            ProgressEvent(
                tracker.key, tracker.description, tracker.completed, tracker.total, finished=True
            )
        )


@contextmanager
def listen(listener: Listener) -> Iterator[None]:
    """Deliver every progress event to ``listener`` while the block runs."""
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)
