"""WeightClient: the node side. Plan the cheapest path, download, verify, apply in place.

    pull(policy, tensors, have, want)
      plan:   chain  = deltas have+1 .. want             (bytes: their delta files)
              merged = one delta have → want from server   (bytes: its file; HTTP sources)
              full   = newest full F <= want + deltas F+1 .. want
              → the candidate with the fewest bytes
      fetch:  every file of the plan, checked against its manifest checksum (retried if bad)
      check:  names, dtypes, shapes; for deltas the tensors must hold `have` (checksums)
      apply:  compose the deltas, write each tensor once in place (CPU or device)
      verify: every tensor's checksum equals the one published for `want`

Nothing is written into ``tensors`` before every downloaded byte is verified, so a failed
pull leaves the node on its current version.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import safetensors
import safetensors.torch
import torch
from pydantic import BaseModel, ConfigDict

from astraflow.errors import ChecksumError, NotFoundError, ValidationError
from astraflow.weights.delta import TensorDelta
from astraflow.weights.manifest import (
    DELTA_FILE,
    FULL_FILE,
    MANIFEST_FILE,
    AssetsManifest,
    WeightManifest,
    file_checksum,
    manifest_ref,
    merged_dir,
    version_dir,
)
from astraflow.weights.merge import compose_chain
from astraflow.weights.tensors import apply_delta, checksum, dtype_name
from astraflow.weights.transfer import Source, TransferOptions, open_source

__all__ = ["PullStats", "WeightClient"]

logger = logging.getLogger(__name__)

Path_ = Literal["none", "chain", "merged", "full"]


class PullStats(BaseModel):
    """What one pull did."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str
    have: int | None
    want: int
    path: Path_
    bytes: int
    candidates: dict[str, int]
    files: int
    resumes: int
    seconds: float


class _Plan:
    def __init__(self, path: Path_, full: WeightManifest | None, deltas: list[WeightManifest]):
        self.path = path
        self.full = full
        self.deltas = deltas

    @property
    def bytes(self) -> int:
        total = self.full.size_of(FULL_FILE) if self.full is not None else 0
        return total + sum(m.size_of(DELTA_FILE) for m in self.deltas)


