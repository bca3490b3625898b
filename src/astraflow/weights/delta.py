"""Bit-exact sparse deltas between two versions of one tensor (any dtype), on integer views.

A tensor is handled as a flat array of unsigned integers of its item size (bf16 → uint16).
The change from ``old`` to ``new`` is the wrapped integer difference ``new - old`` at the
positions whose bits differ, so applying it (``old + diff``, wrapping) is exact to the bit and
two deltas compose by adding differences. Under an RL step most changed bf16 values move by
one or two units in the last place, so the differences are tiny integers that compress far
better than the raw new values.

Encodings of one tensor's change (the manifest records which one each tensor uses)::

    same    nothing changed; no bytes
    joint   u64 count | sign bits of the diffs, 8 a byte (random: left uncompressed) |
            zstd( u64 gap escapes | u64 size escapes | one byte per change: gap (low 4
                  bits) and |diff| - 1 (high 4 bits), 15 escaping each to a side stream |
                  gap escapes, u64 byte planes | size escapes, byte planes of the item size )
    sparse  zstd( u64 count | u64 len(gaps) | gaps between positions, one byte each
                  (255 escapes to a u64 side stream) | zigzag(diff) in byte planes )
    dense   zstd( zigzag(diff) of every element, split into byte planes )
    raw     the new tensor's bytes, uncompressed (when nothing else is smaller)

``joint`` is what a sparse change is written as: one symbol per changed element for its gap
and its size together, whose distribution zstd's Huffman stage codes closer to its entropy
than the two byte streams of ``sparse`` (whose value plane, mostly +-1 and +-2, costs ~2.9
bits an element against 2.3 of entropy); the sign bits, random, stay out of zstd's blocks,
whose one Huffman table they would spoil. 0.72 against 0.80 bytes per changed element on the
33.6M-parameter Adam steps of ``benchmarks/cross_region.py``. A change of mostly large
differences (more than a quarter of them escaped) is written as ``sparse``, which every
reader also decodes.

Gaps are ``pos[i] - pos[i-1] - 1`` with ``pos[-1] = -1``; one byte per gap with an escape
measured smaller and 5x faster to encode than LEB128 varints at 0.96-0.996 sparsity. Byte planes
(low bytes of all values, then high bytes) put the mostly-zero high bytes together, where zstd
squeezes them to almost nothing.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import zstandard

from astraflow.errors import ChecksumError, ValidationError

__all__ = [
    "ENCODINGS",
    "Encoding",
    "JointParts",
    "TensorDelta",
    "apply",
    "compose",
    "decode",
    "diff",
    "encode",
    "joint_parts",
    "negated",
    "uint_dtype",
]

Encoding = Literal["same", "joint", "sparse", "dense", "raw"]
ENCODINGS: tuple[Encoding, ...] = ("same", "joint", "sparse", "dense", "raw")

UIntArray = npt.NDArray[np.unsignedinteger[Any]]
IndexArray = npt.NDArray[np.int64]

#: Above this fraction of changed elements a sparse encoding is not tried (dense is smaller).
SPARSE_MAX_DENSITY = 0.25
_HEADER = struct.Struct("<QQ")
_JOINT_HEADER = struct.Struct("<QQ")  # how many gaps and sizes are escaped
_COUNT = struct.Struct("<Q")
_NIBBLE = 15  # in a joint symbol: this gap or size (|diff| - 1) or more is in a side stream
_ESCAPE = 255
_UINT: dict[int, np.dtype[np.unsignedinteger[Any]]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}
_INT: dict[int, np.dtype[np.signedinteger[Any]]] = {
    1: np.dtype(np.int8),
    2: np.dtype(np.int16),
    4: np.dtype(np.int32),
    8: np.dtype(np.int64),
}


def uint_dtype(itemsize: int) -> np.dtype[np.unsignedinteger[Any]]:
    """The unsigned integer dtype that views elements of ``itemsize`` bytes."""
    try:
        return _UINT[itemsize]
    except KeyError:
        raise ValidationError(f"unsupported element size {itemsize} bytes") from None


@dataclass(frozen=True)
class TensorDelta:
    """The change of one flat tensor of ``numel`` elements of ``itemsize`` bytes.

    ``kind`` says which fields are set (a ``joint`` blob decodes to a ``sparse`` delta):
    ``sparse`` has sorted unique ``pos`` and ``values``
    (wrapped differences) of the same length; ``dense`` has ``values`` for every element;
    ``raw`` has the new elements in ``values``; ``same`` has neither.
    """

    kind: Encoding
    numel: int
    itemsize: int
    values: UIntArray | None = None
    pos: IndexArray | None = None

    @property
    def changed(self) -> int:
        """How many elements this delta stores (all of them for dense and raw)."""
        if self.kind == "same":
            return 0
        return self.numel if self.pos is None else int(self.pos.size)


def diff(old: UIntArray, new: UIntArray) -> TensorDelta:
    """The delta that turns flat unsigned view ``old`` into ``new`` (same dtype and size)."""
    if old.dtype != new.dtype or old.shape != new.shape or old.ndim != 1:
        raise ValidationError(
            f"diff needs two flat arrays of one dtype and size, got {old.dtype}{old.shape} "
            f"and {new.dtype}{new.shape}"
        )
    numel, itemsize = int(old.size), old.dtype.itemsize
    pos = np.flatnonzero(old != new)
    if pos.size == 0:
        return TensorDelta("same", numel, itemsize)
    if pos.size > SPARSE_MAX_DENSITY * numel:
        return TensorDelta("dense", numel, itemsize, values=new - old)
    return TensorDelta("sparse", numel, itemsize, values=new[pos] - old[pos], pos=pos)


def encode(
    delta: TensorDelta, new: UIntArray | None = None, level: int = 1
) -> tuple[Encoding, bytes]:
    """Serialise a delta as the smallest of its encodings; returns ``(encoding, blob)``.

    ``new`` (the tensor after the change) allows the ``raw`` fallback when the compressed
    delta would not be smaller than the tensor itself.
    """
    if delta.kind == "same":
        return "same", b""
    if delta.kind == "raw":
        assert delta.values is not None
        return "raw", delta.values.tobytes()
    delta = _resparsify(delta)
    if delta.kind == "same":
        return "same", b""
    raw_size = delta.numel * delta.itemsize
    cctx = zstandard.ZstdCompressor(level=level)
    assert delta.values is not None
    kind: Encoding = delta.kind
    if delta.kind == "sparse":
        assert delta.pos is not None
        joint = _joint_encode(delta.pos, delta.values, cctx)
        if joint is not None:
            kind, blob = "joint", joint
        else:
            planes = _planes(_zigzag(delta.values))
            gaps = _gaps_encode(_gaps(delta.pos))
            blob = cctx.compress(_HEADER.pack(delta.pos.size, len(gaps)) + gaps + planes)
    else:
        blob = cctx.compress(_planes(_zigzag(delta.values)))
    if new is not None and len(blob) >= raw_size:
        return "raw", new.tobytes()
    return kind, blob


def decode(encoding: str, blob: bytes | memoryview, numel: int, itemsize: int) -> TensorDelta:
    """Parse one tensor's blob; raises ``ChecksumError`` when it is malformed."""
    if encoding not in ENCODINGS:
        raise ValidationError(f"unknown delta encoding {encoding!r}", field="encoding")
    dtype = uint_dtype(itemsize)
    try:
        if encoding == "same":
            return TensorDelta("same", numel, itemsize)
        if encoding == "raw":
            values = np.frombuffer(blob, dtype=dtype)
            _expect(values.size == numel, f"raw blob holds {values.size} of {numel} elements")
            return TensorDelta("raw", numel, itemsize, values=values)
        if encoding == "joint":
            pos, values = _joint_decode(blob, numel, dtype)
            return TensorDelta("sparse", numel, itemsize, values=values, pos=pos)
        data = zstandard.ZstdDecompressor().decompress(blob)
        if encoding == "dense":
            _expect(len(data) == numel * itemsize, f"dense blob holds {len(data)} bytes")
            values = _unzigzag(_unplanes(data, numel, dtype))
            return TensorDelta("dense", numel, itemsize, values=values)
        count, gaps_len = _HEADER.unpack_from(data)
        start = _HEADER.size
        gaps = _gaps_decode(memoryview(data)[start : start + gaps_len], count)
        pos = np.cumsum(gaps + np.uint64(1)).view(np.int64) - 1
        _expect(count == 0 or (pos[0] >= 0 and pos[-1] < numel), "positions out of range")
        values = _unzigzag(_unplanes(data[start + gaps_len :], count, dtype))
        return TensorDelta("sparse", numel, itemsize, values=values, pos=pos)
    except (zstandard.ZstdError, struct.error, ValueError) as exc:
        raise ChecksumError(f"malformed {encoding} delta blob: {exc}") from exc


