"""Pulls over a real HTTP weight server on loopback: paths, resume, corruption, failure bounds."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from astraflow.errors import ChecksumError, TransferError, TransferTimeoutError
from astraflow.weights import WeightClient, WeightStore, WeightStoreConfig
from astraflow.weights.manifest import DELTA_FILE, FULL_FILE
from astraflow.weights.tensors import bits
from astraflow.weights.transfer import TransferOptions
from fixtures.net import free_port
from fixtures.weights import CuttingProxy, SilentServer

State = dict[str, torch.Tensor]


def _states(
    n: int,
    *,
    size: int = 200_000,
    fraction: float = 0.02,
    overlap: bool = False,
    noise: bool = False,
) -> list[State]:
    """bf16 states; with ``overlap`` every step changes the same few positions (merges shrink);
    with ``noise`` the changed elements get random bits (incompressible) instead of +1 ULP."""
    rng = np.random.default_rng(0)
    first = {"w": (torch.randn(size, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()}
    fixed = rng.choice(size, int(fraction * size), replace=False)
    states = [first]
    for _ in range(n - 1):
        nxt = {k: v.clone() for k, v in states[-1].items()}
        flat = bits(nxt["w"])
        idx = fixed if overlap else rng.choice(size, int(fraction * size), replace=False)
        if noise:
            flat[idx] = rng.integers(0, 2**16, idx.size).astype(np.uint16)
        else:
            flat[idx] += np.uint16(1)
        states.append(nxt)
    return states


def _same(a: State, b: State) -> bool:
    return all(np.array_equal(bits(a[k]), bits(b[k])) for k in b)


def _copy(state: State) -> State:
    return {k: v.clone() for k, v in state.items()}


def _publish(root: Path, states: list[State], **config: Any) -> WeightStore:
    store = WeightStore(root, WeightStoreConfig(**config))
    for v, s in enumerate(states):
        store.publish("p", v, s).result(timeout=60)
    return store


def test_node_five_behind_takes_the_cheapest_path(weight_root: Path, weight_server: str) -> None:
    states = _states(9, overlap=True)
    _publish(weight_root, states, full_every=4, keep=100).close()
    with WeightClient(weight_server) as client:
        node = _copy(states[2])
        stats = client.pull("p", node, have=2, want=7)
    # a delta path smaller than the tensors themselves: the full path (a walk back to the last
    # full snapshot, a manifest per version) is not even planned, a full file is never smaller
    assert set(stats.candidates) == {"chain", "merged"}
    assert stats.candidates["chain"] < sum(t.numel() * t.element_size() for t in node.values())
    assert stats.path == "merged"  # the same elements changed each step: one merged delta wins
    assert stats.bytes == min(stats.candidates.values()) < stats.candidates["chain"]
    assert _same(node, states[7])
    # the merged delta was cached in the store, next to the versions
    assert (weight_root / "p/merged/v00000002-v00000007" / DELTA_FILE).is_file()
    # through a plain store (no server to merge), the chain is cheapest for a node 5 behind
    local = WeightClient(weight_root)
    node = _copy(states[2])
    stats = local.pull("p", node, have=2, want=7)
    assert (stats.path, set(stats.candidates)) == ("chain", {"chain"})
    assert stats.bytes == min(stats.candidates.values()) and _same(node, states[7])


def test_dense_changes_make_the_full_snapshot_cheapest(
    weight_root: Path, weight_server: str
) -> None:
    states = _states(9, fraction=0.6, noise=True)
    _publish(weight_root, states, full_every=4, keep=100).close()
    with WeightClient(weight_root) as client:  # a plain store: chain or full
        node = _copy(states[2])
        stats = client.pull("p", node, have=2, want=8)
    assert stats.path == "full" and stats.bytes == min(stats.candidates.values())
    assert stats.candidates["full"] == (weight_root / "p/v00000008" / FULL_FILE).stat().st_size
    assert _same(node, states[8])
    with WeightClient(weight_server) as client:
        node = _copy(states[2])
        stats = client.pull("p", node, have=2, want=8)
    assert stats.bytes == min(stats.candidates.values()) and _same(node, states[8])


def test_pull_resumes_after_the_connection_is_cut(weight_root: Path, weight_server: str) -> None:
    states = _states(1, size=3_000_000)  # a 6 MB full snapshot
    _publish(weight_root, states).close()
    port = int(weight_server.rsplit(":", 1)[1])
    proxy = CuttingProxy(("127.0.0.1", port), cuts=3, after=700_000)
    try:
        options = TransferOptions(streams=2, retries=3, split_bytes=1 << 20)
        node = {"w": torch.zeros_like(states[0]["w"])}
        with WeightClient(proxy.url, options=options) as client:
            stats = client.pull("p", node, have=None, want=0)
    finally:
        proxy.close()
    assert proxy.cut_done >= 1 and stats.resumes >= 1
    assert _same(node, states[0])


def test_corrupt_byte_is_detected_and_never_applied(weight_root: Path, weight_server: str) -> None:
    states = _states(3)
    _publish(weight_root, states).close()
    path = weight_root / "p/v00000002" / DELTA_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    node = _copy(states[1])
    before = _copy(node)
    with pytest.raises(ChecksumError) as info, WeightClient(weight_server, retries=1) as client:
        client.pull("p", node, have=1, want=2)
    assert weight_server in str(info.value) and "version 2" in str(info.value)
    assert DELTA_FILE in str(info.value)
    assert _same(node, before)


def test_damaged_transfer_is_retried(
    weight_root: Path, weight_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    states = _states(1)
    _publish(weight_root, states).close()
    size = (weight_root / "p/v00000000" / FULL_FILE).stat().st_size
    port = int(weight_server.rsplit(":", 1)[1])
    # the first connection delivers one flipped byte in the file body (past the HTTP headers)
    proxy = CuttingProxy(("127.0.0.1", port), corrupt=1, corrupt_at=size // 2)
    try:
        node = {"w": torch.zeros_like(states[0]["w"])}
        with WeightClient(proxy.url, streams=1) as client:
            client.pull("p", node, have=None, want=0)
    finally:
        proxy.close()
    assert "checksum mismatch" in caplog.text  # the damaged copy was refused, fetched again
    assert _same(node, states[0])


def test_next_delta_read_ahead_is_verified_and_fetched_again_when_damaged(
    weight_root: Path, weight_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    states = _states(3, size=3_000_000)
    _publish(weight_root, states).close()
    size = (weight_root / "p/v00000002" / DELTA_FILE).stat().st_size
    port = int(weight_server.rsplit(":", 1)[1])
    # the connections the pull opens at once (manifests, the delta read ahead) each get one
    # flipped byte past the small manifests: only the delta's bytes reach that offset
    proxy = CuttingProxy(("127.0.0.1", port), corrupt=3, corrupt_at=size // 2)
    try:
        node = _copy(states[1])
        with WeightClient(proxy.url) as client:
            stats = client.pull("p", node, have=1, want=2)
    finally:
        proxy.close()
    assert "delta read ahead does not verify" in caplog.text
    assert stats.path == "chain" and _same(node, states[2])
    with WeightClient(weight_server) as client:  # undamaged: the read-ahead bytes are applied
        node = _copy(states[1])
        client.pull("p", node, have=1, want=2)
    assert _same(node, states[2])


def test_dead_server_fails_fast_naming_source_version_file() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    node = {"w": torch.zeros(10)}
    started = time.monotonic()
    with pytest.raises(TransferError) as info, WeightClient(url, retries=2, timeout_s=5) as c:
        c.pull("p", node, have=0, want=3)
    assert time.monotonic() - started < 6
    assert url in str(info.value) and "version 3" in str(info.value)
    assert "manifest.json" in str(info.value)


def test_stalled_server_times_out_within_its_bound(silent_server: SilentServer) -> None:
    started = time.monotonic()
    client = WeightClient(silent_server.url, stall_s=0.5, timeout_s=2, retries=5)
    with pytest.raises(TransferTimeoutError) as info, client:
        client.pull("p", {"w": torch.zeros(1)}, have=0, want=4)
    assert time.monotonic() - started < 4
    message = str(info.value)
    assert silent_server.url in message and "version 4" in message and "no progress" in message


def test_concurrent_publish_while_a_node_pulls(weight_root: Path, weight_server: str) -> None:
    states = _states(12)
    store = WeightStore(weight_root, WeightStoreConfig(full_every=5, keep=100))
    store.publish("p", 0, states[0]).result(timeout=30)

    def trainer() -> None:
        for v in range(1, len(states)):
            store.publish("p", v, states[v]).result(timeout=30)
            time.sleep(0.02)

    thread = threading.Thread(target=trainer)
    thread.start()
    client = WeightClient(weight_server)
    node, have, seen = _copy(states[0]), 0, set()
    deadline = time.monotonic() + 60
    while have < len(states) - 1 and time.monotonic() < deadline:
        stats = client.pull("p", node, have=have, want=client.latest("p"))
        have = stats.want
        seen.add(have)
        assert _same(node, states[have])
    thread.join(timeout=60)
    store.close()
    client.close()
    assert have == len(states) - 1 and len(seen) >= 2


def test_assets_travel_with_their_checksums(
    weight_root: Path, weight_server: str, tmp_path: Path
) -> None:
    from astraflow.models import build_model, build_tokenizer
    from fixtures.models import tiny_spec

    spec = tiny_spec()
    src = tmp_path / "src"
    build_model(spec).config.save_pretrained(src)
    build_tokenizer(spec).save_pretrained(src)
    with WeightStore(weight_root) as store:
        store.publish_assets("p", src)
    with WeightClient(weight_server) as client:
        dest = client.fetch_assets("p", tmp_path / "dest")
    names = sorted(p.name for p in src.iterdir())
    assert "config.json" in names and sorted(p.name for p in dest.iterdir()) == names
    for name in names:
        assert (dest / name).read_bytes() == (src / name).read_bytes()


def test_cli_serve_runs_as_a_process(weight_root: Path) -> None:
    states = _states(2)
    _publish(weight_root, states).close()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "astraflow.cli.main", "weights", "serve",
         "--root", str(weight_root), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        node = _copy(states[0])
        with WeightClient(f"http://127.0.0.1:{port}", retries=8, timeout_s=30) as client:
            assert client.pull("p", node, have=0).want == 1 and _same(node, states[1])
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode in (0, -signal.SIGTERM), out


def test_a_one_delta_refresh_never_walks_back_to_the_snapshot(weight_root: Path) -> None:
    """Uncompressed fp32 deltas where every value changes (the quickstart's store) are as large
    as the tensors; a full plan would still move a snapshot plus the target's own delta, so a
    node one version behind takes the delta without reading the manifests back to the last
    snapshot (a read each, a round trip each over HTTP). Two behind, a snapshot could win."""
    gen = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(50_000, generator=gen)}]
    for _ in range(7):
        states.append({"w": states[-1]["w"] + torch.randn(50_000, generator=gen) * 1e-3})
    _publish(weight_root, states, full_every=4, keep=100, compress_deltas=False).close()
    with WeightClient(weight_root) as client:
        asked: list[int] = []
        manifest = client.manifest

        def counted(policy: str, version: int) -> Any:
            asked.append(version)
            return manifest(policy, version)

        client.manifest = counted  # type: ignore[method-assign]
        node = _copy(states[5])
        stats = client.pull("p", node, have=5, want=6)
        assert (stats.path, set(stats.candidates)) == ("chain", {"chain"})
        assert _same(node, states[6]) and 4 not in asked  # the snapshot's manifest: not read
        node = _copy(states[5])
        stats = client.pull("p", node, have=5, want=7)
        assert set(stats.candidates) == {"chain", "full"}
        assert stats.bytes == min(stats.candidates.values()) and _same(node, states[7])
