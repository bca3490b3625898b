"""The emulated WAN link on loopback: it delays and rate-limits as configured, keeps order under
jitter, counts bytes, and goes down and up. Bounds are one-sided where physics makes them hard
(the link is never faster than configured) and generous on the other side (a loaded machine)."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator

import pytest

from astraflow.cli.link import _config
from astraflow.cli.main import build_parser, main
from astraflow.errors import ConfigError, ValidationError
from astraflow.link import Forward, Link, LinkConfig, ProbeServer
from astraflow.link.probe import probe_address


@pytest.fixture
def probe() -> Iterator[tuple[str, int]]:
    server = ProbeServer()
    address = server.start()
    yield address
    server.stop()


def _recv(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        got = sock.recv(min(left, 1 << 20))
        assert got, f"closed with {left} bytes missing"
        parts.append(got)
        left -= len(got)
    return b"".join(parts)


def test_link_delays_and_rate_limits_as_configured(probe: tuple[str, int]) -> None:
    config = LinkConfig(delay_ms=60, rate_mbit=16)  # RTT 120 ms, 2 MB/s each way
    rate, rtt = 2e6, 0.12
    n = 600_000
    burst = config.burst_kib * 1024
    with Link(config, [Forward(upstream=probe, name="probe")]) as link:
        host, port = link.addresses[0]
        with socket.create_connection((host, port), timeout=30) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pings = []
            for _ in range(3):
                started = time.perf_counter()
                sock.sendall(b"P\n")
                _recv(sock, 1)
                pings.append(time.perf_counter() - started)
            started = time.perf_counter()
            sock.sendall(f"D {n}\n".encode())
            _recv(sock, n)
            down_s = time.perf_counter() - started
        stats = link.stats
    # never faster than the link allows: each ping pays both delays, the bulk the wire time
    assert min(pings) >= 0.95 * rtt
    assert down_s >= (n - burst) / rate + 0.95 * rtt
    # and not much slower, with room for a loaded machine
    assert min(pings) < rtt + 1.0
    assert down_s < 3 * (n / rate + rtt)
    assert stats.down["probe"] == n + 3 and stats.connections["probe"] == 1


def test_measure_reports_figures_near_configuration(probe: tuple[str, int]) -> None:
    config = LinkConfig(delay_ms=25, rate_mbit=40)
    with Link(config, [Forward(upstream=probe)]) as link:
        rtt, up, down = probe_address(*link.addresses[0], pings=3, bulk_bytes=1_000_000)
    rate = config.rate_bytes_s
    assert rate is not None
    assert 0.95 * config.rtt_s <= rtt < config.rtt_s + 1.0
    # the measured rate excludes the RTT: near the configured one (burst makes it a bit more)
    for measured in (up, down):
        assert 0.3 * rate < measured < 1.2 * rate


def test_jitter_keeps_order_and_bytes(probe: tuple[str, int]) -> None:
    config = LinkConfig(delay_ms=10, jitter_ms=10, chunk_kib=1, seed=3)
    payload = random.Random(0).randbytes(200_000)
    with (
        Link(config, [Forward(upstream=probe)]) as link,
        socket.create_connection(link.addresses[0], timeout=30) as sock,
    ):
        sock.sendall(f"U {len(payload)}\n".encode() + payload)
        assert _recv(sock, 1) == b"K"
        sock.sendall(b"D 50000\n")
        assert _recv(sock, 50_000) == bytes(50_000)


def test_down_link_refuses_and_comes_back(probe: tuple[str, int]) -> None:
    with Link(LinkConfig(delay_ms=5), [Forward(upstream=probe)]) as link:
        address = link.addresses[0]
        open_sock = socket.create_connection(address, timeout=10)
        link.set_down(True)
        with open_sock, pytest.raises(OSError):  # the open connection is cut
            open_sock.sendall(b"P\n")
            if not open_sock.recv(1):
                raise ConnectionResetError("cut")
        with socket.create_connection(address, timeout=10) as sock, pytest.raises(OSError):
            sock.sendall(b"P\n")
            if not sock.recv(1):
                raise ConnectionResetError("refused")
        link.set_down(False)
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(b"P\n")
            assert sock.recv(1) == b"P"


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="jitter_ms"):
        LinkConfig(delay_ms=5, jitter_ms=10)
    with pytest.raises(ValidationError, match="forward"):
        Forward.parse("9000:nohost")
    for bad in ("0:127.0.0.1:99999", "70000:10.0.0.1:80", "9000:10.0.0.1:0", "9000::80",
                "-1:10.0.0.1:80"):  # fmt: skip
        with pytest.raises(ValidationError, match=f"forward '{bad}': ports are 1-65535"):
            Forward.parse(bad)
    assert Forward.parse("df=0.0.0.0:9000:10.0.0.1:80") == Forward(
        upstream=("10.0.0.1", 80), listen=("0.0.0.0", 9000), name="df"
    )
    with pytest.raises(ConfigError, match="rate_mbit"):
        _config(build_parser().parse_args(["link", "measure", "--rate-mbit", "-3"]))


def test_cli_measure_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["link", "measure", "--delay-ms", "5", "--rate-mbit", "80", "--bulk-mb", "0.3",
                 "--tolerance", "100"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "rtt_ms" in out and "down_mbit_s" in out and "within" in out