def compose(first: TensorDelta, second: TensorDelta) -> TensorDelta:
    """The single delta equal to applying ``first`` then ``second``."""
    if (first.numel, first.itemsize) != (second.numel, second.itemsize):
        raise ValidationError("cannot compose deltas of tensors of different sizes")
    if first.kind == "same" or second.kind == "raw":
        return second
    if second.kind == "same":
        return first
    a, b = first, second
    assert a.values is not None and b.values is not None
    if a.kind == "raw":
        out = a.values.copy()
        apply(out, b)
        return TensorDelta("raw", a.numel, a.itemsize, values=out)
    if a.kind == "sparse" and b.kind == "sparse":
        assert a.pos is not None and b.pos is not None
        pos = np.union1d(a.pos, b.pos)
        values = np.zeros(pos.size, dtype=a.values.dtype)
        values[np.searchsorted(pos, a.pos)] = a.values
        values[np.searchsorted(pos, b.pos)] += b.values
        keep = values != 0
        if keep.all():
            return TensorDelta("sparse", a.numel, a.itemsize, values=values, pos=pos)
        if not keep.any():
            return TensorDelta("same", a.numel, a.itemsize)
        return TensorDelta("sparse", a.numel, a.itemsize, values=values[keep], pos=pos[keep])
    dense = _densify(a)
    apply(dense, b)  # adding b's differences to a's is exactly composing them
    return TensorDelta("dense", a.numel, a.itemsize, values=dense)


