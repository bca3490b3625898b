"""Applying a delta blob in place while decoding it (compiled loops, or numpy without them):
bit-exact against the codec, exactly undoable, and a malformed blob changes nothing."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from astraflow.errors import ChecksumError
from astraflow.weights import delta as codec
from astraflow.weights import kernels
from astraflow.weights.journal import Journal


@pytest.fixture(params=["fused", "numpy"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Both ways a blob is applied: the compiled loops (numba) and the numpy decode + apply."""
    if request.param == "fused":
        if not kernels.warm(wait=True):
            pytest.skip("numba is not installed")
    else:
        monkeypatch.setitem(kernels._state, "kernels", None)
    yield request.param


def _change(dtype: type, size: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Old and new flat views: ``fraction`` of elements moved by -3..3 units, a few by far
    (escaped sizes), and long unchanged runs (escaped gaps)."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, np.iinfo(dtype).max, size, dtype=dtype, endpoint=True)
    new = old.copy()
    idx = rng.choice(size // 2, int(fraction * size / 2), replace=False)  # 2nd half unchanged
    new[idx] += rng.integers(-3, 4, idx.size).astype(np.int64).astype(dtype)
    new[idx[:7]] = rng.integers(0, np.iinfo(dtype).max, 7, dtype=dtype)
    new[-1] += dtype(1)  # one change past the long unchanged run
    return old, new


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
@pytest.mark.parametrize(
    ("fraction", "encoding"), [(0.001, "joint"), (0.2, "joint"), (0.9, "dense")]
)
def test_blob_applies_bit_exact_and_undoes_exactly(
    path: str, dtype: type, fraction: float, encoding: str
) -> None:
    old, new = _change(dtype, 60_000, fraction, seed=3)
    got, blob = codec.encode(codec.diff(old, new), new)
    assert got == encoding
    flat = old.copy()
    kernels.apply_blob(encoding, blob, flat)
    assert np.array_equal(flat, new)
    kernels.apply_blob(encoding, blob, flat, undo=True)
    assert np.array_equal(flat, old)


def test_malformed_blob_changes_nothing(path: str) -> None:
    """A blob whose last positions lie past the end of a shorter tensor (its first ones fit)
    is refused before any change, as are garbled bytes: the tensor stays as it was."""
    old, new = _change(np.uint16, 50_000, 0.1, seed=5)
    encoding, blob = codec.encode(codec.diff(old, new), new)
    short = old[:40_000].copy()
    with pytest.raises(ChecksumError, match="malformed joint"):
        kernels.apply_blob(encoding, blob, short)
    assert np.array_equal(short, old[:40_000])
    flat = old.copy()
    for bad in (blob[: len(blob) // 2], blob[:-1] + b"!", (10**6).to_bytes(8, "little") + blob[8:]):
        with pytest.raises(ChecksumError):
            kernels.apply_blob(encoding, bad, flat)
        assert np.array_equal(flat, old)
    dense_blob = codec.encode(codec.diff(old, old + np.uint16(1)), old)[1]
    with pytest.raises(ChecksumError, match="malformed dense"):
        kernels.apply_blob("dense", dense_blob, short)
    assert np.array_equal(short, old[:40_000])


def test_journal_undoes_every_kind_of_change_newest_first() -> None:
    """Blobs, decoded changes and a raw replacement, on one tensor and on several: undone,
    the tensors are back bit for bit."""
    rng = np.random.default_rng(0)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    tensors = [torch.randn(5_000, generator=g).bfloat16() for g in gens]
    before = [t.clone() for t in tensors]
    journal = Journal()
    flat = [t.view(torch.int16).numpy().view(np.uint16) for t in tensors]
    for i, kind in enumerate(("joint", "dense", "raw")):
        new = flat[i].copy()
        if kind == "raw":
            new[:] = rng.integers(0, 2**16, new.size).astype(np.uint16)
        else:
            idx = rng.choice(new.size, new.size // (50 if kind == "joint" else 2), replace=False)
            new[idx] += np.uint16(1)
        change = codec.diff(flat[i], new)
        encoding, blob = codec.encode(change, new)
        assert encoding == kind
        journal.apply(tensors[i], prepared=kernels.prepare(encoding, blob, new.size, 2))
        journal.apply(tensors[0], change=codec.diff(flat[0], flat[0] + np.uint16(2)))
    assert not torch.equal(tensors[2], before[2])
    assert journal.undo() == 6
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t.view(torch.int16), b.view(torch.int16))
    assert journal.undo() == 0
