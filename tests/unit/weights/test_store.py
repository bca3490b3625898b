"""WeightStore + WeightClient on a store directory: round trips, chains, retention, validation."""

from __future__ import annotations

import functools
import logging
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch

from astraflow.errors import ChecksumError, ConflictError, ValidationError
from astraflow.weights import WeightClient, WeightStore, WeightStoreConfig
from astraflow.weights import delta as codec
from astraflow.weights.journal import Journal
from astraflow.weights.manifest import (
    DELTA_FILE,
    FULL_FILE,
    MANIFEST_FILE,
    FileEntry,
    WeightManifest,
    delta_layout,
    file_checksum,
)
from astraflow.weights.tensors import SafetensorsFile, bits, checksum
from fixtures.weights import adam_states

State = dict[str, torch.Tensor]


@functools.cache
def _adam(dtype: str) -> list[State]:
    return adam_states(3, lr=1e-6, dtype=dtype)  # type: ignore[return-value]


def _perturbed_chain(n: int, fraction: float = 0.02, seed: int = 0) -> list[State]:
    """``n`` states of three bf16 tensors, each changing ``fraction`` of elements by a few ULP."""
    rng = np.random.default_rng(seed)
    state = {
        "a.weight": torch.randn(300, 200, generator=torch.Generator().manual_seed(seed)) * 0.02,
        "b.bias": torch.randn(1000) * 0.1,
        "c.norm": torch.ones(64),
    }
    states = [{k: v.to(torch.bfloat16) for k, v in state.items()}]
    for _ in range(n - 1):
        nxt = {k: v.clone() for k, v in states[-1].items()}
        for t in nxt.values():
            flat = bits(t)
            idx = rng.choice(flat.size, max(1, int(fraction * flat.size)), replace=False)
            flat[idx] += rng.integers(1, 3, idx.size).astype(np.uint16)
        states.append(nxt)
    return states


def _same(a: State, b: State) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(bits(a[k]), bits(b[k])) for k in a)


def _copy(state: State) -> State:
    return {k: v.clone() for k, v in state.items()}


def _publish_all(store: WeightStore, states: list[State], policy: str = "p") -> None:
    for version, state in enumerate(states):
        store.publish(policy, version, state).result(timeout=60)


