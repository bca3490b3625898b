"""The manifest of one weight version, the store layout, and the checksums that guard both.

A version directory holds data files and, written last, ``manifest.json``: the tensors (name,
dtype, shape, xxh3-64 of their bytes, and where their delta sits in ``delta.bin``), the files
(size, xxh3-128), the base version the delta applies to, and a whole-version checksum over
the tensor entries. A merged delta (``<policy>/merged/vA-vB/``) has the same manifest with
``base = A``.

    <policy>/assets/manifest.json      files of the config + tokenizer, written last
    <policy>/v00000012/manifest.json   a version exists only when this exists
    <policy>/v00000012/full.safetensors  full snapshot (every K versions, and the first)
    <policy>/v00000012/delta.bin       per-tensor delta blobs against ``base``
"""

from __future__ import annotations

import re
from typing import Literal

import numpy as np
import pydantic
import xxhash
from pydantic import BaseModel, ConfigDict, Field

from astraflow.errors import ChecksumError, ValidationError
from astraflow.weights.delta import Encoding

__all__ = [
    "DELTA_FILE",
    "FULL_FILE",
    "MANIFEST_FILE",
    "AssetsManifest",
    "FileEntry",
    "TensorEntry",
    "WeightManifest",
    "check_policy",
    "delta_layout",
    "dtype_itemsize",
    "file_checksum",
    "file_hasher",
    "manifest_ref",
    "merged_dir",
    "tensor_checksum",
    "version_checksum",
    "version_dir",
]

MANIFEST_FILE = "manifest.json"
FULL_FILE = "full.safetensors"
DELTA_FILE = "delta.bin"
_POLICY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_RESERVED = frozenset({"files", "health"})  # route names of the weight server
#: Bytes per element of the torch dtypes numpy does not know by name.
_ITEMSIZES = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_itemsize(name: str) -> int:
    """Bytes per element of the tensor dtype ``name`` (a manifest's ``dtype``), without torch."""
    size = _ITEMSIZES.get(name)
    if size is not None:
        return size
    try:
        return int(np.dtype(name).itemsize)
    except TypeError:
        raise ValidationError(f"unknown tensor dtype {name!r}", field="dtype") from None


def check_policy(policy: str) -> str:
    """Return ``policy`` if it is a safe directory name, else raise ``ValidationError``."""
    if not _POLICY.match(policy) or ".." in policy or policy in _RESERVED:
        raise ValidationError(
            f"policy name {policy!r} must be 1-128 of letters, digits, '.', '_', '-' "
            f"(not {', '.join(sorted(_RESERVED))})",
            field="policy",
        )
    return policy


def version_dir(policy: str, version: int) -> str:
    """The directory of a version, relative to the store root."""
    if version < 0:
        raise ValidationError(f"version must be >= 0, got {version}", field="version")
    return f"{check_policy(policy)}/v{version:08d}"


def merged_dir(policy: str, have: int, want: int) -> str:
    """The directory of the merged delta from ``have`` to ``want``, relative to the root."""
    return f"{check_policy(policy)}/merged/v{have:08d}-v{want:08d}"


def manifest_ref(policy: str, version: int) -> str:
    """The manifest path a trainer announces: ``<policy>/v00000012/manifest.json``."""
    return f"{version_dir(policy, version)}/{MANIFEST_FILE}"


def tensor_checksum(data: memoryview | bytes) -> str:
    """xxh3-64 of a tensor's raw bytes, as hex."""
    return xxhash.xxh3_64_hexdigest(data)


def file_checksum(data: memoryview | bytes) -> str:
    """xxh3-128 of a whole file's bytes, as hex."""
    return xxhash.xxh3_128_hexdigest(data)


def delta_layout(blobs: list[bytes]) -> tuple[bytes, list[int]]:
    """``delta.bin`` from the tensors' blobs and each blob's offset in it: largest first (a
    node decodes each tensor as its bytes arrive, so what is left after the last byte is a
    small tensor's work, not the largest's)."""
    order = sorted(range(len(blobs)), key=lambda i: -len(blobs[i]))
    offsets = [0] * len(blobs)
    offset = 0
    for i in order:
        offsets[i] = offset
        offset += len(blobs[i])
    return b"".join(blobs[i] for i in order), offsets


