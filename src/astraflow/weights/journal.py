"""What a pull changed in place, kept so that a failed pull takes every change back exactly.

A delta is a wrapped integer difference per changed element, so subtracting what was added
restores the old bits: the journal of a ``joint``, ``sparse`` or ``dense`` change is the
change itself (no copy of the tensor). Only a ``raw`` change (the whole tensor replaced) keeps
a copy of the old contents. Undoing runs newest first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from astraflow.weights import delta as codec
from astraflow.weights import kernels
from astraflow.weights.tensors import apply_delta, bits

__all__ = ["Journal"]


class Journal:
    """Changes made in place to tensors, undone by :meth:`undo` (all of them, newest first)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], object]] = []

    def __len__(self) -> int:
        return len(self._undo)

    def apply(
        self,
        t: torch.Tensor,
        *,
        prepared: kernels.Prepared | None = None,
        change: codec.TensorDelta | None = None,
    ) -> None:
        """Change ``t`` in place by a ``prepared`` change (``kernels.prepare``; a contiguous
        CPU tensor) or a decoded ``change`` (any device)."""
        if prepared is not None:
            if prepared.encoding == "same":
                return
            flat = bits(t)
            if prepared.encoding == "raw":
                old = flat.copy()
                kernels.apply_prepared(prepared, flat)
                self._undo.append(functools.partial(np.copyto, flat, old))
                return
            kernels.apply_prepared(prepared, flat)
            undo = functools.partial(kernels.apply_prepared, prepared, flat, undo=True)
            self._undo.append(undo)
            return
        assert change is not None
        if change.kind == "same":
            return
        if change.kind == "raw":
            old_t = t.detach().clone()
            apply_delta(t, change)
            self._undo.append(functools.partial(t.detach().copy_, old_t))
            return
        apply_delta(t, change)
        self._undo.append(functools.partial(apply_delta, t, codec.negated(change)))

    def undo(self) -> int:
        """Take back every recorded change, newest first; how many there were."""
        count = len(self._undo)
        while self._undo:
            self._undo.pop()()
        return count

    def forget(self) -> None:
        """Keep the changes (the pull succeeded)."""
        self._undo.clear()
