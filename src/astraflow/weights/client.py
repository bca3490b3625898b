"""WeightClient: the node side. Plan the cheapest path, download, verify, apply in place.

    pull(policy, tensors, have, want)
      ahead:  at once, before planning: the manifests of want, have and the versions between,
              the merged delta's manifest (want > have + 1), want's delta file itself
              (want = have + 1), and the check that the tensors hold `have` (see _Ahead)
      plan:   chain  = deltas have+1 .. want             (bytes: their delta files)
              merged = one delta have → want from server   (bytes: its file; HTTP sources)
              full   = newest full F <= want + deltas F+1 .. want (not walked when a delta
                       path is smaller than the tensors themselves: a full file never is)
              → the candidate with the fewest bytes
      fetch:  every file of the plan, checked against its manifest checksum (retried if bad)
      check:  names, dtypes, shapes; for deltas the tensors must hold `have` (checksums)
      apply:  compose the deltas, write each tensor once in place (CPU or device), journaled
      verify: every tensor's checksum equals the one published for `want`

Over a slow link every request costs a round trip, so a pull by one delta takes one round
trip (manifests and file requested together) plus the file's bytes, instead of one per
manifest, then one for the file. A failed pull leaves the node on its current version: a delta
path writes nothing before its files verify, and every change it makes in place is recorded
in a journal (``journal.py``) and taken back, exactly, when anything after it fails. (A full
snapshot is copied in only once its file verified.)

The next version's delta (want = have + 1) is applied while it travels: one thread only
receives (and hashes the file as it comes), another applies each tensor's change in place as
soon as its bytes are in (one compiled pass over the changes, ``kernels.py``), journaled,
and checksums the tensor against the published one. The tensors are thus touched once: no
copy of them is staged, and no separate check that they held `have` is needed (a tensor that
did not ends at another checksum: its change, and every other, is taken back, and the pull
then names what was wrong). The pull commits when the last byte is in and the file verifies;
a tensor that does not verify, a corrupt or cut file, or any error undoes the journal. What
is left after the last byte is the last (smallest) tensor's change. The tensors are not to
be read while a pull runs (nodes pull into a shadow copy or between requests); tensors of a
``SafetensorsFile`` (on disk, where a crash would leave a mix) are written only after the
file verified.

From a store on the node's own disk there is no transfer to overlap with: the next version's
delta is read whole and checked first, then applied tensor by tensor in the calling thread,
journaled and checksummed the same way (``_pull_next_here``); the read-ahead's threads cost
more CPU than such a pull itself at small sizes. A file that does not read or verify there
goes the general way (fetched again, retried, named when it fails).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import safetensors
import safetensors.torch
import torch
from pydantic import BaseModel, ConfigDict

from astraflow.errors import ChecksumError, NotFoundError, TransferError, ValidationError
from astraflow.weights import delta as codec
from astraflow.weights import kernels
from astraflow.weights.delta import TensorDelta
from astraflow.weights.journal import Journal
from astraflow.weights.manifest import (
    DELTA_FILE,
    FULL_FILE,
    MANIFEST_FILE,
    AssetsManifest,
    TensorEntry,
    WeightManifest,
    dtype_itemsize,
    file_checksum,
    file_hasher,
    manifest_ref,
    merged_dir,
    tensor_checksum,
    version_dir,
)
from astraflow.weights.merge import compose_chain, decode_entry
from astraflow.weights.tensors import SafetensorsFile, bits, checksum, dtype_name
from astraflow.weights.transfer import FsSource, Source, TransferOptions, open_source

__all__ = ["PullStats", "WeightClient"]

logger = logging.getLogger(__name__)

Path_ = Literal["none", "chain", "merged", "full"]
Manifests = Callable[[int], WeightManifest]

#: Requests a pull sends ahead at once (manifests, the next delta, the base check).
_AHEAD_WORKERS = 8
#: Manifests of the versions between ``have`` and ``want`` requested ahead at most.
_AHEAD_CHAIN = 16


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

    def check(self) -> None:
        """Raise, naming the source, unless it can be read (``TransferError`` for a server
        that does not answer its health route, ``NotFoundError`` for a missing store)."""
        self.source.check()

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
            local = _on_disk(self._download(plan, work))
            assert plan.full is not None
            # copied out, not load_file's tensors: those map the temporary file (kept on disk
            # while they live, and each page copied on its first write, e.g. by a pull)
            with safetensors.safe_open(str(local[0]), framework="pt") as f:
                tensors = {e.name: f.get_tensor(e.name).clone() for e in plan.full.tensors}
            target = plan.deltas[-1] if plan.deltas else plan.full
            self._check_targets(target, tensors)
            self._apply_deltas(plan, local[1:], tensors, Journal())
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
        Raises ``NotFoundError`` when a version it needs is not served, ``TransferError``
        (naming source, version and file) when the download fails, ``ChecksumError`` when data
        or the tensors do not verify (``errors.UNCHANGED_BY_FAILED_PULL``); a delta pull that fails
        leaves the tensors as they were (its changes undone), a full one fails before it
        writes.
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
        kernels.warm()  # compiled in the background: this pull uses them if ready
        if have is not None and target_version == have + 1 and self._local:
            here = self._pull_next_here(policy, tensors, have, target_version, started)
            if here is not None:
                return here
        pool = ThreadPoolExecutor(_AHEAD_WORKERS, thread_name_prefix="weights-ahead")
        journal = Journal()
        ahead: _Ahead | None = None
        try:
            ahead = _Ahead(self, pool, policy, have, target_version, tensors)
            target = ahead.manifest(target_version)
            self._check_targets(target, tensors)
            plans = self._plans(policy, have, target, ahead)
            plan = min(
                plans.values(),
                key=lambda p: (p.bytes, ("merged", "chain", "full").index(p.path)),
            )
            verified: set[str] = set()
            with self._workdir() as work:
                local = self._download(plan, work, ahead)
                early = ahead.early() if plan.path == "chain" and len(plan.deltas) == 1 else None
                if early is not None:
                    verified = self._commit_early(
                        plan.deltas[0], early, tensors, ahead.discard, ahead.check_base
                    )
                else:
                    ahead.discard()  # the read-ahead's changes undone, nothing reads the tensors
                    files = _on_disk(local)
                    if plan.path == "full":
                        self._copy_full(plan, files.pop(0), tensors)
                    elif self.verify_base:
                        ahead.check_base(plan.deltas[0].base or 0)
                    self._apply_deltas(plan, files, tensors, journal)
            self._verify(target, tensors, skip=verified)
        except BaseException:
            undone = journal.undo() + (ahead.discard() if ahead is not None else 0)
            if undone:
                logger.info("pull failed policy=%s have=%s want=%d: %d changes undone",
                            policy, have, target_version, undone)  # fmt: skip
            raise
        finally:  # a failed pull does not wait for requests it no longer needs
            pool.shutdown(wait=False, cancel_futures=True)
        stats = PullStats(
            policy=policy, have=have, want=target_version, path=plan.path, bytes=plan.bytes,
            candidates={name: p.bytes for name, p in plans.items()},
            files=int(plan.full is not None) + len(plan.deltas), resumes=self._resumes,
            seconds=time.perf_counter() - started,
        )  # fmt: skip
        logger.info("pulled policy=%s have=%s want=%d path=%s bytes=%d seconds=%.3f",
                    policy, have, target_version, plan.path, plan.bytes, stats.seconds)  # fmt: skip
        return stats

    def _pull_next_here(
        self,
        policy: str,
        tensors: MutableMapping[str, torch.Tensor],
        have: int,
        want: int,
        started: float,
    ) -> PullStats | None:
        """The next version's delta from a store on a local disk, in this thread: its
        manifest, then the whole file (checked against the manifest), each tensor changed in
        place (journaled) and checksummed, as the read-ahead does, with no thread started.

        On a local disk there is no transfer to overlap the applying with, and the threads of
        the read-ahead cost more CPU than the pull itself at small sizes (a quickstart
        refresh: 1.6 MB). None when this pull needs the general path: the version is not a
        delta on ``have``, or its file did not read or verify (fetched again there, retried,
        and named when it fails).
        """
        target = self.manifest(policy, want)
        if target.base != have or all(f.name != DELTA_FILE for f in target.files):
            return None  # (a snapshot stores its delta on the version before too)
        self._check_targets(target, tensors)
        entry = target.file(DELTA_FILE)
        what = f"policy {policy} version {want} file {DELTA_FILE}"
        try:
            data = self.source.read(f"{version_dir(policy, want)}/{DELTA_FILE}", what)
        except (TransferError, NotFoundError) as exc:
            logger.debug("delta v%d did not read here (%r): the general path", want, exc)
            return None
        if len(data) != entry.size or file_checksum(data) != entry.checksum:
            logger.warning("delta does not verify source=%s version=%d: fetched again",
                           self.source.url, want)  # fmt: skip
            return None
        early = _Early()
        early.data, early.digest, early.verified = data, entry.checksum, True
        in_place = not isinstance(tensors, SafetensorsFile)
        view = memoryview(data)

        def check_base(base: int) -> None:
            self._verify_base(policy, base, tensors)

        try:
            for e in sorted(target.tensors, key=lambda e: e.offset):
                job = early.prepare(
                    e, view[e.offset : e.offset + e.length], tensors.get(e.name), in_place
                )
                if job is not None and not early.apply(*job):
                    break  # off its checksum: _commit_early undoes and says why
            verified = self._commit_early(target, early, tensors, early.journal.undo, check_base)
            self._verify(target, tensors, skip=verified)
        except BaseException:
            undone = early.journal.undo()
            if undone:
                logger.info("pull failed policy=%s have=%s want=%d: %d changes undone",
                            policy, have, want, undone)  # fmt: skip
            raise
        stats = PullStats(
            policy=policy, have=have, want=want, path="chain", bytes=entry.size,
            candidates={"chain": entry.size}, files=1, resumes=0,
            seconds=time.perf_counter() - started,
        )  # fmt: skip
        logger.info("pulled policy=%s have=%s want=%d path=chain bytes=%d seconds=%.3f",
                    policy, have, want, entry.size, stats.seconds)  # fmt: skip
        return stats

    @property
    def _local(self) -> bool:
        """The store is a directory on this machine (read directly, no transfer)."""
        return isinstance(self.source, FsSource) and self.source.files.local

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

    def _full_plan(self, target: WeightManifest, manifests: Manifests | None = None) -> _Plan:
        get = manifests or (lambda v: self.manifest(target.policy, v))
        deltas: list[WeightManifest] = []
        m = target
        while not m.full:
            if m.base is None:
                raise NotFoundError(f"{m.policy} v{m.version}: neither full nor delta stored")
            deltas.append(m)
            m = get(m.base)
        return _Plan("full", m, deltas[::-1])

    def _plans(
        self, policy: str, have: int | None, target: WeightManifest, ahead: _Ahead
    ) -> dict[str, _Plan]:
        if have is None:
            return {"full": self._full_plan(target, ahead.manifest)}
        plans: dict[str, _Plan] = {}
        chain: list[WeightManifest] = []
        m = target
        while m.base is not None and m.base >= have:
            chain.append(m)
            if m.base == have:
                plans["chain"] = _Plan("chain", None, chain[::-1])
                break
            try:
                m = ahead.manifest(m.base)
            except NotFoundError:
                break
        if "chain" in plans and len(chain) > 1:
            merged = ahead.merged()
            if merged is not None and merged.checksum == target.checksum and merged.base == have:
                plans["merged"] = _Plan("merged", None, [merged])
        # a full plan moves at least the tensors' own bytes, plus the target's delta when the
        # target is not a snapshot itself: no need to walk back to the last full snapshot (a
        # manifest, a round trip, per version) when a delta path moves fewer bytes than that
        if not plans or min(p.bytes for p in plans.values()) >= _full_plan_floor(target):
            plans["full"] = self._full_plan(target, ahead.manifest)
        return plans

    # -- moving bytes -------------------------------------------------------------------------

    def _download(
        self, plan: _Plan, work: _Scratch, ahead: _Ahead | None = None
    ) -> list[Path | None]:
        """The plan's files on disk, in order (None: a delta read ahead, applied from memory)."""
        jobs = []
        if plan.full is not None:
            jobs.append((plan.full, FULL_FILE))
        jobs += [(m, DELTA_FILE) for m in plan.deltas]
        if len(jobs) == 1:  # the usual refresh (one delta): no thread to start and join
            m, name = jobs[0]
            return [self._fetch_file(m, name, plan.path, work, f"0-{name}", ahead)]
        with ThreadPoolExecutor(min(4, len(jobs)), thread_name_prefix="weights-files") as pool:
            futures = [pool.submit(self._fetch_file, m, name, plan.path, work, f"{i}-{name}",
                                   ahead) for i, (m, name) in enumerate(jobs)]  # fmt: skip
            return [f.result() for f in futures]

    def _fetch_file(
        self,
        m: WeightManifest,
        name: str,
        path: Path_,
        work: _Scratch,
        dest: str,
        ahead: _Ahead | None = None,
    ) -> Path | None:
        entry = m.file(name)
        if ahead is not None and path == "chain" and name == DELTA_FILE:
            early = ahead.delta(m.version)  # requested with the manifests: checked like any
            if early is not None:
                if len(early.data) == entry.size and early.digest == entry.checksum:
                    early.verified = True  # applied from memory (_commit_early)
                    return None
                logger.warning("delta read ahead does not verify source=%s version=%d: "
                               "fetched again", self.source.url, m.version)  # fmt: skip
        vdir = (
            merged_dir(m.policy, m.base, m.version)
            if path == "merged" and m.base is not None
            else version_dir(m.policy, m.version)
        )
        what = f"policy {m.policy} version {m.version} file {name}"
        if path == "merged":
            what = f"policy {m.policy} merged v{m.base}->v{m.version} file {name}"
        return self._fetch_verified(f"{vdir}/{name}", entry.size, entry.checksum, work / dest, what)

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
    def _workdir(self) -> Iterator[_Scratch]:
        with self._lock:
            self._resumes = 0
        work = _Scratch(self.cache_dir)
        try:
            yield work
        finally:
            work.cleanup()

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
        self,
        plan: _Plan,
        paths: list[Path],
        tensors: MutableMapping[str, torch.Tensor],
        journal: Journal,
    ) -> None:
        if not plan.deltas:
            return
        composed: dict[str, TensorDelta] = compose_chain(
            plan.deltas, [p.read_bytes() for p in paths]
        )
        done: set[tuple[object, ...]] = set()
        for name, change in composed.items():
            t = tensors[name]
            key = _storage_key(t)
            if key in done:
                continue  # tied weights: one storage under two names, changed once
            done.add(key)
            journal.apply(t, change=change)

    def _commit_early(
        self,
        manifest: WeightManifest,
        early: _Early,
        tensors: MutableMapping[str, torch.Tensor],
        discard: Callable[[], int],
        check_base: Callable[[int], None],
    ) -> set[str]:
        """Finish the delta read ahead (its file verified): every tensor changed in place on
        the way must be at its published checksum; the tensors it did not change there (not
        on the CPU, on disk) get their change now, journaled (checked after, with the
        others, by ``_verify``). Returns the names verified already.

        A tensor off its checksum undoes every change; then the pull says whether the
        tensors did not hold the base version or the delta does not lead to its own.
        """
        for entry in manifest.tensors:
            digest = early.sums.get(entry.name)
            if digest is not None and digest != entry.checksum:
                discard()
                if self.verify_base and manifest.base is not None:
                    check_base(manifest.base)  # raises: they were not at the base
                raise ChecksumError(
                    f"{self.source.url}: policy {manifest.policy}: tensor {entry.name!r} "
                    f"checksum differs: the delta of version {manifest.version} does not lead "
                    f"the tensors there from version {manifest.base}; its changes were undone",
                    field=entry.name,
                )
        view = memoryview(early.data)
        written = set(early.keys)
        for entry in manifest.tensors:
            if entry.name in early.sums or entry.encoding == "same":
                continue
            t = tensors[entry.name]
            key = _storage_key(t)
            if key in written:
                continue  # tied weights: one storage under two names, changed once
            change = early.decoded.get(entry.name) or decode_entry(manifest, entry, view)
            early.journal.apply(t, change=change)
            written.add(key)
        return set(early.sums)

    def _verify_base(
        self,
        policy: str,
        have: int,
        tensors: MutableMapping[str, torch.Tensor],
        manifests: Manifests | None = None,
    ) -> None:
        try:
            base = manifests(have) if manifests is not None else self.manifest(policy, have)
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
        skip: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        for entry in target.tensors:
            if entry.name in skip:
                continue  # verified already (a staged copy, or unchanged since the base check)
            if checksum(tensors[entry.name]) != entry.checksum:
                state = "do not hold" if before else "did not end at"
                raise ChecksumError(
                    f"{self.source.url}: policy {target.policy}: tensor {entry.name!r} checksum "
                    f"differs: the tensors {state} version {target.version}"
                    + ("" if before else " (were they at the base version?)"),
                    field=entry.name,
                )


