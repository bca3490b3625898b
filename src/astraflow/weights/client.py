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
      apply:  compose the deltas, write each tensor once in place (CPU or device)
      verify: every tensor's checksum equals the one published for `want`

Over a slow link every request costs a round trip, so a pull by one delta takes one round
trip (manifests and file requested together) plus the file's bytes, instead of one per
manifest, then one for the file. Nothing is written into ``tensors`` before every downloaded
byte is verified, so a failed pull leaves the node on its current version.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import numpy.typing as npt
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
    TensorEntry,
    WeightManifest,
    dtype_itemsize,
    file_checksum,
    manifest_ref,
    merged_dir,
    version_dir,
)
from astraflow.weights.merge import compose_chain, decode_entry
from astraflow.weights.tensors import apply_delta, bits, checksum, dtype_name
from astraflow.weights.transfer import Source, TransferOptions, open_source

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
        pool = ThreadPoolExecutor(_AHEAD_WORKERS, thread_name_prefix="weights-ahead")
        try:
            ahead = _Ahead(self, pool, policy, have, target_version, tensors)
            target = ahead.manifest(target_version)
            self._check_targets(target, tensors)
            plans = self._plans(policy, have, target, ahead)
            plan = min(
                plans.values(),
                key=lambda p: (p.bytes, ("merged", "chain", "full").index(p.path)),
            )
            with self._workdir() as work:
                local = self._download(plan, work, ahead)
                if plan.path == "full":
                    ahead.settle()  # nothing may still read the tensors once they change
                    self._copy_full(plan, local.pop(0), tensors)
                elif self.verify_base:
                    ahead.check_base(plan.deltas[0].base or 0)
                self._apply_deltas(plan, local, tensors, ahead.early())
        finally:  # a failed pull does not wait for requests it no longer needs
            pool.shutdown(wait=False, cancel_futures=True)
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
        # a full plan moves at least the tensors' own bytes: no need to walk back to the last
        # full snapshot (a manifest, a round trip, per version) when a delta path is smaller
        if not plans or min(p.bytes for p in plans.values()) >= _tensor_bytes(target):
            plans["full"] = self._full_plan(target, ahead.manifest)
        return plans

    # -- moving bytes -------------------------------------------------------------------------

    def _download(self, plan: _Plan, work: Path, ahead: _Ahead | None = None) -> list[Path]:
        jobs = []
        if plan.full is not None:
            jobs.append((plan.full, FULL_FILE))
        jobs += [(m, DELTA_FILE) for m in plan.deltas]
        if len(jobs) == 1:  # the usual refresh (one delta): no thread to start and join
            m, name = jobs[0]
            return [self._fetch_file(m, name, plan.path, work / f"0-{name}", ahead)]
        with ThreadPoolExecutor(min(4, len(jobs)), thread_name_prefix="weights-files") as pool:
            futures = [pool.submit(self._fetch_file, m, name, plan.path, work / f"{i}-{name}",
                                   ahead) for i, (m, name) in enumerate(jobs)]  # fmt: skip
            return [f.result() for f in futures]

    def _fetch_file(
        self, m: WeightManifest, name: str, path: Path_, dest: Path, ahead: _Ahead | None = None
    ) -> Path:
        entry = m.file(name)
        if ahead is not None and path == "chain" and name == DELTA_FILE:
            early = ahead.delta(m.version)  # requested with the manifests: checked like any
            if early is not None:
                if len(early.data) == entry.size and file_checksum(early.data) == entry.checksum:
                    early.verified = True  # applied from memory (_apply_deltas)
                    return dest
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
        self,
        plan: _Plan,
        paths: list[Path],
        tensors: MutableMapping[str, torch.Tensor],
        early: _Early | None = None,
    ) -> None:
        if not plan.deltas:
            return
        if plan.path != "chain" or len(plan.deltas) != 1:
            early = None  # read ahead: the one delta file of the next version only
        blobs = [early.data] if early is not None else [p.read_bytes() for p in paths]
        decoded = early.decoded if early is not None else None
        composed: dict[str, TensorDelta] = compose_chain(plan.deltas, blobs, decoded)
        done: set[tuple[object, ...]] = set()
        for name, change in composed.items():
            t = tensors[name]
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key in done:
                continue  # tied weights: one storage under two names, changed once
            done.add(key)
            new = early.new_values.get(name) if early is not None else None
            if (
                new is not None
                and change.pos is not None
                and decoded is not None
                and (decoded.get(name) is change)
            ):
                bits(t)[change.pos] = new  # the sums were made while the bytes travelled
            else:
                apply_delta(t, change)

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