def apply(flat: UIntArray, delta: TensorDelta) -> None:
    """Apply ``delta`` in place to the flat unsigned view ``flat`` (wrapping arithmetic)."""
    if flat.size != delta.numel or flat.dtype.itemsize != delta.itemsize:
        raise ValidationError(
            f"delta for {delta.numel} x {delta.itemsize}-byte elements does not fit a tensor "
            f"of {flat.size} x {flat.dtype.itemsize}-byte elements"
        )
    if delta.kind == "same":
        return
    assert delta.values is not None
    if delta.kind == "raw":
        flat[:] = delta.values
    elif delta.kind == "dense":
        flat += delta.values
    else:
        assert delta.pos is not None
        flat[delta.pos] += delta.values


def negated(delta: TensorDelta) -> TensorDelta:
    """The delta that undoes ``delta`` (its differences negated, wrapping); a ``raw`` change
    cannot be undone from itself (``ValidationError``)."""
    if delta.kind == "raw":
        raise ValidationError("a raw change replaces the tensor: it cannot be undone from itself")
    if delta.values is None:
        return delta
    values = np.negative(delta.values)
    return TensorDelta(delta.kind, delta.numel, delta.itemsize, values, delta.pos)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _densify(delta: TensorDelta) -> UIntArray:
    assert delta.values is not None
    if delta.kind == "dense":
        return delta.values.copy()
    out = np.zeros(delta.numel, dtype=delta.values.dtype)
    out[delta.pos] = delta.values
    return out