def file_hasher() -> xxhash.xxh3_128:
    """The streaming form of :func:`file_checksum` (``update`` per chunk, then ``hexdigest``)."""
    return xxhash.xxh3_128()


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_Record):
    """One data file of a version."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """File name inside the version directory."""
    size: int = Field(ge=0)
    """Size in bytes."""
    checksum: str
    """xxh3-128 of the file's bytes (hex)."""


class TensorEntry(_Record):
    """One tensor of a version: what it is, its checksum, and where its delta lies."""

    name: str
    """State-dict name (Hugging Face naming)."""
    dtype: str
    """torch dtype name without the 'torch.' prefix, e.g. 'bfloat16'."""
    shape: tuple[int, ...]
    """Tensor shape."""
    checksum: str
    """xxh3-64 of the tensor's bytes in this version (hex)."""
    encoding: Encoding | None = None
    """How ``delta.bin`` encodes the change from the base version; None without a delta."""
    offset: int = Field(default=0, ge=0)
    """Byte offset of this tensor's blob in ``delta.bin``."""
    length: int = Field(default=0, ge=0)
    """Byte length of this tensor's blob in ``delta.bin``."""

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for dim in self.shape:
            n *= dim
        return n


class WeightManifest(_Record):
    """A version of a policy's weights (or a merged delta when ``base`` < ``version`` - 1)."""

    format: Literal[1] = 1
    """Manifest format version."""
    policy: str
    """Policy id."""
    version: int = Field(ge=0)
    """Weight version these tensors are."""
    base: int | None = None
    """Version the delta file applies to; None when there is no delta file."""
    full: bool
    """Whether a full snapshot (``full.safetensors``) is stored for this version."""
    tensors: tuple[TensorEntry, ...]
    """Every tensor, in publish order."""
    files: tuple[FileEntry, ...]
    """Every data file."""
    checksum: str
    """Whole-version checksum over the tensor names, dtypes, shapes and checksums."""
    created_at: float = 0.0
    """Unix time the version was written."""

    def file(self, name: str) -> FileEntry:
        """The entry of data file ``name``; ``ValidationError`` if absent."""
        for entry in self.files:
            if entry.name == name:
                return entry
        raise ValidationError(f"{self.policy} v{self.version}: manifest lists no file {name!r}")

    def size_of(self, name: str) -> int:
        """Size of data file ``name`` in bytes."""
        return self.file(name).size

    def signature(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """Names, dtypes and shapes: a delta is only possible between equal signatures."""
        return tuple((t.name, t.dtype, t.shape) for t in self.tensors)

    def to_json(self) -> bytes:
        """Encode as the bytes of ``manifest.json``."""
        return self.model_dump_json(indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> WeightManifest:
        """Parse and check a manifest; errors name ``where`` it came from."""
        try:
            manifest = cls.model_validate_json(data)
        except pydantic.ValidationError as exc:
            raise ChecksumError(f"{where}: not a valid weight manifest: {exc}") from exc
        if version_checksum(manifest.tensors) != manifest.checksum:
            raise ChecksumError(f"{where}: whole-version checksum does not match its tensors")
        return manifest


class AssetsManifest(_Record):
    """The files under ``<policy>/assets/`` (HF config, tokenizer), written last."""

    policy: str
    """Policy id."""
    files: tuple[FileEntry, ...]
    """Every asset file (flat directory)."""


def version_checksum(tensors: tuple[TensorEntry, ...] | list[TensorEntry]) -> str:
    """Checksum over the tensor entries that define a version's content."""
    h = xxhash.xxh3_128()
    for t in tensors:
        h.update(f"{t.name}\0{t.dtype}\0{','.join(map(str, t.shape))}\0{t.checksum}\n".encode())
    return h.hexdigest()
