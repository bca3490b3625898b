"""The weight server's merged deltas: composed on demand, kept in a small LRU cache on disk.

``GET merged/{a}/{b}`` is the one request that writes to the store. So that readers cannot
grow it without bound, at most ``entries`` merged deltas and ``max_bytes`` of them are kept
(``<policy>/merged/vA-vB/``); composing a new one evicts the least recently served. One
composition per pair at a time (the per-pair locks live only while someone waits on them),
and at most ``concurrency`` compositions at once. A node still downloading the files of a
delta evicted meanwhile gets 404 and pulls again (the chain or a new merge).

    request (a, b) ─► pair lock ─► cached? ─ yes ─► touch, read manifest
                                    └ no ─► compose (worker thread, bounded) ─► larger than
                                            the cache? delete, 404 (the node applies the chain)
                                            ─► insert, evict LRU beyond entries / bytes
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from astraflow.errors import NotFoundError
from astraflow.weights.files import StoreFiles
from astraflow.weights.manifest import MANIFEST_FILE, WeightManifest, merged_dir
from astraflow.weights.merge import merge

__all__ = ["MergedCache"]

logger = logging.getLogger(__name__)

Key = tuple[str, int, int]
_DIR = re.compile(r"^v(\d{8,})-v(\d{8,})$")


class MergedCache:
    """Bounded, least-recently-used cache of merged deltas under a local store root."""

    def __init__(
        self, files: StoreFiles, *, entries: int, max_bytes: int, concurrency: int = 2
    ) -> None:
        self.files = files
        self.entries = entries
        self.max_bytes = max_bytes
        self._lru: OrderedDict[Key, int] = OrderedDict()
        self._locks: dict[Key, tuple[asyncio.Lock, int]] = {}
        self._slots = asyncio.Semaphore(concurrency)
        for key, size in _on_disk(Path(files.base)):
            self._lru[key] = size
        self._remove(self._victims(keep=None))

    @property
    def bytes(self) -> int:
        """Bytes of the merged deltas kept now."""
        return sum(self._lru.values())

    def pending_locks(self) -> int:
        """Pair locks alive now (only pairs someone is composing or waiting for)."""
        return len(self._locks)

    async def get(self, policy: str, have: int, want: int) -> WeightManifest:
        """The merged delta ``have`` → ``want``: from the cache, or composed and cached.

        Raises ``NotFoundError`` when there is no delta chain between them, when merged
        deltas are disabled (``entries=0``), or when one alone would not fit the cache.
        """
        key = (policy, have, want)
        async with self._pair(key):
            if key in self._lru:
                try:
                    manifest = await asyncio.to_thread(self._read, key)
                except NotFoundError:  # collected by the trainer's store meanwhile
                    manifest = None
                if manifest is not None and key in self._lru:  # not evicted while read
                    self._lru.move_to_end(key)
                    return manifest
                self._lru.pop(key, None)
            if self.entries == 0:
                raise NotFoundError("this weight server composes no merged deltas")
            async with self._slots:
                manifest = await asyncio.to_thread(merge, self.files, policy, have, want)
            size = _size(manifest)
            if size > self.max_bytes:
                await asyncio.to_thread(self.files.remove, merged_dir(*key))
                raise NotFoundError(
                    f"merged delta {policy} v{have}->v{want} ({size} bytes) exceeds the cache "
                    f"of {self.max_bytes} bytes: apply the chain"
                )
            self._lru[key] = size
            self._lru.move_to_end(key)
            # on the loop, not in a thread: no other request sees an entry half evicted
            self._remove(self._victims(keep=key))
            return manifest

    @asynccontextmanager
    async def _pair(self, key: Key) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    def _read(self, key: Key) -> WeightManifest:
        rel = f"{merged_dir(*key)}/{MANIFEST_FILE}"
        return WeightManifest.from_json(self.files.read(rel), where=f"{self.files.url}/{rel}")

    def _victims(self, keep: Key | None) -> list[Key]:
        """Take least recently used entries (never ``keep``) out until within both bounds."""
        out: list[Key] = []
        while len(self._lru) > self.entries or self.bytes > self.max_bytes:
            victim = next((k for k in self._lru if k != keep), None)
            if victim is None:
                break
            self._lru.pop(victim)
            out.append(victim)
        return out

    def _remove(self, victims: list[Key]) -> None:
        for key in victims:
            self.files.remove(merged_dir(*key))
            logger.info("merged delta evicted policy=%s have=%d want=%d", *key)


def _size(manifest: WeightManifest) -> int:
    return sum(f.size for f in manifest.files) + len(manifest.to_json())


def _on_disk(base: Path) -> list[tuple[Key, int]]:
    """Merged deltas already in the store (a restarted server), oldest first."""
    found: list[tuple[float, Key, int]] = []
    for manifest in base.glob(f"*/merged/*/{MANIFEST_FILE}"):
        match = _DIR.match(manifest.parent.name)
        if match is None:
            continue
        try:
            mtime = manifest.stat().st_mtime
            size = sum(p.stat().st_size for p in manifest.parent.iterdir())
        except OSError:
            continue
        policy = manifest.parent.parent.parent.name
        found.append((mtime, (policy, int(match[1]), int(match[2])), size))
    return [(key, size) for _, key, size in sorted(found)]