class _Scratch:
    """A pull's scratch directory, made on first use: a refresh applied from memory (the
    delta read ahead) writes no file, so it makes no directory (creating and removing one was
    a sixth of such a pull's CPU). ``work / name`` is a path in it (thread-safe)."""

    def __init__(self, parent: Path | None) -> None:
        self._parent = parent
        self._dir: Path | None = None
        self._lock = threading.Lock()

    def __truediv__(self, name: str) -> Path:
        with self._lock:
            if self._dir is None:
                if self._parent is not None:
                    self._parent.mkdir(parents=True, exist_ok=True)
                self._dir = Path(tempfile.mkdtemp(prefix="pull-", dir=self._parent))
            return self._dir / name

    def cleanup(self) -> None:
        """Remove the directory and what is in it (if it was made)."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _on_disk(local: list[Path | None]) -> list[Path]:
    """Files a plan fetched; every one must be on disk (only a single-delta read-ahead is
    applied from memory, and that path never comes here)."""
    files = [p for p in local if p is not None]
    if len(files) != len(local):
        raise AssertionError("a delta applied from memory was planned to be read from disk")
    return files


def _tensor_bytes(target: WeightManifest) -> int:
    """Bytes of the tensors themselves: no full snapshot of them is smaller."""
    return sum(e.numel * dtype_itemsize(e.dtype) for e in target.tensors)


def _full_plan_floor(target: WeightManifest) -> int:
    """Fewest bytes a full plan to ``target`` can move: a snapshot (no smaller than the
    tensors), and, when ``target`` is not a snapshot, every delta after it, ``target``'s own
    included (so a one-delta refresh never walks the chain back even when its delta is as
    large as the tensors: uncompressed fp32, where nearly every value changes)."""
    own = [f.size for f in target.files if f.name == DELTA_FILE and not target.full]
    return _tensor_bytes(target) + sum(own)


def _storage_key(t: torch.Tensor) -> tuple[object, ...]:
    """What two names of one tied weight share (one storage, same place and shape)."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))