def _resparsify(delta: TensorDelta) -> TensorDelta:
    """A dense delta with few non-zero differences as a sparse one (e.g. after composing)."""
    if delta.kind != "dense":
        return delta
    assert delta.values is not None
    pos = np.flatnonzero(delta.values)
    if pos.size == 0:
        return TensorDelta("same", delta.numel, delta.itemsize)
    if pos.size > SPARSE_MAX_DENSITY * delta.numel:
        return delta
    return TensorDelta("sparse", delta.numel, delta.itemsize, delta.values[pos], pos)


def _gaps(pos: IndexArray) -> npt.NDArray[np.uint64]:
    gaps = np.empty(pos.size, dtype=np.int64)
    gaps[0] = pos[0]
    np.subtract(pos[1:], pos[:-1], out=gaps[1:])
    gaps[1:] -= 1
    return gaps.view(np.uint64)


def _zigzag(values: UIntArray) -> UIntArray:
    signed = values.view(_INT[values.dtype.itemsize])
    bits = 8 * values.dtype.itemsize
    zz: UIntArray = ((signed << 1) ^ (signed >> (bits - 1))).view(values.dtype)
    return zz


def _unzigzag(zz: UIntArray) -> UIntArray:
    values: UIntArray = (zz >> 1) ^ np.negative(zz & 1)
    return values


def _planes(values: UIntArray) -> bytes:
    size = values.dtype.itemsize
    if size == 1:
        return values.tobytes()
    return values.view(np.uint8).reshape(-1, size).T.tobytes()


def _unplanes(
    data: bytes | memoryview, count: int, dtype: np.dtype[np.unsignedinteger[Any]]
) -> UIntArray:
    size = dtype.itemsize
    raw = np.frombuffer(data, np.uint8, count * size)
    if size == 1:
        return raw.copy()
    return np.ascontiguousarray(raw.reshape(size, count).T).view(dtype).reshape(count)


def _joint_encode(
    pos: IndexArray, values: UIntArray, cctx: zstandard.ZstdCompressor
) -> bytes | None:
    """The ``joint`` blob of a sparse change (None when over a quarter of its differences
    are too large for a symbol's 4 bits: ``sparse`` is written then)."""
    count = int(pos.size)
    signed = values.view(_INT[values.dtype.itemsize])
    negative = signed < 0
    size = np.where(negative, np.negative(values), values) - values.dtype.type(1)  # wraps
    size_escaped = size >= _NIBBLE
    n_size = int(np.count_nonzero(size_escaped))
    if n_size > count // 4:
        return None
    gaps = _gaps(pos)
    gap_escaped = gaps >= _NIBBLE
    symbols = np.minimum(gaps, _NIBBLE).astype(np.uint8)
    symbols |= np.minimum(size, _NIBBLE).astype(np.uint8) << np.uint8(4)
    packed = b"".join(
        (
            _JOINT_HEADER.pack(int(np.count_nonzero(gap_escaped)), n_size),
            symbols.tobytes(),
            _planes(gaps[gap_escaped]),
            _planes(size[size_escaped]),
        )
    )
    return _COUNT.pack(count) + np.packbits(negative).tobytes() + cctx.compress(packed)


@dataclass(frozen=True)
class JointParts:
    """The streams of a ``joint`` blob, lengths checked (what a decoder walks)."""

    count: int
    signs: npt.NDArray[np.uint8]
    """Sign bits of the differences, 8 a byte, first element in the high bit."""
    symbols: npt.NDArray[np.uint8]
    """One a change: gap (low 4 bits), ``|diff| - 1`` (high 4 bits); 15 is escaped."""
    gaps: npt.NDArray[np.uint64]
    """The escaped gaps, in order."""
    sizes: UIntArray
    """The escaped ``|diff| - 1``, in order, in the tensor's unsigned dtype."""


