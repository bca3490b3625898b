"""The delta codec: bit-exact round trips for every dtype, composition, and malformed input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import zstandard

from astraflow.errors import ChecksumError, ValidationError
from astraflow.weights import delta as codec
from astraflow.weights.tensors import bits

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _perturb(t: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """A copy of ``t`` with ``fraction`` of its elements moved by a few units in the last place."""
    gen = torch.Generator().manual_seed(seed)
    out = t.clone()
    flat = bits(out)
    idx = torch.randperm(flat.size, generator=gen)[: int(fraction * flat.size)].numpy()
    steps = torch.randint(-3, 4, (idx.size,), generator=gen).numpy()
    flat[idx] = flat[idx] + steps.astype(flat.dtype)  # wrapping, any bit pattern is fine
    return out


def _roundtrip(old: torch.Tensor, new: torch.Tensor) -> str:
    change = codec.diff(bits(old), bits(new))
    encoding, blob = codec.encode(change, bits(new))
    target = old.clone()
    codec.apply(bits(target), codec.decode(encoding, blob, old.numel(), old.element_size()))
    assert np.array_equal(bits(target), bits(new))
    return encoding


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("fraction", "expected"), [(0.0, "same"), (0.02, "joint"), (0.5, "dense"), (1.0, "raw")]
)
def test_roundtrip_is_bit_exact_for_each_dtype_and_density(
    dtype: torch.dtype, fraction: float, expected: str
) -> None:
    old = (torch.randn(50_000, generator=torch.Generator().manual_seed(1)) * 0.02).to(dtype)
    if fraction == 1.0:  # incompressible: uniformly random bits
        new = old.clone()
        rng = np.random.default_rng(2)
        bits(new)[:] = rng.integers(0, 2**63, new.numel()).astype(bits(new).dtype)
    else:
        new = _perturb(old, fraction, seed=3)
    assert _roundtrip(old, new) == expected


def test_special_bit_patterns_survive() -> None:
    old = torch.tensor([0.0, -0.0, float("nan"), float("inf"), 1.0, -1.0] * 1000)
    new = old.clone()
    b = bits(new)
    b[::7] ^= np.uint32(0x80000000)  # flip sign bits, NaN payloads, -0.0 <-> 0.0
    b[2::6] |= np.uint32(0x1)
    _roundtrip(old, new)


def test_large_gaps_use_the_escape_stream() -> None:
    old = torch.zeros(3_000_000, dtype=torch.bfloat16)
    new = old.clone()
    positions = [0, 1, 300, 70_000, 2_999_999]  # gaps < 255, >= 255, >= 65536, and the last
    bits(new)[positions] = 7
    change = codec.diff(bits(old), bits(new))
    assert change.kind == "sparse" and change.changed == len(positions)
    assert _roundtrip(old, new) == "joint"


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_joint_escapes_gaps_and_sizes_and_keeps_every_bit(itemsize: int) -> None:
    """Gaps and sizes (|diff| - 1) of 15 and more go to side streams; the most negative
    difference (whose size wraps) and every gap length come back exactly."""
    dtype = codec.uint_dtype(itemsize)
    top = np.iinfo(dtype).max
    old = np.random.default_rng(0).integers(0, top, 400_000, dtype=dtype, endpoint=True)
    new = old.copy()
    rng = np.random.default_rng(1)
    positions = np.unique(
        np.concatenate([[0, 14, 15, 30, 31, 300, 70_000], rng.choice(400_000, 4000)])
    )
    weights = [0.25, 0.25, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05]  # a sixth escaped
    steps = rng.choice([-1, 1, 2, -2, 3, 15, 16, -16, 17], positions.size, p=weights)
    new[positions] = old[positions] + steps.astype(np.int64).astype(dtype)
    new[positions[:3]] = old[positions[:3]] + dtype.type(1 << (8 * itemsize - 1))  # -2**(n-1)
    new[-1] = old[-1] + dtype.type(1)  # the last element
    change = codec.diff(old, new)
    encoding, blob = codec.encode(change, new)
    assert encoding == "joint"
    target = old.copy()
    codec.apply(target, codec.decode(encoding, blob, old.size, itemsize))
    assert np.array_equal(target, new)


def test_mostly_large_differences_are_written_sparse_and_still_read() -> None:
    old = np.zeros(100_000, dtype=np.uint16)
    new = old.copy()
    new[::40] = np.arange(1000, 1000 + new[::40].size, dtype=np.uint16)  # sizes far over 15
    encoding, blob = codec.encode(codec.diff(old, new), new)
    assert encoding == "sparse"
    target = old.copy()
    codec.apply(target, codec.decode(encoding, blob, old.size, 2))
    assert np.array_equal(target, new)


def test_joint_is_smaller_than_sparse_on_small_steps() -> None:
    old = (torch.randn(200_000, generator=torch.Generator().manual_seed(0)) * 0.02).to(
        torch.bfloat16
    )
    new = _perturb(old, 0.2, seed=6)
    change = codec.diff(bits(old), bits(new))
    encoding, joint = codec.encode(change, bits(new))
    assert encoding == "joint" and change.pos is not None and change.values is not None
    gaps = codec._gaps_encode(codec._gaps(change.pos))
    plain = codec._HEADER.pack(change.pos.size, len(gaps)) + gaps
    plain += codec._planes(codec._zigzag(change.values))
    assert len(joint) < len(zstandard.ZstdCompressor(level=1).compress(plain))


def test_sparse_delta_is_smaller_than_plain_index_and_value() -> None:
    old = (torch.randn(200_000, generator=torch.Generator().manual_seed(0)) * 0.02).to(
        torch.bfloat16
    )
    new = _perturb(old, 0.02, seed=5)
    change = codec.diff(bits(old), bits(new))
    _, blob = codec.encode(change, bits(new))
    plain = change.changed * (4 + 2)
    assert len(blob) < 0.5 * plain


def test_compose_equals_applying_in_order() -> None:
    base = (torch.randn(40_000, generator=torch.Generator().manual_seed(0)) * 0.02).to(
        torch.bfloat16
    )
    states = [base]
    for i, fraction in enumerate([0.01, 0.3, 0.01, 0.0, 1.0, 0.02, 0.01, 0.4, 0.01, 0.01]):
        nxt = (
            torch.randn(40_000, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
            if fraction == 1.0
            else _perturb(states[-1], fraction, seed=100 + i)
        )
        states.append(nxt)
    composed = None
    for a, b in itertools.pairwise(states):
        change = codec.diff(bits(a), bits(b))
        enc, blob = codec.encode(change, bits(b))
        step = codec.decode(enc, blob, a.numel(), 2)
        composed = step if composed is None else codec.compose(composed, step)
    assert composed is not None
    target = states[0].clone()
    codec.apply(bits(target), composed)
    assert np.array_equal(bits(target), bits(states[-1]))


def test_compose_drops_changes_that_cancel() -> None:
    old = np.arange(1000, dtype=np.uint16)
    mid = old.copy()
    mid[[5, 10]] += 1
    back = old.copy()
    back[10] += 1
    merged = codec.compose(codec.diff(old, mid), codec.diff(mid, back))
    assert merged.kind == "sparse" and merged.pos is not None
    assert merged.pos.tolist() == [10]
    assert codec.compose(codec.diff(old, mid), codec.diff(mid, old)).kind == "same"


def test_truncated_or_garbled_blob_is_refused() -> None:
    old = np.zeros(100_000, dtype=np.uint16)
    new = old.copy()
    new[::50] = 3
    encoding, blob = codec.encode(codec.diff(old, new), new)
    assert encoding == "joint"
    with pytest.raises(ChecksumError):
        codec.decode(encoding, blob[: len(blob) // 2], old.size, 2)
    count, signs = blob[:8], blob[8 : 8 + (2000 + 7) // 8]
    data = zstandard.ZstdDecompressor().decompress(blob[len(count) + len(signs) :])
    garbled = [
        (10**6).to_bytes(8, "little") + blob[8:],  # a count the blob cannot hold
        *(count + signs + zstandard.ZstdCompressor().compress(d) for d in (data[:-1], data + b"!")),
        count + signs + zstandard.ZstdCompressor().compress(data[:16] + b"\xff" * (len(data) - 16)),
    ]  # the last: every gap and size escaped, more escapes than the header says
    for bad in garbled:
        with pytest.raises(ChecksumError):
            codec.decode(encoding, bad, old.size, 2)
    with pytest.raises(ChecksumError):
        codec.decode("raw", b"\x00" * 10, old.size, 2)
    with pytest.raises(ValidationError, match="unknown delta encoding"):
        codec.decode("lz77", blob, old.size, 2)


def test_apply_refuses_a_delta_of_another_size() -> None:
    change = codec.diff(np.zeros(10, np.uint16), np.ones(10, np.uint16))
    with pytest.raises(ValidationError, match="does not fit"):
        codec.apply(np.zeros(11, np.uint16), change)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.bool])
@pytest.mark.parametrize("fraction", [0.02, 0.5, 1.0])
def test_device_scatter_path_is_bit_exact(dtype: torch.dtype, fraction: float) -> None:
    """The gather/scatter path device tensors take, run on CPU tensors (no GPU needed)."""
    from astraflow.weights.tensors import scatter_delta

    old = (torch.randn(20_000, generator=torch.Generator().manual_seed(0)) > 0.3).to(dtype)
    new = old.clone()
    flat = bits(new)
    rng = np.random.default_rng(1)
    idx = rng.choice(flat.size, int(fraction * flat.size), replace=False)
    flat[idx] = flat[idx] ^ flat.dtype.type(1)  # bool stays 0/1
    change = codec.diff(bits(old), bits(new))
    target = old.clone()
    scatter_delta(target, change)
    assert np.array_equal(bits(target), bits(new))