class _Early:
    """A delta file read ahead: its bytes and their checksum (made as they arrived), the
    tensors changed in place on the way (journaled) and their checksums after, the changes
    decoded for tensors not changed on the way, and whether the bytes matched the manifest's
    checksum (only then is any of it kept)."""

    def __init__(self) -> None:
        self.data = b""
        self.digest = ""
        self.journal = Journal()
        self.decoded: dict[str, TensorDelta] = {}
        self.sums: dict[str, str] = {}
        """The checksum of each tensor changed in place, after (compared with the published
        one before the pull commits)."""
        self.keys: dict[tuple[object, ...], str] = {}
        """The storages changed in place, with their checksum (tied names share one)."""
        self.stopped = False
        """The streamed changes stopped (one failed or did not verify)."""
        self.verified = False

    def prepare(
        self, entry: TensorEntry, blob: bytes | memoryview, t: torch.Tensor | None, in_place: bool
    ) -> tuple[TensorEntry, torch.Tensor, kernels.Prepared] | None:
        """Parse ``entry``'s ``blob`` for an in-place change of ``t`` (``apply`` does it); a
        tensor that cannot be changed in place (not on the CPU, on disk) gets its change
        decoded only (None then, as for a tensor without a change)."""
        if t is None or entry.encoding is None or entry.encoding == "same":
            return None
        if dtype_name(t.dtype) != entry.dtype or tuple(t.shape) != entry.shape:
            return None  # the pull refuses it (_check_targets)
        itemsize = dtype_itemsize(entry.dtype)
        if not (in_place and t.device.type == "cpu" and t.is_contiguous()):
            self.decoded[entry.name] = codec.decode(entry.encoding, blob, entry.numel, itemsize)
            return None
        return entry, t, kernels.prepare(entry.encoding, blob, entry.numel, itemsize)

    def apply(self, entry: TensorEntry, t: torch.Tensor, prepared: kernels.Prepared) -> bool:
        """Change ``t`` in place (journaled) and checksum it; False when it did not end at
        its published checksum."""
        key = _storage_key(t)
        if key not in self.keys:  # tied weights: one storage under two names, changed once
            self.journal.apply(t, prepared=prepared)
            self.keys[key] = tensor_checksum(bits(t).data)
        self.sums[entry.name] = self.keys[key]
        return self.sums[entry.name] == entry.checksum