def joint_parts(blob: bytes | memoryview, dtype: np.dtype[np.unsignedinteger[Any]]) -> JointParts:
    """Split a ``joint`` blob into its streams (``ValueError`` or a zstd error when it is
    malformed; what the streams say is checked by whoever walks them)."""
    (count,) = _COUNT.unpack_from(blob)
    sign_len = (count + 7) // 8
    _expect(len(blob) > _COUNT.size + sign_len, "joint blob is too short")
    signs = np.frombuffer(blob, np.uint8, sign_len, _COUNT.size)
    data = zstandard.ZstdDecompressor().decompress(blob[_COUNT.size + sign_len :])
    n_gap, n_size = _JOINT_HEADER.unpack_from(data)
    start = _JOINT_HEADER.size
    _expect(
        len(data) == start + count + 8 * n_gap + dtype.itemsize * n_size,
        "joint stream has the wrong length",
    )
    view = memoryview(data)[start + count :]
    return JointParts(
        count=count,
        signs=signs,
        symbols=np.frombuffer(data, np.uint8, count, start),
        gaps=_unplanes(view[: 8 * n_gap], n_gap, np.dtype(np.uint64)),
        sizes=_unplanes(view[8 * n_gap :], n_size, dtype),
    )


def _joint_decode(
    blob: bytes | memoryview, numel: int, dtype: np.dtype[np.unsignedinteger[Any]]
) -> tuple[IndexArray, UIntArray]:
    """Positions and differences of a ``joint`` blob (``ValueError`` when malformed)."""
    parts = joint_parts(blob, dtype)
    count, symbols = parts.count, parts.symbols
    negative = np.unpackbits(parts.signs, count=count)
    low = symbols & np.uint8(_NIBBLE)
    escaped = np.flatnonzero(low == _NIBBLE)
    _expect(escaped.size == parts.gaps.size, "gap escapes do not match their count")
    pos: IndexArray = low.astype(np.int64)  # the gaps, made positions in place
    if parts.gaps.size:
        gaps = parts.gaps
        _expect(bool((gaps >= _NIBBLE).all() and (gaps < numel).all()), "escaped gap out of range")
        pos[escaped] = gaps
    pos += 1
    np.cumsum(pos, out=pos)
    pos -= 1
    _expect(count == 0 or (pos[0] >= 0 and pos[-1] < numel), "positions out of range")
    values: UIntArray = (symbols >> np.uint8(4)).astype(dtype)  # sizes, made differences
    escaped = np.flatnonzero(values == _NIBBLE)
    _expect(escaped.size == parts.sizes.size, "size escapes do not match their count")
    if parts.sizes.size:
        values[escaped] = parts.sizes
    values += dtype.type(1)  # wraps back for a size escaped as 2**bits - 1
    mask = np.negative(negative.astype(dtype))  # all ones where negative
    np.bitwise_xor(values, mask, out=values)
    values -= mask  # two's complement negation where negative: (x ^ ~0) + 1
    return pos, values


def _gaps_encode(gaps: npt.NDArray[np.uint64]) -> bytes:
    """One byte per gap; gaps of 255 or more are 255 plus the value in a u64 side stream."""
    small = gaps < _ESCAPE
    if small.all():
        return gaps.astype(np.uint8).tobytes()
    head = np.where(small, gaps, _ESCAPE).astype(np.uint8)
    return head.tobytes() + _planes(gaps[~small])


def _gaps_decode(data: bytes | memoryview, count: int) -> npt.NDArray[np.uint64]:
    """Inverse of :func:`_gaps_encode` for ``count`` gaps filling ``data`` exactly."""
    head = np.frombuffer(data, np.uint8, count)
    gaps = head.astype(np.uint64)
    escaped = np.flatnonzero(head == _ESCAPE)
    _expect(len(data) == count + 8 * escaped.size, "gap stream has the wrong length")
    if escaped.size:
        gaps[escaped] = _unplanes(memoryview(data)[count:], escaped.size, np.dtype(np.uint64))
    return gaps
