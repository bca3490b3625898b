"""The delta codec: bit-exact round trips for every dtype, composition, and malformed input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

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
    ("fraction", "expected"), [(0.0, "same"), (0.02, "sparse"), (0.5, "dense"), (1.0, "raw")]
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
    assert _roundtrip(old, new) == "sparse"


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
    assert encoding == "sparse"
    with pytest.raises(ChecksumError):
        codec.decode(encoding, blob[: len(blob) // 2], old.size, 2)
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