class _Stream:
    """Bytes of one file as they arrive: one thread appends, another waits for a range."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._cond = threading.Condition()
        self._ended = False

    def append(self, chunk: bytes) -> None:
        with self._cond:
            self._buf += chunk
            self._cond.notify_all()

    def end(self) -> None:
        """No more bytes will come (the file is whole, or its transfer failed)."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def read(self, lo: int, hi: int) -> bytes | None:
        """Bytes ``[lo, hi)`` once they are in; None when the file ended before ``hi``."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._buf) >= hi or self._ended)
            if len(self._buf) < hi:
                return None
            with memoryview(self._buf) as view:
                return bytes(view[lo:hi])

    def data(self) -> bytes:
        with self._cond:
            return bytes(self._buf)


class _Ahead:
    """What one pull asks for at once, before its plan needs it (one round trip, not one per
    request): the manifests of ``want``, ``have`` and up to 16 versions between, the merged
    delta's manifest when ``want > have + 1``, ``want``'s delta file when ``want == have + 1``
    (the next version: a node refreshing at every version; applied in place as it arrives,
    journaled), else the check that the tensors hold ``have`` (a checksum pass, done while
    the bytes travel). A request whose answer the plan does not use costs nothing but its
    bytes; a delta file read ahead is checked against its manifest like any download, and
    fetched again (resumably) when its early read failed, its changes undone first.
    """

    def __init__(
        self,
        client: WeightClient,
        pool: ThreadPoolExecutor,
        policy: str,
        have: int | None,
        want: int,
        tensors: MutableMapping[str, torch.Tensor],
    ) -> None:
        self.client, self.policy, self.want = client, policy, want
        self._manifests: dict[int, Future[WeightManifest]] = {}
        self._merged: Future[WeightManifest | None] | None = None
        self._delta: Future[_Early] | None = None
        self._base: Future[None] | None = None
        self._base_version = have
        self._tensors = tensors
        self._stop = threading.Event()
        get = client.manifest
        self._manifests[want] = pool.submit(get, policy, want)
        if have is None:
            return
        if want == have + 1:
            rel = f"{version_dir(policy, want)}/{DELTA_FILE}"
            what = f"policy {policy} version {want} file {DELTA_FILE}"
            self._delta = pool.submit(self._read_delta, rel, what)
        if client.verify_base and self._delta is None:  # (the read-ahead changes the tensors)
            self._manifests[have] = pool.submit(get, policy, have)
            self._base = pool.submit(client._verify_base, policy, have, tensors, self.manifest)
        if want > have + 1:
            self._merged = pool.submit(client.source.merged, policy, have, want)
        for version in range(want - 1, max(have, want - 1 - _AHEAD_CHAIN), -1):
            self._manifests[version] = pool.submit(get, policy, version)

    def manifest(self, version: int) -> WeightManifest:
        """The manifest of ``version`` (asked ahead, or now)."""
        future = self._manifests.get(version)
        if future is not None:
            return future.result()  # its own retries are done: its error is the pull's
        return self.client.manifest(self.policy, version)

    def merged(self) -> WeightManifest | None:
        """The merged delta ``have → want`` if the source offers one."""
        if self._merged is None:
            assert self._base_version is not None
            return self.client.source.merged(self.policy, self._base_version, self.want)
        return self._merged.result()

    def _read_delta(self, rel: str, what: str) -> _Early:
        """Read the next version's delta file as it arrives (hashing it on the way), while a
        second thread applies each tensor's change as soon as its bytes are in: the receiving
        never waits for the applying, which is done while the rest travels. The changes are
        kept only if the whole file verifies (``_commit_early``); a cut read undoes them."""
        early = _Early()
        stream = _Stream()
        decoder = threading.Thread(
            target=self._decode_stream, args=(stream, early), name="weights-decode", daemon=True
        )
        decoder.start()
        hasher = file_hasher()
        whole = False
        try:
            for chunk in self.client.source.chunks(rel, what):
                if self._stop.is_set():
                    raise TransferError(f"{what}: read ahead stopped (the pull failed)")
                hasher.update(chunk)
                stream.append(chunk)
            whole = True
        finally:
            stream.end()
            decoder.join()
            if not whole:
                early.journal.undo()
        early.data = stream.data()
        early.digest = hasher.hexdigest()
        return early

    def _decode_stream(self, stream: _Stream, early: _Early) -> None:
        """Prepare each tensor's change of the streamed delta (decompress, check), in file
        order, once its bytes are in (after the manifest says where they lie), for a second
        thread that applies it (``_apply_stream``): the two work on successive tensors at
        once. Stops at the first tensor that does not decode or verify: what is left is
        done from the verified file, or refused."""
        try:
            manifest = self._manifests[self.want].result()
        except Exception:  # the pull raises it itself
            return
        if manifest.base != self._base_version:
            return  # not the delta this pull needs: kept as bytes only
        in_place = not isinstance(self._tensors, SafetensorsFile)
        jobs: queue.Queue[tuple[TensorEntry, torch.Tensor, kernels.Prepared] | None]
        jobs = queue.Queue(maxsize=4)
        applier = threading.Thread(
            target=self._apply_stream, args=(jobs, early), name="weights-apply", daemon=True
        )
        applier.start()
        try:
            for entry in sorted(manifest.tensors, key=lambda e: e.offset):
                piece = stream.read(entry.offset, entry.offset + entry.length)
                if piece is None or self._stop.is_set() or early.stopped:
                    return
                try:
                    job = early.prepare(entry, piece, self._tensors.get(entry.name), in_place)
                except Exception as exc:  # done again (or refused) from the verified file
                    logger.debug("streamed delta stopped at tensor %r: %r", entry.name, exc)
                    return
                if job is not None:
                    jobs.put(job)
        finally:
            jobs.put(None)
            applier.join()

    @staticmethod
    def _apply_stream(
        jobs: queue.Queue[tuple[TensorEntry, torch.Tensor, kernels.Prepared] | None],
        early: _Early,
    ) -> None:
        """Apply the prepared changes in order; after the first that fails or does not verify,
        only drain the queue."""
        while (job := jobs.get()) is not None:
            if early.stopped:
                continue
            try:
                early.stopped = not early.apply(*job)  # off its checksum: the pull stops on it
            except Exception as exc:  # done again (or refused) from the verified file
                logger.debug("streamed delta stopped at tensor %r: %r", job[0].name, exc)
                early.stopped = True

    def delta(self, version: int) -> _Early | None:
        """``version``'s delta file if it was read ahead and arrived (else None: fetch it)."""
        if self._delta is None or version != self.want:
            return None
        try:
            return self._delta.result()
        except Exception as exc:  # the download proper retries and resumes
            logger.debug("delta v%d read ahead failed (%r): fetched again", version, exc)
            return None

    def early(self) -> _Early | None:
        """The delta file read ahead (its tensors changed), once its bytes verified."""
        if self._delta is None or not self._delta.done() or self._delta.exception():
            return None
        early = self._delta.result()
        return early if early.verified else None

    def check_base(self, have: int) -> None:
        """Raise ``ChecksumError`` unless the tensors hold ``have`` (checked ahead, or now)."""
        if have != self._base_version:
            raise AssertionError(f"base v{have} is not this pull's")
        if self._base is None:
            self.client._verify_base(self.policy, have, self._tensors, self.manifest)
        else:
            self._base.result()

    def discard(self) -> int:
        """Stop the read-ahead and the base check, wait for both (they touch the tensors),
        and undo the read-ahead's changes; how many were undone."""
        self._stop.set()
        if self._base is not None:
            with contextlib.suppress(Exception):
                self._base.result()
        if self._delta is None:
            return 0
        try:
            early = self._delta.result()
        except Exception:  # a failed read-ahead undid its changes itself
            return 0
        return early.journal.undo()
