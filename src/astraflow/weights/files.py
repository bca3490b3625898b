"""``StoreFiles``: reads and atomic writes under a weight-store root (no torch here).

The weight server reads a store through it, so serving weights needs neither torch nor a
trainer's dependencies.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from astraflow.errors import NotFoundError
from astraflow.weights.manifest import MANIFEST_FILE, WeightManifest, check_policy, manifest_ref

__all__ = ["StoreFiles"]


class StoreFiles:
    """Reads and atomic writes under a store root (local directory or fsspec URL)."""

    def __init__(self, root: str | Path, *, create: bool = True) -> None:
        self.url = str(root)
        self.fs, self.base = fsspec.core.url_to_fs(self.url)
        self.local = isinstance(self.fs, LocalFileSystem)
        if self.local and create:
            self.fs.makedirs(self.base, exist_ok=True)

    def path(self, rel: str) -> str:
        """The absolute path (for fsspec) of ``rel``."""
        return f"{self.base.rstrip('/')}/{rel}"

    def write(self, rel: str, data: bytes | memoryview) -> None:
        """Write a file whole, atomically (temp + rename where renames exist)."""
        target = self.path(rel)
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        if not self.local:
            self.fs.pipe_file(target, bytes(data))
            return
        tmp = f"{target}.tmp-{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(data)
        Path(tmp).replace(target)

    def read(self, rel: str) -> bytes:
        """Read a whole file; ``NotFoundError`` names it when absent."""
        try:
            data: bytes = self.fs.cat_file(self.path(rel))
        except FileNotFoundError:
            raise NotFoundError(f"{self.url}: no file {rel}") from None
        return data

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists."""
        return bool(self.fs.exists(self.path(rel)))

    def versions(self, policy: str) -> list[int]:
        """Versions of ``policy`` whose manifest exists, ascending."""
        if self.local:  # a directory listing, not fsspec's recursive walk of every version
            top = Path(self.path(check_policy(policy)))
            try:
                names = [e.name for e in os.scandir(top) if e.name[:1] == "v" and e.is_dir()]
            except FileNotFoundError:
                return []
            return sorted(
                int(n[1:]) for n in names if n[1:].isdigit() and (top / n / MANIFEST_FILE).exists()
            )
        pattern = self.path(f"{check_policy(policy)}/v*/{MANIFEST_FILE}")
        found = []
        for path in self.fs.glob(pattern):
            name = str(path).rstrip("/").split("/")[-2]
            if name[1:].isdigit():
                found.append(int(name[1:]))
        return sorted(found)

    def manifest(self, policy: str, version: int) -> WeightManifest:
        """Read and check the manifest of a version."""
        ref = manifest_ref(policy, version)
        try:
            data = self.read(ref)
        except NotFoundError:
            raise NotFoundError(f"{self.url}: policy {policy!r} has no version {version}") from None
        return WeightManifest.from_json(data, where=f"{self.url}/{ref}")

    def remove(self, rel: str) -> None:
        """Remove a file or directory tree if present."""
        path = self.path(rel)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)
