"""``WeightRelay``: a regional mirror of a weight store. Pulls each version once across the WAN,
verifies it, and serves its region's nodes with the weight server's own HTTP API.

    upstream store ══ WAN ══► relay: WeightClient.pull (cheapest: delta, merged delta, full)
                                     tensors verified against the upstream manifest
                                     ──► local WeightStore.publish (its own deltas, full every K)
                                     ──► weight server app over the local root ──► region's nodes

Versions arrive two ways: a poller asks upstream for ``latest`` every ``poll_s`` seconds
(policies configured, and any a node asked for), and a node asking for the manifest of a
version the relay lacks makes the relay pull it first (on demand). On-demand pulls are
single-flight per policy: a request joins the check in flight (and at most one more, started
after it arrived), so any number of concurrent requests, hostile ones included, make at most one
upstream call at a time per policy. Checks for names upstream has never served run on a worker
of their own, at most ``max_probes`` queued (more answer 503), so they cannot hold up the
policies the relay serves; such names are never polled. When the relay is behind by several
versions it pulls straight to the newest (a merged delta): versions in between are not
mirrored, and a node asking for one is told the newest exists (its next refresh takes it).
A version whose bytes do not verify is never published; WAN errors name the upstream. Auth is
the weight server's (read tokens for nodes); the relay reads upstream with its own token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from astraflow.errors import AstraflowError, NotFoundError, ServiceBusyError, TransferError
from astraflow.serving import BackgroundServer
from astraflow.weights.access import WeightsAuth
from astraflow.weights.client import PullStats, WeightClient
from astraflow.weights.config import WeightStoreConfig
from astraflow.weights.files import StoreFiles
from astraflow.weights.server import WeightServerConfig, standalone_app
from astraflow.weights.store import WeightStore
from astraflow.weights.tensors import torch_dtype
from astraflow.weights.transfer import TransferOptions

__all__ = ["RelayError", "WeightRelay", "relay_app", "serve_relay", "wait_for_upstream"]

log = logging.getLogger(__name__)

#: A store file of one version (version directories are ``v`` + 8 to 16 digits; a longer number
#: names no version, and the weight server answers it).
_MANIFEST_PATH = re.compile(r"^/v1/weights/files/([A-Za-z0-9][A-Za-z0-9._-]{0,127})/v(\d{8,16})/")


class RelayError(TransferError):
    """The relay could not bring a version from its upstream (the message names it)."""

    code = "relay_upstream"


class WeightRelay:
    """Mirror ``upstream`` into the store directory ``root`` (see the module docstring)."""

    def __init__(
        self,
        upstream: str,
        root: str | Path,
        *,
        policies: list[str] | None = None,
        options: TransferOptions | None = None,
        store: WeightStoreConfig | None = None,
        max_probes: int = 64,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.root = Path(root)
        self.client = WeightClient(self.upstream, options=options or TransferOptions())
        self.store = WeightStore(self.root, store or WeightStoreConfig(full_every=50))
        self.files = StoreFiles(self.root)
        self.policies: list[str] = list(policies or [])
        self.pulls: list[PullStats] = []
        self.last_error: str | None = None
        self._tensors: dict[str, dict[str, torch.Tensor]] = {}
        self._held: dict[str, int] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self.max_probes = max_probes
        """On-demand checks of names upstream never served, queued at most (more: 503)."""
        self._flights: dict[str, asyncio.Future[Any]] = {}  # on-demand syncs, one per policy
        self._probes = 0  # flights in ``_workers[False]`` now
        self._workers = {  # policies the relay serves / names upstream never served
            True: ThreadPoolExecutor(2, thread_name_prefix="relay-pull"),
            False: ThreadPoolExecutor(1, thread_name_prefix="relay-probe"),
        }

    def _lock(self, policy: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(policy, threading.Lock())

    def _track(self, policy: str, known: bool) -> None:
        """Poll ``policy`` from now on when upstream has it; else forget its lock (a client
        naming a million policies must not grow the relay or its polling)."""
        with self._guard:
            if known and policy not in self.policies:
                self.policies.append(policy)
            elif not known and policy not in self.policies:
                self._locks.pop(policy, None)

    def held(self, policy: str) -> int | None:
        """The newest version of ``policy`` the relay serves."""
        found = self.files.versions(policy)
        return found[-1] if found else None

    def ensure(self, policy: str, version: int) -> None:
        """Make sure ``version`` (or a newer one) is served; pulls it if upstream has it."""
        held = self._held.get(policy)
        if held is None or held < version:
            held = self.held(policy)
        if held is not None and held >= version:
            return
        self.sync(policy)

    def sync(self, policy: str, want: int | None = None) -> PullStats | None:
        """Bring ``policy`` to upstream's newest version (or ``want`` when given and older);
        the pull's stats, None if current.

        Raises ``RelayError`` naming the upstream when it cannot be reached, and lets
        ``ChecksumError`` through when its data does not verify (nothing is published then).
        """
        with self._lock(policy):
            try:
                latest = self.client.latest(policy)
            except TransferError as exc:
                raise self._failed(policy, exc) from exc
            if latest is not None and want is not None:
                latest = min(latest, want)
            held = self._load_held(policy)
            self._track(policy, known=latest is not None or held is not None)
            if latest is None or (held is not None and latest <= held):
                return None
            try:
                stats = self._pull(policy, held, latest)
            except TransferError as exc:
                raise self._failed(policy, exc) from exc
            self.store.publish(policy, latest, self._tensors[policy]).result()
            self._held[policy] = latest
            self.pulls.append(stats)
            self.last_error = None
            log.info("relayed policy=%s version=%d path=%s wan_bytes=%d seconds=%.3f",
                     policy, latest, stats.path, stats.bytes, stats.seconds)  # fmt: skip
            return stats

    def _pull(self, policy: str, held: int | None, latest: int) -> PullStats:
        if held is None:
            if not self.files.exists(f"{policy}/assets/manifest.json"):
                self._mirror_assets(policy)
            manifest = self.client.manifest(policy, latest)
            fresh = {e.name: torch.empty(e.shape, dtype=torch_dtype(e.dtype))
                     for e in manifest.tensors}  # fmt: skip
            stats = self.client.pull(policy, fresh, None, latest)
            self._tensors[policy] = fresh
            return stats
        return self.client.pull(policy, self._tensors[policy], held, latest)

    def _mirror_assets(self, policy: str) -> None:
        with tempfile.TemporaryDirectory(prefix="relay-assets-") as work:
            try:
                self.client.fetch_assets(policy, work)
            except NotFoundError:
                log.info("upstream has no assets for policy=%s", policy)
                return
            self.store.publish_assets(policy, work)

    def _load_held(self, policy: str) -> int | None:
        """The version held in memory; after a restart, the newest served one read from disk."""
        if policy in self._held:
            return self._held[policy]
        local = self.held(policy)
        if local is None:
            return None
        with WeightClient(self.root) as disk:
            self._tensors[policy] = disk.load(policy, local)
        self._held[policy] = local
        return local

    def check_upstream(self) -> None:
        """Raise ``RelayError`` naming upstream unless it can be read (its health route, or
        its store root), whatever policies are configured."""
        try:
            self.client.check()
        except (TransferError, NotFoundError) as exc:
            raise self._error(f"relay cannot reach upstream {self.upstream}: {exc}") from exc

    def _failed(self, policy: str, exc: Exception) -> RelayError:
        return self._error(
            f"relay cannot pull policy {policy!r} from upstream {self.upstream}: {exc}"
        )

    def _error(self, message: str) -> RelayError:
        """The error to raise, kept as ``last_error`` (cleared by the next good sync)."""
        self.last_error = message
        return RelayError(message)

    async def ensure_async(self, policy: str, version: int) -> None:
        """``ensure`` for the server's event loop: single-flight per policy (see the module
        docstring); raises ``ServiceBusyError`` when ``max_probes`` checks of names upstream
        never served are queued already."""
        loop = asyncio.get_running_loop()
        for attempt in range(2):
            held = self._held.get(policy)
            if held is not None and held >= version:
                return
            flight = self._flights.get(policy)
            started = flight is None
            if flight is None:
                known = policy in self.policies or held is not None
                if not known:
                    if self._probes >= self.max_probes:
                        raise ServiceBusyError(
                            f"relay: {self._probes} checks of policies it does not serve are "
                            "queued; try again later",
                            field="policy",
                        )
                    self._probes += 1
                flight = loop.run_in_executor(self._workers[known], self.ensure, policy, version)
                self._flights[policy] = flight
                flight.add_done_callback(partial(self._landed, policy, known))
            await asyncio.shield(flight)
            if started or attempt == 1:
                return  # a check that began after this request came: what it found holds
            # the check joined may have asked upstream before this version existed: one more

    def _landed(self, policy: str, known: bool, flight: asyncio.Future[Any]) -> None:
        if self._flights.get(policy) is flight:
            del self._flights[policy]
        if not known:
            self._probes -= 1
        if not flight.cancelled():
            flight.exception()  # retrieved here: waiters may all have gone

    def poll(self, stop: threading.Event, every_s: float) -> None:
        """Sync every known policy every ``every_s`` seconds until ``stop``; errors are logged
        (loudly, naming upstream) and retried, while the versions held are still served. One
        policy failing does not keep the others from their sync."""
        failures = 0
        while not stop.is_set():
            failed = False
            for policy in list(self.policies):
                try:
                    self.sync(policy)
                except AstraflowError as exc:
                    failed = True
                    log.error("relay sync failed (%d in a row): %s", failures + 1, exc)
            failures = failures + 1 if failed else 0
            stop.wait(every_s if failures == 0 else min(every_s * 2**failures, 30.0))

    def close(self) -> None:
        """Finish local writes and release connections."""
        for workers in self._workers.values():
            workers.shutdown(wait=False, cancel_futures=True)
        self.store.close()
        self.client.close()


class _OnDemand:
    """ASGI wrapper: a read of a version the relay lacks pulls it from upstream first.

    The caller's token is checked before anything is pulled (a caller the weight server
    would refuse cannot make the relay use the WAN); an upstream failure answers 502
    naming the upstream.
    """

    def __init__(self, app: ASGIApp, relay: WeightRelay, auth: WeightsAuth) -> None:
        self.app = app
        self.relay = relay
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _MANIFEST_PATH.match(scope.get("path", "")) if scope["type"] == "http" else None
        if match is not None and self._authorized(scope):
            policy, version = match[1], int(match[2])
            try:
                await self.relay.ensure_async(policy, version)
            except ServiceBusyError as exc:
                await _send_error(send, 503, exc.code, str(exc))
                return
            except AstraflowError as exc:
                message = str(exc)
                if not isinstance(exc, RelayError):
                    message = f"relay cannot serve policy {policy!r} v{version} from upstream "
                    message += f"{self.relay.upstream}: {exc}"
                await _send_error(send, 502, exc.code, message)
                return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers", []))
        header = headers.get(b"authorization", b"").decode("latin-1")
        try:
            self.auth.check(header, str(scope.get("path", "")), "read")
        except AstraflowError:
            return False  # the weight server answers 401 / 403 itself
        return True


async def _send_error(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def relay_app(relay: WeightRelay, config: WeightServerConfig | None = None) -> Any:
    """The weight server's app over the relay's root, pulling on demand (see ``_OnDemand``)."""
    config = config or WeightServerConfig()
    app = standalone_app(relay.root, config)
    return _OnDemand(app, relay, WeightsAuth(config.auth.tokens()))


def serve_relay(
    relay: WeightRelay,
    host: str = "127.0.0.1",
    port: int = 0,
    config: WeightServerConfig | None = None,
) -> BackgroundServer:
    """The relay's server on a background thread (``start()`` returns its URL; ``stop()``)."""
    server = uvicorn.Server(
        uvicorn.Config(
            relay_app(relay, config), host=host, port=port, log_level="warning",
            lifespan="off", ws="none", access_log=False,
        )
    )  # fmt: skip
    return BackgroundServer(server, host, "weight relay")


def wait_for_upstream(relay: WeightRelay, timeout_s: float) -> None:
    """Check upstream answers and sync every configured policy once, retrying until
    ``timeout_s``; raise naming upstream (a relay started with no policy to mirror still
    refuses a wrong URL or a dead WAN)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            relay.check_upstream()
            for policy in list(relay.policies):
                relay.sync(policy)
            return
        except RelayError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
