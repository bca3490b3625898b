"""Measure a link: RTT by 1-byte pings, throughput by bulk transfers each way, vs configured.

``measure(config)`` starts a probe server on loopback and a ``Link`` in front of it, then::

    ping      send 1 byte ─► echoed ─► RTT (median of ``pings``; the same straight to the
              server is subtracted: what the link adds is compared with its configuration)
    up        "U n" + n bytes ─► server answers when all arrived: n / (elapsed - RTT)
    down      "D n" ─► server sends n bytes: n / (elapsed - RTT)

so each throughput excludes the fixed latency and counts what the wire carries.
``probe_address(host, port, ...)`` measures an already running link (``astraflow link
measure``) whose upstream is a probe server (``ProbeServer``).
"""

from __future__ import annotations

import socket
import socketserver
import statistics
import threading
import time
from dataclasses import dataclass

from astraflow.link.config import LinkConfig
from astraflow.link.relay import Forward, Link

__all__ = ["Fidelity", "ProbeServer", "measure", "probe_address"]

_BLOCK = 1 << 16


@dataclass(frozen=True)
class Fidelity:
    """Measured against configured figures of one link."""

    rtt_s: float
    """Median measured round-trip time through the link."""
    base_rtt_s: float
    """Median round-trip time to the same probe server without the link (loopback and the
    probe's own processing), subtracted before RTT is compared with the configuration."""
    up_bytes_s: float
    """Measured throughput towards the upstream."""
    down_bytes_s: float
    """Measured throughput back from the upstream."""
    config: LinkConfig
    """What the link was configured with."""

    def errors(self) -> dict[str, float]:
        """Relative error of each figure (measured / configured - 1; rates only when set)."""
        out = {}
        if self.config.rtt_s > 0:
            out["rtt"] = self.link_rtt_s / self.config.rtt_s - 1
        rate = self.config.rate_bytes_s
        if rate is not None:
            out["up"] = self.up_bytes_s / rate - 1
            out["down"] = self.down_bytes_s / rate - 1
        return out

    @property
    def link_rtt_s(self) -> float:
        """The round-trip time the link adds (measured minus the direct loopback RTT)."""
        return self.rtt_s - self.base_rtt_s

    def within(self, tolerance: float) -> bool:
        """Whether every figure is within ``tolerance`` (e.g. 0.1) of the configured one."""
        return all(abs(e) <= tolerance for e in self.errors().values())

    def table(self) -> str:
        """A small text table: configured, measured, error."""
        cfg, rate = self.config, self.config.rate_bytes_s
        rows = [("rtt_ms", cfg.rtt_s * 1000, self.link_rtt_s * 1000)]
        if rate is not None:
            rows += [("up_mbit_s", rate * 8e-6, self.up_bytes_s * 8e-6),
                     ("down_mbit_s", rate * 8e-6, self.down_bytes_s * 8e-6)]  # fmt: skip
        lines = [f"{'figure':<12}{'configured':>12}{'measured':>12}{'error':>9}"]
        for name, want, got in rows:
            err = f"{(got / want - 1) * 100:+.1f}%" if want else "-"
            lines.append(f"{name:<12}{want:>12.2f}{got:>12.2f}{err:>9}")
        lines.append(f"(rtt: {self.rtt_s * 1000:.2f} ms through the link minus "
                     f"{self.base_rtt_s * 1000:.2f} ms straight to the probe server)")  # fmt: skip
        return "\n".join(lines)


class _Handler(socketserver.BaseRequestHandler):
    """Echo single bytes; ``U n\\n``: swallow n bytes, answer b'K'; ``D n\\n``: send n bytes."""

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stream = sock.makefile("rb")
        while line := stream.readline():
            if line == b"P\n":
                sock.sendall(b"P")
                continue
            kind, _, count = line.strip().partition(b" ")
            n = int(count)
            if kind == b"U":
                while n > 0:
                    got = stream.read(min(n, _BLOCK))
                    if not got:
                        return
                    n -= len(got)
                sock.sendall(b"K")
            elif kind == b"D":
                block = bytes(_BLOCK)
                while n > 0:
                    sock.sendall(block[: min(n, _BLOCK)])
                    n -= min(n, _BLOCK)
            else:
                return


class ProbeServer(socketserver.ThreadingTCPServer):
    """The far end of a measurement (see ``_Handler``); ``start()`` serves in a thread."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__((host, port), _Handler)

    def start(self) -> tuple[str, int]:
        """Serve in a daemon thread; returns the bound address."""
        threading.Thread(target=self.serve_forever, name="link-probe", daemon=True).start()
        host, port = self.server_address[:2]
        return str(host), int(port)

    def stop(self) -> None:
        """Stop serving."""
        self.shutdown()
        self.server_close()


def probe_address(
    host: str, port: int, *, pings: int = 7, bulk_bytes: int = 1 << 22, timeout_s: float = 120.0
) -> tuple[float, float, float]:
    """RTT (median), up and down throughput in bytes/s through ``host:port`` to a probe server."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtt = _pings(sock, pings)
        started = time.perf_counter()
        sock.sendall(f"U {bulk_bytes}\n".encode())
        block, left = bytes(_BLOCK), bulk_bytes
        while left > 0:
            sock.sendall(block[: min(left, _BLOCK)])
            left -= min(left, _BLOCK)
        _recv_exact(sock, 1)
        up = bulk_bytes / max(time.perf_counter() - started - rtt, 1e-9)
        started = time.perf_counter()
        sock.sendall(f"D {bulk_bytes}\n".encode())
        _recv_exact(sock, bulk_bytes)
        down = bulk_bytes / max(time.perf_counter() - started - rtt, 1e-9)
    return rtt, up, down


def measure(
    config: LinkConfig, *, pings: int = 7, bulk_bytes: int | None = None, timeout_s: float = 120.0
) -> Fidelity:
    """Start a probe server and a link shaped by ``config`` in front of it; measure the link.

    ``bulk_bytes`` defaults to about 3 s worth of the configured rate (at least 64 times the
    token bucket's burst, at most 256 MiB; 16 MiB when the rate is unlimited).
    """
    if bulk_bytes is None:
        rate = config.rate_bytes_s
        floor = int(config.burst_kib * 1024) * 64
        bulk_bytes = 1 << 24 if rate is None else min(1 << 28, max(floor, int(3 * rate)))
    server = ProbeServer()
    address = server.start()
    try:
        base_rtt = _ping(address, pings, timeout_s)
        with Link(config, [Forward(upstream=address, name="probe")]) as link:
            host, port = link.addresses[0]
            rtt, up, down = probe_address(
                host, port, pings=pings, bulk_bytes=bulk_bytes, timeout_s=timeout_s
            )
    finally:
        server.stop()
    return Fidelity(rtt_s=rtt, base_rtt_s=base_rtt, up_bytes_s=up, down_bytes_s=down,
                    config=config)  # fmt: skip


def _ping(address: tuple[str, int], pings: int, timeout_s: float) -> float:
    with socket.create_connection(address, timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _pings(sock, pings)


def _pings(sock: socket.socket, pings: int) -> float:
    rtts = []
    for _ in range(pings):
        started = time.perf_counter()
        sock.sendall(b"P\n")
        _recv_exact(sock, 1)
        rtts.append(time.perf_counter() - started)
    return statistics.median(rtts)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left > 0:
        got = sock.recv(min(left, 1 << 20))
        if not got:
            raise ConnectionError(f"probe connection closed with {left} of {n} bytes missing")
        parts.append(got)
        left -= len(got)
    return b"".join(parts)
