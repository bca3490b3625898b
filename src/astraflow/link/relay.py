"""``Link``: a user-space TCP relay that shapes traffic like a WAN link (delay, rate, jitter, loss).

Each forward listens on a local port and relays every connection to its upstream address.
Every chunk read from one side is scheduled, then held until its delivery time::

    read chunk (t, n) ──► wire of its direction: free_at = max(free_at, t) + n/rate,
                           depart = max(t, free_at - burst/rate)
                           (one token bucket per direction, shared by every connection)
                      ──► deliver = depart + delay ± jitter + losses x rto, never before the
                           chunk ahead of it on the same connection (order kept, per direction)
                      ──► queue (at most ``buffer_bytes`` held: the sender is pushed back)
                      ──► sleep until deliver ──► write to the other side

Loss is emulated above TCP: no byte is dropped; each lost 1448-byte segment stalls its stream
for a retransmission timeout, which is what a lossy path costs a TCP stream. Connection set-up
is local (costs no RTT); every byte after it pays the delay. ``set_down(True)`` cuts every
connection and refuses new ones (a WAN outage); ``cut()`` cuts the open ones only.
The link runs its own asyncio loop in a thread (``start``/``close``), so blocking callers,
tests and benchmarks use it alike; ``astraflow link serve`` runs one as a process. Its loop
waits with microsecond resolution (``_FineEpollSelector``): asyncio's epoll rounds every
timer up to the next millisecond, which made a 2.65 ms delay cost 3.2 ms per direction, and
it sets each timer early by how late its recent timers fired (``Link._woke``); its thread
runs at real-time priority where the OS allows (``LinkConfig.realtime``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import random
import select
import selectors
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from astraflow.errors import AstraflowError, ValidationError
from astraflow.link.config import LinkConfig

__all__ = ["Forward", "Link", "LinkStats"]

log = logging.getLogger(__name__)

_SEGMENT = 1448  # TCP payload bytes per packet on a 1500-byte MTU
_MAX_LATE_S = 0.001  # most timer lateness the link compensates for (see Link._woke)


@dataclass(frozen=True)
class Forward:
    """One relayed service: connections to ``listen`` go on to ``upstream``."""

    upstream: tuple[str, int]
    """Host and port the relay connects to."""
    listen: tuple[str, int] = ("127.0.0.1", 0)
    """Host and port to listen on (port 0: a free one)."""
    name: str = ""
    """Label in the byte counts (default: the upstream address)."""

    @classmethod
    def parse(cls, text: str) -> Forward:
        """``[NAME=][LISTEN_HOST:]LISTEN_PORT:UPSTREAM_HOST:UPSTREAM_PORT``."""
        name, _, spec = text.rpartition("=")
        parts = spec.split(":")
        try:
            if len(parts) == 3:
                listen = ("127.0.0.1", int(parts[0]))
            elif len(parts) == 4:
                listen = (parts[0], int(parts[1]))
            else:
                raise ValueError(spec)
            upstream = (parts[-2], int(parts[-1]))
        except ValueError:
            raise ValidationError(
                f"forward {text!r}: expected [NAME=][HOST:]PORT:UPSTREAM_HOST:UPSTREAM_PORT",
                field="forward",
            ) from None
        if not (0 <= listen[1] <= 65535 and 0 < upstream[1] <= 65535) or not upstream[0]:
            raise ValidationError(
                f"forward {text!r}: ports are 1-65535 (listen port 0: a free one) and the "
                "upstream host is not empty",
                field="forward",
            )
        return cls(upstream=upstream, listen=listen, name=name)


@dataclass
class LinkStats:
    """Bytes relayed per forward and direction ('up': to upstream; 'down': back)."""

    up: dict[str, int] = field(default_factory=dict)
    """Bytes relayed towards the upstream, per forward name."""
    down: dict[str, int] = field(default_factory=dict)
    """Bytes relayed back to the clients, per forward name."""
    connections: dict[str, int] = field(default_factory=dict)
    """Connections accepted, per forward name."""

    def total(self) -> int:
        """Bytes relayed in both directions over every forward."""
        return sum(self.up.values()) + sum(self.down.values())


def _realtime_thread() -> None:
    """Run the calling thread (the link's loop) at the lowest real-time priority when the OS
    allows it (root or CAP_SYS_NICE): a network does not wait for a CPU, and on a loaded
    machine an ordinary thread's timers fire milliseconds late. The link sleeps between
    chunks, so it takes little CPU; elsewhere it runs as an ordinary thread."""
    setter = getattr(os, "sched_setscheduler", None)
    if setter is None:
        return
    try:
        setter(0, os.SCHED_RR, os.sched_param(1))
    except OSError as exc:
        log.debug("link thread stays at ordinary priority: %s", exc)


class _FineEpollSelector(selectors.EpollSelector):
    """An epoll selector whose timed waits have microsecond, not millisecond, resolution.

    ``epoll_wait`` takes whole milliseconds and asyncio rounds up, so every held chunk would
    leave up to 1 ms late. The wait is done instead by ``select(2)`` (microsecond timeouts)
    on the epoll descriptor itself, which turns readable when any registered event is
    pending; the events are then collected without blocking.
    """

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout > 0:
            try:
                select.select([self.fileno()], [], [], timeout)
            except ValueError:  # descriptor above FD_SETSIZE: millisecond waits, as asyncio
                return super().select(timeout)
            except InterruptedError:
                return []
            timeout = 0
        return super().select(timeout)


class _Wire:
    """The capacity of one direction of the link: a token bucket as a virtual clock."""

    def __init__(self, config: LinkConfig, rng: random.Random) -> None:
        self.config = config
        self.rng = rng
        self.free_at = 0.0

    def deliver_at(self, now: float, size: int) -> float:
        """When a chunk of ``size`` bytes read at ``now`` reaches the other side."""
        cfg = self.config
        depart = now
        rate = cfg.rate_bytes_s
        if rate is not None:
            # free_at: when the bytes scheduled so far are paid for at the rate; a chunk may
            # leave once no more than the bucket's depth remains unpaid
            self.free_at = max(self.free_at, now) + size / rate
            depart = max(now, self.free_at - cfg.burst_kib * 1024 / rate)
        delay = cfg.delay_ms / 1000
        if cfg.jitter_ms:
            delay += self.rng.uniform(-cfg.jitter_ms, cfg.jitter_ms) / 1000
        if cfg.loss:
            segments = math.ceil(size / _SEGMENT)
            lost = sum(self.rng.random() < cfg.loss for _ in range(segments))
            delay += lost * cfg.rto_s
        return depart + delay


class Link:
    """An emulated WAN link carrying one or more forwards (see the module docstring)."""

    def __init__(self, config: LinkConfig, forwards: Sequence[Forward]) -> None:
        if not forwards:
            raise ValidationError("a link needs at least one forward", field="forward")
        self.config = config
        self.forwards = list(forwards)
        rng = random.Random(config.seed)
        self._wires = {"up": _Wire(config, rng), "down": _Wire(config, rng)}
        self.stats = LinkStats()
        for fw in self.forwards:
            name = self._name(fw)
            self.stats.up[name] = self.stats.down[name] = self.stats.connections[name] = 0
        self.addresses: list[tuple[str, int]] = []
        self._down = False
        self._late_s = 0.0  # how late the loop wakes for a timer (mean of recent wake-ups)
        self._wakes = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[asyncio.Server] = []
        self._closed = asyncio.Event()
        self._urls: dict[str, str] | None = None

    @staticmethod
    def _name(fw: Forward) -> str:
        return fw.name or f"{fw.upstream[0]}:{fw.upstream[1]}"

    @classmethod
    def for_urls(cls, config: LinkConfig, urls: dict[str, str]) -> Link:
        """A link with one forward per named ``http(s)://host:port`` URL (see ``url``)."""
        forwards = []
        for name, url in urls.items():
            parts = urlsplit(url)
            if parts.hostname is None or parts.port is None:
                raise ValidationError(f"link upstream {name}: {url!r} needs a host and a port")
            forwards.append(Forward(upstream=(parts.hostname, parts.port), name=name))
        link = cls(config, forwards)
        link._urls = dict(urls)
        return link

    def url(self, name: str) -> str:
        """The URL that reaches the named upstream URL through the link (after ``start``)."""
        if self._urls is None or name not in self._urls:
            raise ValidationError(f"this link has no URL named {name!r}", field="name")
        index = [fw.name for fw in self.forwards].index(name)
        host, port = self.addresses[index]
        parts = urlsplit(self._urls[name])
        return urlunsplit((parts.scheme, f"{host}:{port}", parts.path, parts.query, ""))

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> list[tuple[str, int]]:
        """Listen on every forward in a background thread; returns the bound addresses."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            if self.config.realtime:
                _realtime_thread()
            loop = asyncio.SelectorEventLoop(_FineEpollSelector())
            self._loop = loop
            try:
                loop.run_until_complete(self._serve(ready))
            except BaseException as exc:  # reported to start(); the thread ends
                failure.append(exc)
                ready.set()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="wan-link", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise AstraflowError(f"the link could not listen: {failure[0]}") from failure[0]
        return self.addresses

    async def _serve(self, ready: threading.Event) -> None:
        self._closed = asyncio.Event()
        for fw in self.forwards:
            server = await asyncio.start_server(
                functools.partial(self._accept, fw), fw.listen[0], fw.listen[1]
            )
            self._servers.append(server)
            host, port = server.sockets[0].getsockname()[:2]
            self.addresses.append((host, port))
            log.info("link forward=%s listen=%s:%d", self._name(fw), host, port)
        ready.set()
        await self._closed.wait()
        for server in self._servers:
            server.close()
        self._abort_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def close(self) -> None:
        """Stop listening and cut every connection."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(self._closed.set)
            thread.join(timeout=10)

    def __enter__(self) -> Link:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_down(self, down: bool) -> None:
        """Take the link down (cut everything, refuse new connections) or bring it back."""
        self._down = down
        if down:
            self.cut()

    def cut(self) -> None:
        """Cut every open connection (as a broken path does); new ones are accepted. Returns
        once they are cut (a connection made after it is never caught by it)."""
        loop = self._loop
        if loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(self._cut(), loop).result(timeout=30)

    async def _cut(self) -> None:
        self._abort_all()

    def _abort_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    # ------------------------------------------------------------------ relaying

    async def _accept(
        self, fw: Forward, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        name = self._name(fw)
        if self._down or self._closed.is_set():
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.stats.connections[name] += 1
        self._writers.add(writer)  # a cut while the upstream connects must reach it too
        try:
            up_reader, up_writer = await asyncio.open_connection(*fw.upstream)
        except OSError as exc:
            log.warning("link forward=%s upstream unreachable: %s", name, exc)
            self._writers.discard(writer)
            writer.transport.abort()
            return
        if self._down or writer.transport.is_closing():  # cut or taken down meanwhile
            self._writers.discard(writer)
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self._writers.add(up_writer)
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer, "up", name),
                self._pipe(up_reader, writer, "down", name),
            )
        except asyncio.CancelledError:  # the link closes: end quietly (asyncio's stream
            pass  # callback reads this task's outcome and must not find it cancelled)
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: str, name: str
    ) -> None:
        """Relay one direction of one connection until EOF (then half-close) or a cut."""
        held: deque[tuple[float, bytes]] = deque()
        room, ready = asyncio.Event(), asyncio.Event()
        state = {"bytes": 0, "eof": False}
        sender = asyncio.create_task(self._send(dst, held, room, ready, state, direction, name))
        wire, limit, last = self._wires[direction], self.config.buffer_bytes, 0.0
        chunk = self.config.chunk_kib * 1024
        try:
            while data := await src.read(chunk):
                last = max(last, wire.deliver_at(time.monotonic(), len(data)))
                held.append((last, data))
                state["bytes"] += len(data)
                ready.set()
                while state["bytes"] >= limit:
                    room.clear()
                    await room.wait()
        except OSError:
            pass
        except asyncio.CancelledError:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            raise
        state["eof"] = True
        ready.set()
        with contextlib.suppress(OSError):
            await sender

    def _woke(self, late_s: float) -> None:
        """Learn how late timers fire (scheduling, the loop's own work), so that a chunk's
        timer is set that much early and the chunk leaves at its delivery time on average
        (mean of recent wake-ups; at most 1 ms is compensated, a stall is not learnt)."""
        sample = min(max(late_s, 0.0), _MAX_LATE_S)
        self._wakes += 1
        weight = max(0.1, 1 / self._wakes)  # the plain mean of the first ten, then decaying
        self._late_s += weight * (sample - self._late_s)

    async def _send(
        self,
        dst: asyncio.StreamWriter,
        held: deque[tuple[float, bytes]],
        room: asyncio.Event,
        ready: asyncio.Event,
        state: dict[str, int | bool],
        direction: str,
        name: str,
    ) -> None:
        counts = self.stats.up if direction == "up" else self.stats.down
        while True:
            if not held:
                if state["eof"]:
                    break
                ready.clear()
                await ready.wait()
                continue
            deliver, data = held[0]
            wait = deliver - time.monotonic() - self._late_s
            if wait > 0:
                await asyncio.sleep(wait)
                self._woke(time.monotonic() - (deliver - self._late_s))
            held.popleft()
            dst.write(data)
            await dst.drain()
            counts[name] += len(data)
            state["bytes"] = int(state["bytes"]) - len(data)
            room.set()
        if dst.can_write_eof():
            dst.write_eof()
