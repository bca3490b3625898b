"""WeightStore: the trainer side. Publish versions as full snapshots and sparse deltas.

``publish`` copies the tensors to host memory and returns; a single background thread per
store then encodes and writes, so versions land in order and the trainer never waits for I/O::

    publish(v) ──copy to host──► queue ──► [writer thread]
                                              diff against host copy of v-1 → delta.bin
                                              every K versions (and first) → full.safetensors
                                              manifest.json LAST (temp + rename)
                                              keep host copy of v; gc old versions
                                              future.set_result(manifest) ──► trainer announces v

Retention keeps the newest ``keep`` versions and everything back to the newest full snapshot
at or below the oldest of them, so every kept version can be rebuilt and caught up from, and
(``keep_first``) version 0, the full snapshot a run starts from.
The root is a local directory or any fsspec URL (object stores: each object put is atomic).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import safetensors.torch
import torch
import xxhash

from astraflow.errors import ConflictError, NotFoundError, ValidationError
from astraflow.weights import delta as codec
from astraflow.weights.config import WeightStoreConfig
from astraflow.weights.files import StoreFiles
from astraflow.weights.manifest import (
    DELTA_FILE,
    FULL_FILE,
    MANIFEST_FILE,
    AssetsManifest,
    FileEntry,
    TensorEntry,
    WeightManifest,
    check_policy,
    delta_layout,
    file_checksum,
    manifest_ref,
    tensor_checksum,
    version_checksum,
    version_dir,
)
from astraflow.weights.tensors import bits, dtype_name

__all__ = ["StoreFiles", "WeightStore", "WeightStoreConfig"]

logger = logging.getLogger(__name__)

Tensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass
class _Previous:
    version: int
    tensors: dict[str, torch.Tensor]
    signature: tuple[tuple[str, str, tuple[int, ...]], ...]


class WeightStore:
    """Versioned weights of one or more policies under ``root`` (see the module docstring)."""

    def __init__(self, root: str | Path, config: WeightStoreConfig | None = None) -> None:
        self.config = config or WeightStoreConfig()
        self.files = StoreFiles(root)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-publish")
        self._slots = threading.BoundedSemaphore(self.config.max_pending)
        self._lock = threading.Lock()
        self._scheduled: dict[str, int] = {}
        self._previous: dict[str, _Previous] = {}
        self._last_full: dict[str, int] = {}
        self._floors: dict[str, int] = {}
        """The retention floor each policy's merged deltas were last collected at."""
        self._first_full: dict[str, bool] = {}
        """Whether each policy's version 0 is kept (``keep_first``: when it is full)."""
        self._closed = False

    def publish_assets(self, policy: str, directory: str | Path) -> None:
        """Copy the files of ``directory`` (config, tokenizer) to ``<policy>/assets/``."""
        src = Path(directory)
        if not src.is_dir():
            raise NotFoundError(f"assets directory {src} does not exist")
        entries = []
        for path in sorted(p for p in src.iterdir() if p.is_file()):
            if path.suffix == ".safetensors" or path.name.startswith("."):
                continue  # weights travel as versions, not assets
            data = path.read_bytes()
            self.files.write(f"{check_policy(policy)}/assets/{path.name}", data)
            entries.append(FileEntry(name=path.name, size=len(data), checksum=file_checksum(data)))
        manifest = AssetsManifest(policy=policy, files=tuple(entries))
        self.files.write(f"{policy}/assets/{MANIFEST_FILE}", manifest.model_dump_json().encode())

    def publish(
        self, policy: str, version: int, tensors: Tensors, *, dtype: torch.dtype | None = None
    ) -> Future[WeightManifest]:
        """Copy ``tensors`` to host memory (cast to ``dtype`` if given) and write in the background.

        Returns once the copy is made; the future resolves to the manifest after it is written.
        Raises ``ConflictError`` if ``version`` is not above every version already published.
        """
        check_policy(policy)
        if self._closed:
            raise ConflictError("the weight store is closed")
        if version < 0:
            raise ValidationError(f"version must be >= 0, got {version}", field="version")
        host = _host_copy(tensors, dtype)  # bad input raises here, before anything is reserved
        with self._lock:
            last = self._scheduled.get(policy)
            if last is None:
                known = self.files.versions(policy)
                last = known[-1] if known else None
            if last is not None and version <= last:
                raise ConflictError(
                    f"policy {policy!r}: version {version} is not above published {last}",
                    field="version",
                )
            self._scheduled[policy] = version
        self._slots.acquire()
        future = self._executor.submit(self._write, policy, version, host)
        future.add_done_callback(lambda _: self._slots.release())
        return future

    def latest(self, policy: str) -> int | None:
        """The newest fully written version of ``policy``, or None."""
        versions = self.files.versions(policy)
        return versions[-1] if versions else None

    def manifest(self, policy: str, version: int) -> WeightManifest:
        """The manifest of a written version."""
        return self.files.manifest(policy, version)

    def manifest_ref(self, policy: str, version: int) -> str:
        """The manifest path relative to the root, as announced to the dataflow service."""
        return manifest_ref(policy, version)

    def close(self) -> None:
        """Wait for pending publishes, then stop the writer thread."""
        self._closed = True
        self._executor.shutdown(wait=True)

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, policy: str, version: int, host: dict[str, torch.Tensor]) -> WeightManifest:
        started = time.perf_counter()
        signature = tuple((n, dtype_name(t.dtype), tuple(t.shape)) for n, t in host.items())
        prev = self._previous.get(policy)
        base = prev if prev is not None and prev.signature == signature else None
        last_full = self._last_full.get(policy)
        full = base is None or last_full is None or version - last_full >= self.config.full_every
        vdir = version_dir(policy, version)
        self.files.remove(vdir)  # leftovers of an interrupted attempt (no manifest there)
        files: list[FileEntry] = []
        tensors = self._write_delta(vdir, host, base, files)
        if full:
            files.append(self._write_full(vdir, host))
        manifest = WeightManifest(
            policy=policy,
            version=version,
            base=base.version if base is not None else None,
            full=full,
            tensors=tuple(tensors),
            files=tuple(files),
            checksum=version_checksum(tensors),
            created_at=time.time(),
        )
        self.files.write(f"{vdir}/{MANIFEST_FILE}", manifest.to_json())
        self._previous[policy] = _Previous(version, host, signature)
        if full:
            self._last_full[policy] = version
        logger.info(
            "published policy=%s version=%d full=%s base=%s bytes=%d seconds=%.3f",
            policy, version, full, manifest.base, sum(f.size for f in files),
            time.perf_counter() - started,
        )  # fmt: skip
        self.collect(policy)
        return manifest

    def _write_delta(
        self,
        vdir: str,
        host: dict[str, torch.Tensor],
        base: _Previous | None,
        files: list[FileEntry],
    ) -> list[TensorEntry]:
        entries: list[TensorEntry] = []
        blobs: list[bytes] = []
        for name, tensor in host.items():
            new = bits(tensor)
            entry = TensorEntry(
                name=name,
                dtype=dtype_name(tensor.dtype),
                shape=tuple(tensor.shape),
                checksum=tensor_checksum(new.data),
            )
            if base is not None:
                old = bits(base.tensors[name])
                if self.config.compress_deltas:
                    change = codec.diff(old, new)
                    encoding, blob = codec.encode(change, new, self.config.zstd_level)
                elif np.array_equal(old, new):
                    encoding, blob = "same", b""
                else:
                    encoding, blob = "raw", new.tobytes()
                entry = entry.model_copy(update={"encoding": encoding, "length": len(blob)})
                blobs.append(blob)
            entries.append(entry)
        if base is not None:
            data, offsets = delta_layout(blobs)
            entries = [
                e.model_copy(update={"offset": o}) for e, o in zip(entries, offsets, strict=True)
            ]
            self.files.write(f"{vdir}/{DELTA_FILE}", data)
            files.append(FileEntry(name=DELTA_FILE, size=len(data), checksum=file_checksum(data)))
        return entries

    def _write_full(self, vdir: str, host: dict[str, torch.Tensor]) -> FileEntry:
        rel = f"{vdir}/{FULL_FILE}"
        if self.files.local:
            target = Path(self.files.path(rel))
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f"{FULL_FILE}.tmp")
            safetensors.torch.save_file(host, str(tmp))
            with tmp.open("rb") as f:
                digest = _file_digest(f)
            size = tmp.stat().st_size
            tmp.replace(target)
            return FileEntry(name=FULL_FILE, size=size, checksum=digest)
        data = safetensors.torch.save(host)
        self.files.write(rel, data)
        return FileEntry(name=FULL_FILE, size=len(data), checksum=file_checksum(data))

    def collect(self, policy: str) -> list[int]:
        """Delete versions no longer needed (see the module docstring); returns those deleted."""
        versions = self.files.versions(policy)
        if not versions:
            return []
        kept = versions[-self.config.keep :]
        floor = kept[0]
        newest_full = self._last_full.get(policy)
        if newest_full is not None:
            floor = min(floor, newest_full)
        while floor > versions[0] and not self.files.manifest(policy, floor).full:
            floor = max(v for v in versions if v < floor)
        doomed = [v for v in versions if v < floor and not (v == 0 and self._pin_first(policy))]
        for v in doomed:
            vdir = version_dir(policy, v)
            self.files.remove(f"{vdir}/{MANIFEST_FILE}")  # the version ceases to exist first
            self.files.remove(vdir)
        if self._floors.get(policy) != floor:  # merged deltas only go when the floor moves
            self._collect_merged(policy, floor)
            self._floors[policy] = floor
        if doomed:
            logger.info("collected policy=%s versions=%s floor=%d", policy, doomed, floor)
        return doomed

    def _pin_first(self, policy: str) -> bool:
        """Version 0 of ``policy`` is kept: ``keep_first`` and it is a full snapshot."""
        if policy not in self._first_full:
            self._first_full[policy] = (
                self.config.keep_first and self.files.manifest(policy, 0).full
            )
        return self._first_full[policy]

    def _collect_merged(self, policy: str, floor: int) -> None:
        for path in self.files.fs.glob(self.files.path(f"{policy}/merged/v*-v*")):
            name = str(path).rstrip("/").split("/")[-1]
            have = name.split("-")[0][1:]
            if have.isdigit() and int(have) < floor:
                self.files.fs.rm(path, recursive=True)


def _host_copy(tensors: Tensors, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    host: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValidationError(f"tensor {name!r} is a {type(tensor).__name__}", field=name)
        if name in host:
            raise ValidationError(f"tensor name {name!r} appears twice", field=name)
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        host[name] = tensor.detach().to("cpu", dtype=target, copy=True).contiguous()
    if not host:
        raise ValidationError("publish needs at least one tensor")
    return host


def _file_digest(f: BinaryIO) -> str:
    h = xxhash.xxh3_128()
    while chunk := f.read(8 << 20):
        h.update(chunk)
    return h.hexdigest()
