"""The regional weight relay, over real HTTP on loopback behind an emulated WAN link: it serves
bit-exact versions, pulls each version once however many nodes ask, resumes a cut transfer,
refuses corrupt upstream data, and fails loud naming the upstream when the WAN is down."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from pydantic import SecretStr

from astraflow.errors import AuthError, ChecksumError, TransferError
from astraflow.link import Link, LinkConfig
from astraflow.weights import WeightClient, WeightStore, WeightStoreConfig
from astraflow.weights.access import WeightsAuthConfig
from astraflow.weights.manifest import DELTA_FILE
from astraflow.weights.relay import RelayError, WeightRelay, serve_relay, wait_for_upstream
from astraflow.weights.server import WeightServerConfig, serve_in_thread
from astraflow.weights.tensors import bits
from astraflow.weights.transfer import TransferOptions
from fixtures.weights import CuttingProxy

State = dict[str, torch.Tensor]
FAST = TransferOptions(retries=1, timeout_s=30.0, stall_s=5.0)


def _states(n: int, size: int = 400_000) -> list[State]:
    """bf16 states; each step changes 2% of the elements by one ULP."""
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    states = [{"w": (torch.randn(size, generator=gen) * 0.02).bfloat16(),
               "b": torch.randn(64, generator=gen).bfloat16()}]  # fmt: skip
    for _ in range(n - 1):
        nxt = {k: v.clone() for k, v in states[-1].items()}
        flat = bits(nxt["w"])
        flat[rng.choice(size, size // 50, replace=False)] += np.uint16(1)
        states.append(nxt)
    return states


def _same(a: State, b: State) -> bool:
    return all(np.array_equal(bits(a[k]), bits(b[k])) for k in b)


def _zeros(state: State) -> State:
    return {k: torch.zeros_like(v) for k, v in state.items()}


@dataclass
class Region:
    """An upstream store, a WAN link to it, and a relay serving the region."""

    store: WeightStore
    upstream_root: Path
    upstream: str
    link: Link
    relay: WeightRelay
    url: str


@pytest.fixture
def region(tmp_path: Path) -> Iterator[Region]:
    root = tmp_path / "upstream"
    store = WeightStore(root, WeightStoreConfig(full_every=100))
    with serve_in_thread(root) as upstream:
        link = Link.for_urls(LinkConfig(delay_ms=2), {"weights": upstream})
        link.start()
        relay = WeightRelay(link.url("weights"), tmp_path / "relay", options=FAST)
        server = serve_relay(relay)
        try:
            yield Region(store, root, upstream, link, relay, server.start())
        finally:
            server.stop()
            relay.close()
            link.close()
            store.close()


def _wan_down(link: Link) -> int:
    return sum(link.stats.down.values())


def _pull_all(url: str, nodes: list[tuple[State, int | None]], want: int) -> None:
    errors: list[BaseException] = []

    def pull(node: State, have: int | None) -> None:
        try:
            with WeightClient(url, options=FAST) as client:
                client.pull("p", node, have, want)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=pull, args=pair) for pair in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_relay_serves_bit_exact_versions_and_pulls_each_once(region: Region) -> None:
    states = _states(3)
    nodes = [_zeros(states[0]) for _ in range(4)]
    region.store.publish("p", 0, states[0]).result()
    _pull_all(region.url, [(n, None) for n in nodes], 0)  # one full pull across the WAN
    assert [s.path for s in region.relay.pulls] == ["full"]
    per_version = {}
    haves: list[int | None] = [0] * len(nodes)
    for version, count in ((1, 1), (2, 4)):  # 1 node pulls v1, then 4 nodes pull v2
        manifest = region.store.publish("p", version, states[version]).result()
        before = _wan_down(region.link)
        _pull_all(region.url, [(nodes[i], haves[i]) for i in range(count)], version)
        per_version[count] = (_wan_down(region.link) - before, manifest.size_of(DELTA_FILE))
        haves[:count] = [version] * count
    assert all(_same(node, states[2]) for node in nodes)
    assert [s.path for s in region.relay.pulls] == ["full", "chain", "chain"]
    # WAN bytes per version: the delta once (plus the HTTP and manifest bytes), for 1 or 4 nodes
    for count, (wan, delta) in per_version.items():
        assert delta <= wan < delta + 16_000, (count, wan, delta)
    assert per_version[4][0] < 1.2 * per_version[1][0] + 4_000


def test_relay_resumes_a_cut_transfer(tmp_path: Path) -> None:
    states = _states(1, size=1_500_000)  # a 3 MB full snapshot
    root = tmp_path / "upstream"
    with WeightStore(root) as store:
        store.publish("p", 0, states[0]).result()
    with serve_in_thread(root) as upstream:
        port = int(upstream.rsplit(":", 1)[1])
        wan = CuttingProxy(("127.0.0.1", port), cuts=2, after=1_000_000)
        relay = WeightRelay(wan.url, tmp_path / "relay", options=TransferOptions(retries=3))
        try:
            stats = relay.sync("p")
            with serve_relay(relay) as server:
                lan = CuttingProxy(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), cuts=1,
                                   after=1_500_000)  # fmt: skip
                node = _zeros(states[0])
                try:
                    with WeightClient(lan.url, options=TransferOptions(retries=3)) as client:
                        node_stats = client.pull("p", node, None, 0)
                finally:
                    lan.close()
        finally:
            relay.close()
            wan.close()
    assert stats is not None and wan.cut_done >= 1 and stats.resumes >= 1
    assert lan.cut_done == 1 and node_stats.resumes >= 1
    assert _same(node, states[0])


def test_relay_refuses_corrupt_upstream_data(region: Region) -> None:
    states = _states(2)
    region.store.publish("p", 0, states[0]).result()
    region.relay.sync("p")
    region.store.publish("p", 1, states[1]).result()
    path = region.upstream_root / "p/v00000001" / DELTA_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=DELTA_FILE) as info:
        region.relay.sync("p")
    assert region.link.url("weights") in str(info.value)
    assert region.relay.held("p") == 0  # nothing of v1 was published
    node = _zeros(states[0])
    with WeightClient(region.url, options=FAST) as client:
        client.pull("p", node, None, 0)
        with pytest.raises(TransferError, match="upstream"):
            client.pull("p", node, 0, 1)  # on demand: the relay answers 502 naming upstream
    assert _same(node, states[0])


def test_relay_fails_loud_naming_upstream_when_the_wan_is_down(region: Region) -> None:
    states = _states(2)
    region.store.publish("p", 0, states[0]).result()
    region.relay.sync("p")
    region.store.publish("p", 1, states[1]).result()
    region.link.set_down(True)
    with pytest.raises(RelayError) as info:
        region.relay.sync("p")
    assert region.link.url("weights") in str(info.value) and "upstream" in str(info.value)
    node = _zeros(states[0])
    with WeightClient(region.url, options=FAST) as client:
        client.pull("p", node, None, 0)  # what the relay holds is still served
        with pytest.raises(TransferError, match=region.link.url("weights")):
            client.pull("p", node, 0, 1)
    region.link.set_down(False)
    assert region.relay.sync("p") is not None and region.relay.held("p") == 1


def test_a_relay_with_no_policy_to_mirror_still_checks_its_upstream(
    region: Region, tmp_path: Path
) -> None:
    """``--policy`` is optional: a relay that mirrors only on demand still refuses, at start,
    an upstream it cannot read (a wrong URL, a dead WAN, a store directory that is not there)
    instead of serving a region that no pull can ever reach."""
    assert region.relay.policies == []
    wait_for_upstream(region.relay, 0.0)  # the upstream server answers its health route
    region.link.set_down(True)
    with pytest.raises(RelayError) as info:
        wait_for_upstream(region.relay, 0.0)
    assert f"relay cannot reach upstream {region.link.url('weights')}" in str(info.value)
    assert region.relay.last_error == str(info.value)
    region.link.set_down(False)
    wait_for_upstream(region.relay, 5.0)
    region.store.publish("p", 0, _states(1, size=1000)[0]).result()
    on_disk = WeightRelay(str(region.upstream_root), tmp_path / "fs", options=FAST)
    missing = WeightRelay(str(tmp_path / "no-store-here"), tmp_path / "mirror", options=FAST)
    try:
        wait_for_upstream(on_disk, 0.0)
        with pytest.raises(RelayError, match=r"upstream .*no-store-here.*no weight store there"):
            wait_for_upstream(missing, 0.0)
    finally:
        on_disk.close()
        missing.close()


def test_the_relay_command_exits_naming_an_upstream_it_cannot_read(tmp_path: Path) -> None:
    typo = tmp_path / "weigths"  # the store is at tmp_path / "weights"
    proc = subprocess.run(
        [sys.executable, "-m", "astraflow", "weights", "relay", "--upstream", str(typo),
         "--root", str(tmp_path / "mirror"), "--port", "0", "--wait-s", "0.5"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout
    assert f"relay cannot reach upstream {typo}" in proc.stderr, proc.stderr


def test_relay_pulls_nothing_for_a_caller_without_a_token(tmp_path: Path) -> None:
    states = _states(1, size=1000)
    root = tmp_path / "upstream"
    with WeightStore(root) as store:
        store.publish("p", 0, states[0]).result()
    auth = WeightServerConfig(auth=WeightsAuthConfig(read=SecretStr("r3ad")))
    with serve_in_thread(root) as upstream:
        relay = WeightRelay(upstream, tmp_path / "relay", options=FAST)
        try:
            with serve_relay(relay, config=auth) as server:
                with pytest.raises(AuthError), WeightClient(server.url, options=FAST) as client:
                    client.pull("p", _zeros(states[0]), None, 0)
                assert relay.pulls == []
                options = TransferOptions(retries=1, token="r3ad")
                node = _zeros(states[0])
                with WeightClient(server.url, options=options) as client:
                    client.pull("p", node, None, 0)
        finally:
            relay.close()
    assert len(relay.pulls) == 1 and _same(node, states[0])


def _relaying(region: Region, versions: int) -> list[State]:
    """Small states; version 0 published upstream and relayed."""
    states = _states(versions, size=1000)
    region.store.publish("p", 0, states[0]).result()
    region.relay.sync("p")
    return states


class _Upstream:
    """Counts the relay's upstream ``latest`` checks and holds those of the names ``hold``
    picks until ``gate`` opens; counts the on-demand requests that reached the relay."""

    def __init__(self, relay: WeightRelay, hold: Callable[[str], bool] = lambda _: False) -> None:
        self.calls: list[str] = []
        self.entered = 0
        self.gate = threading.Event()
        self._hold = hold
        self._latest = relay.client.latest
        self._ensure = relay.ensure_async
        relay.client.latest = self.latest  # type: ignore[method-assign]
        relay.ensure_async = self.ensure  # type: ignore[method-assign]

    def latest(self, policy: str) -> int | None:
        self.calls.append(policy)
        if self._hold(policy):
            assert self.gate.wait(60), "the test never opened the gate"
        return self._latest(policy)

    async def ensure(self, policy: str, version: int) -> None:
        self.entered += 1
        await self._ensure(policy, version)

    def wait_entered(self, n: int) -> None:
        deadline = time.monotonic() + 60
        while self.entered < n:
            assert time.monotonic() < deadline, f"{self.entered} of {n} requests arrived"
            time.sleep(0.01)


@contextmanager
def _get_all(url: str, paths: list[str]) -> Iterator[list[Future[httpx.Response]]]:
    """GET every path at once, each from a thread of its own."""
    limits = httpx.Limits(max_connections=len(paths))
    with (
        httpx.Client(base_url=url, timeout=60, limits=limits) as client,
        ThreadPoolExecutor(len(paths)) as pool,
    ):
        yield [pool.submit(client.get, path) for path in paths]


def test_concurrent_requests_for_a_missing_version_share_one_upstream_check(
    region: Region,
) -> None:
    """Thirty requests for a version upstream lacks (a hostile flood, or nodes ahead of the
    relay) make two upstream checks, not thirty in a row that a real node would queue behind."""
    states = _relaying(region, 2)
    upstream = _Upstream(region.relay, hold=lambda policy: True)
    with _get_all(region.url, ["/v1/weights/files/p/v00099999/manifest.json"] * 30) as replies:
        upstream.wait_entered(30)
        upstream.gate.set()
        assert [r.result().status_code for r in replies] == [404] * 30
    # the first check was in flight when the others came: they join it and then one more
    assert upstream.calls == ["p", "p"]
    region.store.publish("p", 1, states[1]).result()
    node = _zeros(states[0])
    with WeightClient(region.url, options=FAST) as client:
        client.pull("p", node, None, 1)
    assert _same(node, states[1]) and upstream.calls == ["p"] * 3


def test_names_upstream_never_served_are_not_polled_and_cannot_hold_up_served_policies(
    region: Region,
) -> None:
    states = _relaying(region, 2)
    region.relay.max_probes = 3
    upstream = _Upstream(region.relay, hold=lambda policy: policy.startswith("nope"))
    paths = [f"/v1/weights/files/nope{i}/v00000000/manifest.json" for i in range(8)]
    with _get_all(region.url, paths) as replies:
        upstream.wait_entered(8)
        # the unknown names' checks are stuck upstream; the policy the relay serves still moves
        region.store.publish("p", 1, states[1]).result()
        node = _zeros(states[0])
        with WeightClient(region.url, options=FAST) as client:
            client.pull("p", node, None, 1)
        assert _same(node, states[1])
        upstream.gate.set()
        answers = [r.result() for r in replies]
    codes = sorted(a.status_code for a in answers)
    assert codes == [404] * 3 + [503] * 5  # three queued at most, the rest told to retry
    busy = [a.json() for a in answers if a.status_code == 503]
    assert all("does not serve" in b["error"]["message"] for b in busy)
    assert region.relay.policies == ["p"]  # nothing to poll for names upstream lacks
    assert len([c for c in upstream.calls if c.startswith("nope")]) == 3


def test_a_version_number_no_store_can_hold_is_refused_without_asking_upstream(
    region: Region,
) -> None:
    _relaying(region, 1)
    upstream = _Upstream(region.relay)
    with httpx.Client(base_url=region.url, timeout=30) as client:
        for digits in (17, 40, 5000):  # 5000: past Python's int() limit (was a 500)
            reply = client.get(f"/v1/weights/files/p/v{'9' * digits}/manifest.json")
            assert 400 <= reply.status_code < 500, (digits, reply.status_code, reply.text)
            assert reply.json()["error"]["code"] in ("invalid", "not_found")
    assert upstream.calls == []