class WeightClient:
    """Reads a weight store from ``source``: an http(s) weight server, a path, or an fsspec URL.

    ``verify_base`` checks, before a delta is applied, that the tensors hold ``have`` (one
    checksum pass; a device tensor is copied to the host for it). ``options`` replaces the
    individual transfer bounds (``timeout_s``: per file; ``stall_s``: without a byte).
    ``options.token`` is the weight server's bearer token (callers read it from the
    environment: ``astraflow.weights.access.client_token()``).
    """

    def __init__(
        self,
        source: str | Path,
        *,
        timeout_s: float = 600.0,
        stall_s: float = 30.0,
        streams: int = 4,
        retries: int = 5,
        cache_dir: str | Path | None = None,
        verify_base: bool = True,
        options: TransferOptions | None = None,
    ) -> None:
        self.options = options or TransferOptions(
            timeout_s=timeout_s, stall_s=stall_s, streams=streams, retries=retries
        )
        self.source: Source = open_source(source, self.options)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.verify_base = verify_base
        self._lock = threading.Lock()
        self._resumes = 0

    def latest(self, policy: str) -> int | None:
        """The newest published version of ``policy`` (None when there is none)."""
        return self.source.latest(policy)

    def manifest(self, policy: str, version: int) -> WeightManifest:
        """The verified manifest of a version."""
        ref = manifest_ref(policy, version)
        data = self.source.read(ref, f"policy {policy} version {version} file {MANIFEST_FILE}")
        return WeightManifest.from_json(data, where=f"{self.source.url}/{ref}")

    def fetch_assets(self, policy: str, dest_dir: str | Path) -> Path:
        """Copy ``<policy>/assets/`` (config, tokenizer) into ``dest_dir``, verified."""
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        what = f"policy {policy} assets file {MANIFEST_FILE}"
        raw = self.source.read(f"{policy}/assets/{MANIFEST_FILE}", what)
        assets = AssetsManifest.model_validate_json(raw)
        with self._workdir() as work:
            for entry in assets.files:
                rel = f"{policy}/assets/{entry.name}"
                what = f"policy {policy} assets file {entry.name}"
                local = self._fetch_verified(
                    rel, entry.size, entry.checksum, work / entry.name, what
                )
                shutil.move(local, dest / entry.name)
        return dest

    def load(self, policy: str, version: int | None = None) -> dict[str, torch.Tensor]:
        """The full tensors of ``version`` (default: latest), verified."""
        want = self._want(policy, version)
        plan = self._full_plan(self.manifest(policy, want))
        with self._workdir() as work:
            local = self._download(plan, work)
            assert plan.full is not None
            tensors = dict(safetensors.torch.load_file(str(local[0])))
            target = plan.deltas[-1] if plan.deltas else plan.full
            self._check_targets(target, tensors)
            self._apply_deltas(plan, local[1:], tensors)
            self._verify(target, tensors)
        return tensors

    def pull(
        self,
        policy: str,
        tensors: MutableMapping[str, torch.Tensor],
        have: int | None,
        want: int | None = None,
    ) -> PullStats:
        """Update ``tensors`` in place from version ``have`` to ``want`` (default: latest).

        ``have=None`` means the tensors hold no known version (a full snapshot is used).
        Raises ``TransferError`` (naming source, version and file) when the download fails,
        ``ChecksumError`` when data or the tensors do not verify; in both cases before any
        tensor was written, except when the tensors turn out not to have held ``have``.
        """
        started = time.perf_counter()
        target_version = self._want(policy, want)
        if have is not None and have > target_version:
            raise ValidationError(
                f"policy {policy!r}: have v{have} is newer than v{target_version}"
            )
        if have == target_version:
            return PullStats(policy=policy, have=have, want=target_version, path="none", bytes=0,
                             candidates={}, files=0, resumes=0, seconds=0.0)  # fmt: skip
        target = self.manifest(policy, target_version)
        self._check_targets(target, tensors)
        plans = self._plans(policy, have, target)
        plan = min(
            plans.values(), key=lambda p: (p.bytes, ("merged", "chain", "full").index(p.path))
        )
        with self._workdir() as work:
            local = self._download(plan, work)
            if plan.path != "full" and self.verify_base:
                self._verify_base(policy, plan.deltas[0].base or 0, tensors)
            else:
                self._copy_full(plan, local.pop(0), tensors)
            self._apply_deltas(plan, local, tensors)
        self._verify(target, tensors)
        stats = PullStats(
            policy=policy, have=have, want=target_version, path=plan.path, bytes=plan.bytes,
            candidates={name: p.bytes for name, p in plans.items()},
            files=int(plan.full is not None) + len(plan.deltas), resumes=self._resumes,
            seconds=time.perf_counter() - started,
        )  # fmt: skip
        logger.info("pulled policy=%s have=%s want=%d path=%s bytes=%d seconds=%.3f",
                    policy, have, target_version, plan.path, plan.bytes, stats.seconds)  # fmt: skip
        return stats

    def close(self) -> None:
        """Release connections."""
        self.source.close()

    def __enter__(self) -> WeightClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- planning -------------------------------------------------------------------------

    def _want(self, policy: str, want: int | None) -> int:
        if want is not None:
            return want
        latest = self.latest(policy)
        if latest is None:
            raise NotFoundError(f"{self.source.url}: policy {policy!r} has no published version")
        return latest

    def _full_plan(self, target: WeightManifest) -> _Plan:
        deltas: list[WeightManifest] = []
        m = target
        while not m.full:
            if m.base is None:
                raise NotFoundError(f"{m.policy} v{m.version}: neither full nor delta stored")
            deltas.append(m)
            m = self.manifest(m.policy, m.base)
        return _Plan("full", m, deltas[::-1])

    def _plans(self, policy: str, have: int | None, target: WeightManifest) -> dict[str, _Plan]:
        plans = {"full": self._full_plan(target)}
        if have is None:
            return plans
        chain: list[WeightManifest] = []
        m = target
        while m.base is not None and m.base >= have:
            chain.append(m)
            if m.base == have:
                plans["chain"] = _Plan("chain", None, chain[::-1])
                break
            try:
                m = self.manifest(policy, m.base)
            except NotFoundError:
                break
        if "chain" in plans and len(chain) > 1:
            merged = self.source.merged(policy, have, target.version)
            if merged is not None and merged.checksum == target.checksum and merged.base == have:
                plans["merged"] = _Plan("merged", None, [merged])
        return plans

    # -- moving bytes -------------------------------------------------------------------------

    def _download(self, plan: _Plan, work: Path) -> list[Path]:
        jobs = []
        if plan.full is not None:
            jobs.append((plan.full, FULL_FILE))
        jobs += [(m, DELTA_FILE) for m in plan.deltas]
        if len(jobs) == 1:  # the usual refresh (one delta): no thread to start and join
            m, name = jobs[0]
            return [self._fetch_file(m, name, plan.path, work / f"0-{name}")]
        with ThreadPoolExecutor(min(4, len(jobs)), thread_name_prefix="weights-files") as pool:
            futures = [pool.submit(self._fetch_file, m, name, plan.path, work / f"{i}-{name}")
                       for i, (m, name) in enumerate(jobs)]  # fmt: skip
            return [f.result() for f in futures]

    def _fetch_file(self, m: WeightManifest, name: str, path: Path_, dest: Path) -> Path:
        entry = m.file(name)
        vdir = (
            merged_dir(m.policy, m.base, m.version)
            if path == "merged" and m.base is not None
            else version_dir(m.policy, m.version)
        )
        what = f"policy {m.policy} version {m.version} file {name}"
        if path == "merged":
            what = f"policy {m.policy} merged v{m.base}->v{m.version} file {name}"
        return self._fetch_verified(f"{vdir}/{name}", entry.size, entry.checksum, dest, what)

    def _fetch_verified(self, rel: str, size: int, digest: str, dest: Path, what: str) -> Path:
        for attempt in range(self.options.retries + 1):
            resumes = self.source.fetch(rel, size, dest, what)
            with self._lock:
                self._resumes += resumes
            with dest.open("rb") as f:
                data = f.read()
            if len(data) == size and file_checksum(data) == digest:
                return dest
            logger.warning(
                "checksum mismatch source=%s what=%r attempt=%d", self.source.url, what, attempt
            )
        raise ChecksumError(
            f"pull from {self.source.url} failed: {what}: checksum mismatch after "
            f"{self.options.retries + 1} downloads (corrupt or truncated; not applied)"
        )

    @contextmanager
    def _workdir(self) -> Iterator[Path]:
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._resumes = 0
        with tempfile.TemporaryDirectory(prefix="pull-", dir=self.cache_dir) as work:
            yield Path(work)

    # -- applying ------------------------------------------------------------------------------

    def _check_targets(
        self, target: WeightManifest, tensors: MutableMapping[str, torch.Tensor]
    ) -> None:
        for entry in target.tensors:
            t = tensors.get(entry.name)
            if t is None:
                raise ValidationError(
                    f"{target.policy} v{target.version}: no tensor {entry.name!r} to update",
                    field=entry.name,
                )
            if dtype_name(t.dtype) != entry.dtype or tuple(t.shape) != entry.shape:
                have = f"{dtype_name(t.dtype)}{list(t.shape)}"
                raise ValidationError(
                    f"{target.policy} v{target.version}: tensor {entry.name!r} is {have}, "
                    f"published {entry.dtype}{list(entry.shape)}",
                    field=entry.name,
                )

    def _copy_full(
        self, plan: _Plan, path: Path, tensors: MutableMapping[str, torch.Tensor]
    ) -> None:
        assert plan.full is not None
        with safetensors.safe_open(str(path), framework="pt") as f:
            for entry in plan.full.tensors:
                tensors[entry.name].copy_(f.get_tensor(entry.name))

    def _apply_deltas(
        self, plan: _Plan, paths: list[Path], tensors: MutableMapping[str, torch.Tensor]
    ) -> None:
        if not plan.deltas:
            return
        blobs = [p.read_bytes() for p in paths]
        composed: dict[str, TensorDelta] = compose_chain(plan.deltas, blobs)
        done: set[tuple[object, ...]] = set()
        for name, change in composed.items():
            t = tensors[name]
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key in done:
                continue  # tied weights: one storage under two names, changed once
            done.add(key)
            apply_delta(t, change)

    def _verify_base(
        self, policy: str, have: int, tensors: MutableMapping[str, torch.Tensor]
    ) -> None:
        try:
            base = self.manifest(policy, have)
        except NotFoundError:  # collected from the store: the deltas after it still exist
            logger.debug("base manifest gone policy=%s version=%d: not verified", policy, have)
            return
        self._verify(base, tensors, before=True)

    def _verify(
        self,
        target: WeightManifest,
        tensors: MutableMapping[str, torch.Tensor],
        *,
        before: bool = False,
    ) -> None:
        for entry in target.tensors:
            if checksum(tensors[entry.name]) != entry.checksum:
                state = "do not hold" if before else "did not end at"
                raise ChecksumError(
                    f"{self.source.url}: policy {target.policy}: tensor {entry.name!r} checksum "
                    f"differs: the tensors {state} version {target.version}"
                    + ("" if before else " (were they at the base version?)"),
                    field=entry.name,
                )
