"""Chains of deltas: find the chain between two versions, compose it, write it as one delta.

A node ``k`` versions behind either applies the ``k`` deltas composed into one (client side:
one pass over its tensors, nothing written before all of it is verified), or downloads a
merged delta the server composed once and cached under ``<policy>/merged/vA-vB/``. A merged
delta is smaller than the chain whenever steps touch the same elements (cumulative sparsity
decays slower than the sum of per-step changes).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from astraflow.errors import ChecksumError, NotFoundError, ValidationError
from astraflow.weights import delta as codec
from astraflow.weights.files import StoreFiles
from astraflow.weights.manifest import (
    DELTA_FILE,
    MANIFEST_FILE,
    FileEntry,
    TensorEntry,
    WeightManifest,
    delta_layout,
    dtype_itemsize,
    file_checksum,
    merged_dir,
    version_checksum,
    version_dir,
)

__all__ = ["compose_chain", "decode_entry", "delta_chain", "merge"]

logger = logging.getLogger(__name__)


def delta_chain(files: StoreFiles, policy: str, have: int, want: int) -> list[WeightManifest]:
    """Manifests of the versions after ``have`` up to ``want``, each a delta on the one before.

    Raises ``NotFoundError`` when a version is missing or a link in the chain has no delta.
    """
    if want <= have:
        raise ValidationError(f"a delta chain needs want > have, got {have} -> {want}")
    chain: list[WeightManifest] = []
    version = want
    while version > have:
        manifest = files.manifest(policy, version)
        if manifest.base is None or manifest.base < have:
            raise NotFoundError(
                f"policy {policy!r}: no delta chain from {have} to {want} (v{version} has "
                f"base {manifest.base})"
            )
        chain.append(manifest)
        version = manifest.base
    chain.reverse()
    return chain


def compose_chain(
    chain: Sequence[WeightManifest],
    blobs: Sequence[bytes | memoryview],
    decoded: Mapping[str, codec.TensorDelta] | None = None,
) -> dict[str, codec.TensorDelta]:
    """Decode and compose the delta files of ``chain`` (oldest first) into one delta per tensor.

    ``decoded``: tensors of a one-file chain already decoded from the same (verified) bytes.
    """
    if not chain or len(chain) != len(blobs):
        raise ValidationError("compose_chain needs one delta file per manifest")
    out: dict[str, codec.TensorDelta] = {}
    early = decoded if decoded is not None and len(chain) == 1 else {}
    for manifest, blob in zip(chain, blobs, strict=True):
        view = memoryview(blob)
        for entry in manifest.tensors:
            change = early.get(entry.name) or decode_entry(manifest, entry, view)
            prev = out.get(entry.name)
            out[entry.name] = change if prev is None else codec.compose(prev, change)
    return out


def decode_entry(
    manifest: WeightManifest, entry: TensorEntry, blob: bytes | memoryview
) -> codec.TensorDelta:
    """Decode one tensor's change from ``blob``, the version's delta file (or its first part:
    ``ChecksumError`` when the tensor's bytes lie past its end)."""
    if entry.encoding is None:
        raise ValidationError(f"v{manifest.version}: tensor {entry.name} has no delta")
    if entry.offset + entry.length > len(blob):
        raise ChecksumError(
            f"{manifest.policy} v{manifest.version} {DELTA_FILE}: tensor "
            f"{entry.name} lies past the end of the file"
        )
    return codec.decode(
        entry.encoding,
        blob[entry.offset : entry.offset + entry.length],
        entry.numel,
        dtype_itemsize(entry.dtype),
    )


def merge(files: StoreFiles, policy: str, have: int, want: int, level: int = 1) -> WeightManifest:
    """The merged delta ``have`` → ``want``, composed and written once, then read from cache."""
    target = merged_dir(policy, have, want)
    if files.exists(f"{target}/{MANIFEST_FILE}"):
        return WeightManifest.from_json(
            files.read(f"{target}/{MANIFEST_FILE}"), where=f"{files.url}/{target}"
        )
    chain = delta_chain(files, policy, have, want)
    blobs = [_verified_delta(files, m) for m in chain]
    composed = compose_chain(chain, blobs)
    entries: list[TensorEntry] = []
    parts: list[bytes] = []
    for entry in chain[-1].tensors:
        encoding, blob = codec.encode(composed[entry.name], level=level)
        entries.append(entry.model_copy(update={"encoding": encoding, "length": len(blob)}))
        parts.append(blob)
    data, offsets = delta_layout(parts)
    entries = [e.model_copy(update={"offset": o}) for e, o in zip(entries, offsets, strict=True)]
    files.write(f"{target}/{DELTA_FILE}", data)
    manifest = WeightManifest(
        policy=policy,
        version=want,
        base=have,
        full=False,
        tensors=tuple(entries),
        files=(FileEntry(name=DELTA_FILE, size=len(data), checksum=file_checksum(data)),),
        checksum=version_checksum(entries),
        created_at=chain[-1].created_at,
    )
    files.write(f"{target}/{MANIFEST_FILE}", manifest.to_json())
    logger.info(
        "merged policy=%s have=%d want=%d bytes=%d chain_bytes=%d",
        policy, have, want, len(data), sum(len(b) for b in blobs),
    )  # fmt: skip
    return manifest


def _verified_delta(files: StoreFiles, manifest: WeightManifest) -> bytes:
    rel = f"{version_dir(manifest.policy, manifest.version)}/{DELTA_FILE}"
    data = files.read(rel)
    if file_checksum(data) != manifest.file(DELTA_FILE).checksum:
        raise ChecksumError(f"{files.url}/{rel}: checksum mismatch (corrupt file in the store)")
    return data
