"""The compiled loops of ``kernels.py`` (numba; imported only when numba is installed).

Each walks one tensor's changes and adds them to its flat unsigned view in place (``flip``:
subtracts them). Arithmetic is integer and wraps: numba widens a 16- or 32-bit unsigned element
to a signed 64-bit one, and storing it back keeps its low bits, which are the element's (so
these loops are for 16- and 32-bit elements, which ``kernels._DTYPES`` holds to).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

__all__ = ["dense", "joint"]

_njit = numba.njit(cache=True, nogil=True, boundscheck=False)


@_njit  # type: ignore[untyped-decorator]
def joint_valid(symbols: Any, gaps: Any, sizes: Any, numel: int) -> bool:
    """Whether the streams are consistent: as many escapes as escaped values, escaped gaps in
    range, and the last position inside the tensor (positions only grow: every one is)."""
    last = symbols.size - 1
    n_gap = 0
    n_size = 0
    for i in range(symbols.size):
        gap = symbols[i] & 15
        last += gap
        n_gap += gap == 15
        n_size += (symbols[i] >> 4) == 15
    if n_gap != gaps.size or n_size != sizes.size:
        return False
    for j in range(gaps.size):
        if gaps[j] < 0 or gaps[j] >= numel:
            return False
        last += gaps[j] - 15
    return bool(last < numel)


@_njit  # type: ignore[untyped-decorator]
def joint(symbols: Any, signs: Any, gaps: Any, lut: Any, sizes: Any, flat: Any, flip: int) -> int:
    """Apply a ``joint`` blob's changes (symbols: gap and ``|diff| - 1`` nibbles; signs: packed
    bits; gaps: escaped gaps as int64; lut: ``|diff|`` of each nibble; sizes: escaped
    ``|diff|``), checked by ``joint_valid`` first (``kernels.prepare`` does)."""
    pos = -1
    gi = 0
    si = 0
    for i in range(symbols.size):
        s = symbols[i]
        gap = s & 15
        if gap == 15:
            gap = gaps[gi]
            gi += 1
        pos += gap + 1
        size = s >> 4
        if size == 15:
            d = np.int64(sizes[si])
            si += 1
        else:
            d = np.int64(lut[size])
        m = -(((signs[i >> 3] >> (7 - (i & 7))) & 1) ^ flip)  # all ones where negative
        flat[pos] += (d ^ m) - m  # no branch on the (random) sign
    return 0


@_njit  # type: ignore[untyped-decorator]
def dense(planes: Any, flat: Any, flip: int) -> int:
    """Add the zigzag differences held in byte planes (``planes[j, i]``: byte ``j`` of element
    ``i``, low first), worked in 64 bits."""
    itemsize = planes.shape[0]
    sign = 1 - 2 * flip
    for i in range(flat.size):
        zz = np.int64(planes[0, i]) | (np.int64(planes[1, i]) << 8)
        for j in range(2, itemsize):
            zz |= np.int64(planes[j, i]) << (8 * j)
        flat[i] = flat[i] + sign * ((zz >> 1) ^ -(zz & 1))
    return 0