def _tensor_bytes(target: WeightManifest) -> int:
    """Bytes of the tensors themselves: no full snapshot of them is smaller."""
    return sum(e.numel * dtype_itemsize(e.dtype) for e in target.tensors)


class _Early:
    """A delta file read ahead: its bytes, the tensors decoded from them on the way, and
    whether the bytes matched the manifest's checksum (only then are the tensors used)."""

    def __init__(self) -> None:
        self.data = b""
        self.decoded: dict[str, TensorDelta] = {}
        self.new_values: dict[str, npt.NDArray[Any]] = {}
        """Per sparse change of a CPU tensor: its new values at the changed positions, read
        and summed while the rest of the file travels (only written once it verified)."""
        self.verified = False

    def prepare(self, name: str, change: TensorDelta, t: torch.Tensor | None) -> None:
        """Sum ``t``'s old values and the change at its positions (reads only)."""
        if t is None or t.device.type != "cpu" or not t.is_contiguous():
            return
        if change.kind != "sparse" or change.pos is None or change.values is None:
            return
        flat = bits(t)
        if flat.size == change.numel and flat.dtype == change.values.dtype:
            self.new_values[name] = flat[change.pos] + change.values


class _Ahead:
    """What one pull asks for at once, before its plan needs it (one round trip, not one per
    request): the manifests of ``want``, ``have`` and up to 16 versions between, the merged
    delta's manifest when ``want > have + 1``, ``want``'s delta file when ``want == have + 1``
    (the next version: a node refreshing at every version), and the check that the tensors
    hold ``have`` (a checksum pass, done while the bytes travel). A request whose answer the
    plan does not use costs nothing but its bytes; a delta file read ahead is checked against
    its manifest like any download, and fetched again (resumably) when its early read failed.
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
        get = client.manifest
        self._manifests[want] = pool.submit(get, policy, want)
        if have is None:
            return
        if want == have + 1:
            rel = f"{version_dir(policy, want)}/{DELTA_FILE}"
            what = f"policy {policy} version {want} file {DELTA_FILE}"
            self._delta = pool.submit(self._read_delta, rel, what)
        if client.verify_base:
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
        """Read the next version's delta file as it arrives, decoding each tensor's change as
        soon as its bytes are in (once the manifest says where they lie): the decoding work
        is done while the rest travels. Nothing is applied before the whole file verifies."""
        early = _Early()
        buf = bytearray()
        pending: list[TensorEntry] | None = None
        target = self._manifests[self.want]
        for chunk in self.client.source.chunks(rel, what):
            buf += chunk
            if pending is None and target.done() and target.exception() is None:
                manifest = target.result()
                if manifest.base != self._base_version:
                    continue  # not the delta this pull needs: kept as bytes only
                pending = sorted(manifest.tensors, key=lambda e: e.offset)[::-1]
            while pending and pending[-1].offset + pending[-1].length <= len(buf):
                entry = pending.pop()
                try:
                    piece = bytes(buf[entry.offset : entry.offset + entry.length])
                    relative = entry.model_copy(update={"offset": 0})
                    change = decode_entry(target.result(), relative, piece)
                    early.decoded[entry.name] = change
                    early.prepare(entry.name, change, self._tensors.get(entry.name))
                except (ChecksumError, ValidationError):  # decoded again once verified
                    pending = []
        early.data = bytes(buf)
        return early

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
        """The delta file read ahead (its tensors decoded), once its bytes verified."""
        if self._delta is None or not self._delta.done() or self._delta.exception():
            return None
        early = self._delta.result()
        return early if early.verified else None

    def check_base(self, have: int) -> None:
        """Raise ``ChecksumError`` unless the tensors held ``have`` (checked ahead)."""
        if self._base is None or have != self._base_version:
            raise AssertionError(f"base v{have} was not checked ahead")
        self._base.result()

    def settle(self) -> None:
        """Wait for the base check (it reads the tensors), whatever it found."""
        if self._base is not None:
            with contextlib.suppress(Exception):
                self._base.result()
