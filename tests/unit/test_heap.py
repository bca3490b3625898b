"""``freeze_heap``: start-up objects leave the garbage collector's walks; cycles made later
are still collected."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest

from astraflow.heap import freeze_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_objects_alive_at_start_up_are_frozen_and_later_cycles_still_collected(
    caplog: pytest.LogCaptureFixture,
) -> None:
    try:
        before = _Node()
        before.other = before  # a start-up cycle still referenced: frozen, not collected
        with caplog.at_level(logging.INFO, logger="astraflow.heap"):
            freeze_heap("test")
        frozen = gc.get_freeze_count()
        assert frozen > 1000, frozen
        assert "heap frozen component=test" in caplog.text
        # what a full collection walks now excludes the frozen objects
        assert len(gc.get_objects()) < frozen
        later = _Node()
        later.other = later
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None, "a cycle made after the freeze was not collected"
        assert before.other is before
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