@pytest.fixture(params=["disk", "http"])
def source(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Where a node pulls ``tmp_path`` from: the directory itself (the next version's delta
    is read and applied in the calling thread) or a weight server over loopback (it is
    streamed and applied as it arrives, by the read-ahead's threads)."""
    if request.param == "disk":
        yield str(tmp_path)
        return
    from astraflow.weights.server import serve_in_thread

    with serve_in_thread(tmp_path) as url:
        yield url


def _pull(source: str, node: State, have: int, want: int, **options: Any) -> None:
    with WeightClient(source, **options) as client:
        client.pull("p", node, have=have, want=want)


def _threads_started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the threads started from now on."""
    started: list[str] = []
    start = threading.Thread.start

    def counted(self: threading.Thread) -> None:
        started.append(self.name)
        start(self)

    monkeypatch.setattr(threading.Thread, "start", counted)
    return started


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_real_adam_steps_round_trip_bit_exact(tmp_path: Path, dtype: str) -> None:
    states = _adam(dtype)
    with WeightStore(tmp_path, WeightStoreConfig(full_every=10)) as store:
        manifests = [store.publish("p", v, s).result(timeout=60) for v, s in enumerate(states)]
    assert [m.full for m in manifests] == [True, False, False, False]
    for m, state in zip(manifests, states, strict=True):
        assert {t.name: t.checksum for t in m.tensors} == {k: checksum(v) for k, v in state.items()}
    client = WeightClient(tmp_path)
    for v, state in enumerate(states):
        assert _same(client.load("p", v), state)
    node = _copy(states[0])
    stats = client.pull("p", node, have=0, want=3)
    assert stats.path == "chain" and _same(node, states[3])
    if dtype == "bfloat16":  # an lr 1e-6 step leaves most bf16 elements bit-identical
        assert manifests[2].size_of(DELTA_FILE) < 0.25 * manifests[0].size_of(FULL_FILE)


def test_uncompressed_deltas_store_changed_tensors_raw_and_pull_bit_exact(tmp_path: Path) -> None:
    states = _adam("float32")
    states = [*states, _copy(states[-1])]  # a step that changes nothing: every tensor "same"
    config = WeightStoreConfig(full_every=10, compress_deltas=False)
    with WeightStore(tmp_path, config) as store:
        manifests = [store.publish("p", v, s).result(timeout=60) for v, s in enumerate(states)]
    assert {t.encoding for m in manifests[1:4] for t in m.tensors} == {"raw"}
    assert {t.encoding for t in manifests[4].tensors} == {"same"}
    raw_bytes = sum(t.numel() * t.element_size() for t in states[2].values())
    assert manifests[2].size_of(DELTA_FILE) == raw_bytes  # the new values, uncompressed
    client = WeightClient(tmp_path)
    for have in range(4):
        node = _copy(states[have])
        stats = client.pull("p", node, have=have, want=4)
        assert _same(node, states[4]), have
        assert stats.path in ("chain", "full")


def test_chain_of_ten_versions_with_full_every_four(tmp_path: Path) -> None:
    states = _perturbed_chain(11)
    with WeightStore(tmp_path, WeightStoreConfig(full_every=4, keep=100)) as store:
        _publish_all(store, states)
        assert [store.manifest("p", v).full for v in range(11)] == [v % 4 == 0 for v in range(11)]
        assert store.manifest("p", 4).base == 3  # a full version also carries its delta
    client = WeightClient(tmp_path)
    for have in range(10):
        node = _copy(states[have])
        stats = client.pull("p", node, have=have, want=10)
        assert _same(node, states[10]), have
        assert stats.bytes == min(stats.candidates.values())
    assert _same(client.load("p", 7), states[7])


@pytest.mark.parametrize("keep_first", [True, False])
def test_retention_never_deletes_a_needed_base(tmp_path: Path, keep_first: bool) -> None:
    states = _perturbed_chain(15)
    config = WeightStoreConfig(full_every=4, keep=3, keep_first=keep_first)
    first = [0] if keep_first else []
    with WeightStore(tmp_path, config) as store:
        for v, s in enumerate(states):
            store.publish("p", v, s).result(timeout=60)
            kept = store.files.versions("p")
            gap = keep_first and len(kept) > 1 and kept[1] != 1  # v0, then the chain
            chain = kept[1:] if gap else kept
            assert store.manifest("p", chain[0]).full, f"after v{v} the oldest kept is no full"
            assert chain == list(range(chain[0], v + 1))
            assert len(chain) >= min(v + 1, config.keep)
    assert store.files.versions("p") == [*first, 12, 13, 14]
    client = WeightClient(tmp_path)
    for v in (12, 13):
        node = _copy(states[v])
        client.pull("p", node, have=v, want=14)
        assert _same(node, states[14])
    assert not (tmp_path / "p" / "v00000011").exists()
    if keep_first:  # the start: loadable, and a node holding it catches up past the gap
        assert _same(client.load("p", 0), states[0])
        node = _copy(states[0])
        client.pull("p", node, have=0, want=14)
        assert _same(node, states[14])


def test_publish_copies_to_host_and_writes_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = WeightStore(tmp_path)
    gate = threading.Event()
    real_write = store.files.write

    def gated(rel: str, data: bytes | memoryview) -> None:
        gate.wait(timeout=30)
        real_write(rel, data)

    monkeypatch.setattr(store.files, "write", gated)
    source = {"w": torch.ones(1000, dtype=torch.bfloat16)}
    future = store.publish("p", 0, source)
    source["w"].fill_(5.0)  # the trainer's next step must not leak into the published version
    assert not future.done() and store.latest("p") is None
    gate.set()
    manifest = future.result(timeout=30)
    assert store.latest("p") == 0 and (tmp_path / "p/v00000000" / MANIFEST_FILE).is_file()
    assert manifest.tensors[0].checksum == checksum(torch.ones(1000, dtype=torch.bfloat16))
    store.close()


def test_publish_accepts_an_iterator_and_casts(tmp_path: Path) -> None:
    with WeightStore(tmp_path) as store:
        pairs = ((f"t{i}", torch.full((10,), float(i))) for i in range(3))
        manifest = store.publish("p", 0, pairs, dtype=torch.bfloat16).result(timeout=30)
    assert [(t.name, t.dtype) for t in manifest.tensors] == [
        (f"t{i}", "bfloat16") for i in range(3)
    ]


def test_publish_rejects_bad_input_without_writing(tmp_path: Path) -> None:
    with WeightStore(tmp_path) as store:
        store.publish("p", 3, {"w": torch.zeros(4)}).result(timeout=30)
        with pytest.raises(ConflictError, match="version 3 is not above published 3"):
            store.publish("p", 3, {"w": torch.zeros(4)})
        with pytest.raises(ValidationError, match="policy name"):
            store.publish("../evil", 0, {"w": torch.zeros(4)})
        with pytest.raises(ValidationError, match="is a list"):
            store.publish("q", 0, {"w": [1, 2]})  # type: ignore[dict-item]
        with pytest.raises(ValidationError, match="appears twice"):
            store.publish("q", 1, [("w", torch.zeros(1)), ("w", torch.zeros(1))])
    assert store.files.versions("p") == [3] and store.files.versions("q") == []


def test_shape_change_forces_a_full_snapshot(tmp_path: Path) -> None:
    with WeightStore(tmp_path) as store:
        store.publish("p", 0, {"w": torch.zeros(4)}).result(timeout=30)
        same = store.publish("p", 1, {"w": torch.ones(4)}).result(timeout=30)
        grown = store.publish("p", 2, {"w": torch.ones(5)}).result(timeout=30)
    assert (same.full, same.base) == (False, 0)
    assert (grown.full, grown.base) == (True, None)
    node = {"w": torch.ones(5)}
    with pytest.raises(ValidationError, match="published float32\\[5\\]"):
        WeightClient(tmp_path).pull("p", {"w": torch.ones(4)}, have=1, want=2)
    stats = WeightClient(tmp_path).pull("p", node, have=1, want=2)
    assert stats.path == "full"


def test_pull_refuses_tensors_that_do_not_hold_have(tmp_path: Path) -> None:
    states = _perturbed_chain(3)
    with WeightStore(tmp_path) as store:
        _publish_all(store, states)
    node = _copy(states[1])  # but we claim to have version 0
    before = _copy(node)
    with pytest.raises(ChecksumError, match="do not hold version 0"):
        WeightClient(tmp_path).pull("p", node, have=0, want=2)
    assert _same(node, before)


def test_streamed_delta_whose_middle_tensor_misleads_is_undone(tmp_path: Path, source: str) -> None:
    """The next version's delta is applied in place tensor by tensor (as it streams in from
    a server, or read whole from a disk); a tensor that does not end at its published
    checksum (its blob re-encoded to a different change, the file's own checksum made to
    match) stops the pull, and every change, the one verified before it included, is taken
    back: the tensors are bit for bit as before."""
    states = _perturbed_chain(2)
    with WeightStore(tmp_path) as store:
        _publish_all(store, states)
    vdir = tmp_path / "p/v00000001"
    manifest = WeightManifest.from_json((vdir / MANIFEST_FILE).read_bytes(), where="test")
    data = (vdir / DELTA_FILE).read_bytes()
    by_offset = sorted((e for e in manifest.tensors if e.length), key=lambda e: e.offset)
    assert [e.name for e in by_offset] == ["a.weight", "b.bias", "c.norm"]  # largest first
    blobs = {e.name: data[e.offset : e.offset + e.length] for e in by_offset}
    middle = by_offset[1]
    assert middle.encoding is not None
    change = codec.decode(middle.encoding, blobs[middle.name], middle.numel, 2)
    assert change.values is not None
    wrong = codec.TensorDelta("sparse", change.numel, 2, change.values + 1, change.pos)
    blobs[middle.name] = codec.encode(wrong)[1]
    tampered, offsets = delta_layout([blobs.get(e.name, b"") for e in manifest.tensors])
    entries = tuple(
        e.model_copy(update={"offset": o, "length": len(blobs.get(e.name, b""))})
        for e, o in zip(manifest.tensors, offsets, strict=True)
    )
    files = (FileEntry(name=DELTA_FILE, size=len(tampered), checksum=file_checksum(tampered)),)
    (vdir / DELTA_FILE).write_bytes(tampered)
    rewritten = manifest.model_copy(update={"tensors": entries, "files": files})
    (vdir / MANIFEST_FILE).write_bytes(rewritten.to_json())
    node = _copy(states[0])
    before = _copy(node)
    with pytest.raises(ChecksumError, match="'b.bias'.*from version 0; its changes were undone"):
        _pull(source, node, 0, 1)
    assert _same(node, before)


def _crash_on_second_change(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the second (and every later) in-place change of a pull raise, as a crash inside
    the apply would; returns the count of changes tried."""
    tried: list[int] = []
    apply = Journal.apply

    def crashing(self: Journal, t: torch.Tensor, **kw: object) -> None:
        tried.append(1)
        if len(tried) >= 2:
            raise RuntimeError("crash while applying")
        apply(self, t, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Journal, "apply", crashing)
    return tried


@pytest.mark.parametrize(("have", "want"), [(1, 2), (0, 2)])
def test_crash_mid_apply_leaves_the_tensors_at_have(
    tmp_path: Path,
    source: str,
    have: int,
    want: int,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Streamed in place (want = have + 1) or composed after the download (a chain): a crash
    after the first tensor changed takes that change back; the next pull goes through."""
    states = _perturbed_chain(3)
    with WeightStore(tmp_path) as store:
        _publish_all(store, states)
    node = _copy(states[have])
    caplog.set_level(logging.INFO, logger="astraflow.weights.client")
    tried = _crash_on_second_change(monkeypatch)
    with pytest.raises(RuntimeError, match="crash while applying"):
        _pull(source, node, have, want)
    assert len(tried) >= 2 and "1 changes undone" in caplog.text
    assert _same(node, states[have])
    monkeypatch.undo()
    _pull(source, node, have, want)
    assert _same(node, states[want])


def test_corrupt_delta_file_read_ahead_is_undone(
    tmp_path: Path, source: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The next version's delta is applied as it streams in, before its file is verified: a
    file whose last tensor's bytes are corrupt fails its checksum, and the tensors changed
    from its first bytes are restored bit for bit. (Read whole from a disk, it is checked
    before anything is applied, and fetched again by the general path, which refuses it.)"""
    states = _perturbed_chain(2)
    with WeightStore(tmp_path) as store:
        _publish_all(store, states)
    vdir = tmp_path / "p/v00000001"
    manifest = WeightManifest.from_json((vdir / MANIFEST_FILE).read_bytes(), where="test")
    last = max(manifest.tensors, key=lambda e: e.offset)
    data = bytearray((vdir / DELTA_FILE).read_bytes())
    data[last.offset + last.length // 2] ^= 0xFF
    (vdir / DELTA_FILE).write_bytes(bytes(data))
    node = _copy(states[0])
    caplog.set_level(logging.INFO, logger="astraflow.weights.client")
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        _pull(source, node, 0, 1, retries=0)
    assert "changes undone" in caplog.text
    assert _same(node, states[0])
    if source == str(tmp_path):
        assert "delta does not verify" in caplog.text


def test_load_copies_tensors_out_of_its_temporary_file(tmp_path: Path) -> None:
    states = _perturbed_chain(2)
    with WeightStore(tmp_path / "store") as store:
        _publish_all(store, states)
    cache = tmp_path / "cache"
    tensors = WeightClient(tmp_path / "store", cache_dir=cache).load("p", 1)
    assert _same(tensors, states[1])
    maps = Path("/proc/self/maps")
    if maps.exists():  # no mapping of the (deleted) downloaded file outlives load()
        assert str(cache) not in maps.read_text()


def test_live_model_with_tied_weights_is_updated_in_place(tmp_path: Path) -> None:
    from astraflow.models import build_model
    from fixtures.models import tiny_spec

    trainer = build_model(tiny_spec(hidden=32, seed=1))
    with WeightStore(tmp_path) as store:
        store.publish("p", 0, trainer.state_dict(), dtype=torch.bfloat16).result(timeout=30)
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 1e-2)
        store.publish("p", 1, trainer.state_dict(), dtype=torch.bfloat16).result(timeout=30)
    node = build_model(tiny_spec(hidden=32, seed=1)).to(torch.bfloat16)
    live = node.state_dict()
    embed = node.get_input_embeddings().weight
    assert live["lm_head.weight"].data_ptr() == embed.data_ptr()  # tied: one storage, two names
    client = WeightClient(tmp_path)
    client.pull("p", live, have=0, want=1)
    expected = client.load("p", 1)
    assert _same(dict(node.state_dict()), expected)
    assert node.get_input_embeddings().weight.data_ptr() == embed.data_ptr()  # in place


def test_pull_into_a_safetensors_file_on_disk(tmp_path: Path) -> None:
    states = _perturbed_chain(4)
    with WeightStore(tmp_path / "store") as store:
        _publish_all(store, states)
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(states[1], str(path))
    mapped = SafetensorsFile(path)  # the tensors of the file on disk, updated in place
    try:
        WeightClient(tmp_path / "store").pull("p", mapped, have=1, want=3)
    finally:
        mapped.close()
    assert _same(safetensors.torch.load_file(str(path)), states[3])


def test_fsspec_url_as_store_root() -> None:
    states = _perturbed_chain(3)
    url = "memory://weights-test-root"
    with WeightStore(url, WeightStoreConfig(full_every=2)) as store:
        _publish_all(store, states)
    client = WeightClient(url)
    assert client.latest("p") == 2
    node = _copy(states[0])
    client.pull("p", node, have=0, want=2)
    assert _same(node, states[2]) and _same(client.load("p", 1), states[1])


def test_cli_ls_and_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from astraflow.cli.main import main

    with WeightStore(tmp_path, WeightStoreConfig(full_every=2)) as store:
        _publish_all(store, _perturbed_chain(3))
    assert main(["weights", "ls", "--source", str(tmp_path), "p"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[:2] for line in listing] == [
        ["v2", "full+delta"],
        ["v1", "delta"],
        ["v0", "full"],
    ]
    assert main(["weights", "verify", "--source", str(tmp_path), "p", "--version", "1"]) == 0
    assert "v1: 3 tensors verified" in capsys.readouterr().out
    (tmp_path / "p/v00000001" / DELTA_FILE).write_bytes(b"garbage")
    assert main(["weights", "verify", "--source", str(tmp_path), "p", "--version", "1"]) == 2
    assert "checksum mismatch" in capsys.readouterr().err
    for action in ("ls", "verify"):  # a path with no store is named, not "no versions"
        assert main(["weights", action, "--source", str(tmp_path / "nope"), "p"]) != 0
        assert f"{tmp_path / 'nope'}: no weight store there" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_pull_into_cuda_tensors(tmp_path: Path) -> None:
    states = _perturbed_chain(4)
    with WeightStore(tmp_path, WeightStoreConfig(full_every=2)) as store:
        _publish_all(store, states)
    node = {k: v.to("cuda") for k, v in states[0].items()}
    pointers = {k: v.data_ptr() for k, v in node.items()}
    client = WeightClient(tmp_path)
    assert client.pull("p", node, have=0, want=1).path == "chain"
    assert client.pull("p", node, have=1, want=3).path in ("chain", "full")
    assert {k: v.data_ptr() for k, v in node.items()} == pointers  # in place, on the device
    assert _same({k: v.cpu() for k, v in node.items()}, states[3])


def test_a_refresh_from_memory_makes_no_scratch_dir_and_a_download_leaves_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    states = _perturbed_chain(3)
    with WeightStore(tmp_path / "store") as store:
        _publish_all(store, states)
    cache = tmp_path / "cache"
    made: list[str] = []
    mkdtemp = tempfile.mkdtemp

    def counted(*args: Any, **kwargs: Any) -> str:
        made.append(mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", counted)
    client = WeightClient(tmp_path / "store", cache_dir=cache)
    node = _copy(states[1])
    stats = client.pull("p", node, have=1, want=2)  # one delta, read ahead: applied from memory
    assert stats.path == "chain" and _same(node, states[2]) and made == []
    node = _copy(states[0])
    client.pull("p", node, have=None, want=2)  # a download: files in a scratch dir, removed
    assert _same(node, states[2]) and len(made) == 1 and Path(made[0]).parent == cache
    assert list(cache.iterdir()) == []


def test_the_next_version_on_a_local_disk_is_pulled_in_the_calling_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node refreshing version by version from a store on its own disk starts no thread:
    the delta is read whole, checked and applied in place here, a snapshot version included
    (it carries its delta too), bit-exact; a pull of several versions, or over HTTP, still
    goes through the read-ahead's threads."""
    from astraflow.weights import kernels
    from astraflow.weights.server import serve_in_thread

    kernels.warm(wait=True)
    states = _perturbed_chain(6)
    with WeightStore(tmp_path, WeightStoreConfig(full_every=4, keep=100)) as store:
        _publish_all(store, states)
        assert store.manifest("p", 4).full
    client = WeightClient(tmp_path)
    node = _copy(states[1])
    started = _threads_started(monkeypatch)
    for want in range(2, 6):
        stats = client.pull("p", node, have=want - 1, want=want)
        assert _same(node, states[want]) and stats.path == "chain" and stats.files == 1
        assert stats.bytes == client.manifest("p", want).size_of(DELTA_FILE)
    assert started == []
    node = _copy(states[1])
    client.pull("p", node, have=1, want=5)
    assert _same(node, states[5]) and started
    node = _copy(states[4])
    with serve_in_thread(tmp_path) as url:
        started.clear()  # (not the server's own threads)
        _pull(url, node, 4, 5)
    assert _same(node, states[5]) and any(name.startswith("weights-") for name in started)
