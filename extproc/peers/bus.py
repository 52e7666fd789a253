"""`PeerBus`: one replica's connection to the others through NATS (docs/operating.md: Several replicas: what they share).

Publishing (the request path): `publish(message)` appends to a buffer and, the first time since the last
send, wakes the sender task; it never awaits, never does I/O and never raises. The sender waits
``linger_ms`` (2 ms), then encodes what arrived meanwhile into one `codec.Batch` (at most
``max_batch_messages`` per NATS message) and publishes it on ``PREFIX.routing.REPLICA``: a NATS message costs
every receiver a recv, nats-py's parse and a task wake-up whatever it carries (~70-100 us measured here), so
batching several requests' messages is what lets replicas add throughput. The connection asks the server not
to echo this replica's own messages back (``no_echo``). While NATS is not connected, messages are dropped at
once (counted ``direction="dropped"``), not queued: what they said (a pick's pending prefill) is stale within a
second, and the other replicas expire what they miss (`PeerSettings.pending_ttl_s`). Beyond
``max_buffered_messages`` waiting, new messages are dropped too.

Receiving: subscribed to ``PREFIX.routing.*``; a batch from this replica's own subject is skipped; others are
decoded and handed to the sink's ``apply_peer_batch(origin, messages, now_s)`` on the event loop (synchronous:
the sink is `service.PoolRouter`, which applies them to the prefix index, the policy's queues, the sessions
and the Responses directory). A batch that does not decode is counted (``kind="invalid"``) and skipped. Every
second this replica publishes a heartbeat (an empty batch) and the sink's ``expire_peers(now_s)`` drops
peers' pending picks older than the TTL and everything of a peer silent for ``peer_timeout_s``.

Connection: the first connection is retried every ``reconnect_wait_s`` forever in the background (NATS down
at start: the replica routes alone meanwhile); after it, nats-py reconnects by itself, forever. Nothing here
ever blocks or fails a request. A replica that restarts starts empty and learns from the picks made after it
connects (nothing is replayed: the servers' caches and KV events hold the truth, picks age out in seconds).

Security: with a bus key every message is signed (`codec.seal`) and verified (`codec.open_sealed`);
a message that does not verify, does not decode, or is not newer than the last batch taken from its sender
(`codec.Batch.seq`: a replayed batch) is dropped and counted ``kind="invalid"``. With an auth token the
connection refuses a server that does not require authentication, before the token is sent (the token is a
callable nats-py calls once it has read the server's INFO): an impostor that took the port of a crashed
nats-server gets nothing. Batches are split so none exceeds NATS's max_payload (`codec.encode_split`).

Single event loop; `connected` and the counters are plain attributes the metrics thread may read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from prefixroute.extproc.peers import codec
from prefixroute.extproc.peers.settings import PeerSettings

log = logging.getLogger("prefixroute.extproc.peers")

EXPIRE_INTERVAL_S = 1.0
"""How often peers' stale pending picks are looked for: a tenth of a second's precision would buy nothing
against a TTL of tens of seconds."""

MAX_ORIGINS = 256
"""Senders whose last batch number is remembered at most (oldest out): 16 replicas restarting many times."""


class UnauthenticatedServer(ConnectionError):
    """The NATS server does not require authentication although this replica has a token for it."""


class PeerSink(Protocol):
    def apply_peer_batch(self, origin: tuple[str, int], messages: list[codec.Message], now_s: float) -> None: ...

    def expire_peers(self, now_s: float) -> None: ...


class PeerBus:
    """See the module docstring. `sink`: what applies the other replicas' messages; `clock`: monotonic seconds
    (the sink's own clock, passed back to it)."""

    def __init__(self, settings: PeerSettings, sink: PeerSink, *, clock: Callable[[], float] = time.monotonic,
                 incarnation: int | None = None) -> None:
        self.settings = settings
        self.sink = sink
        self.clock = clock
        self.replica_id = settings.resolved_replica_id()
        self.incarnation = incarnation if incarnation is not None else random.getrandbits(48)
        self.subject = f"{settings.subject_prefix}.routing.{self.replica_id}"
        self._wildcard = f"{settings.subject_prefix}.routing.*"
        self.connected = False
        self.num_sent: dict[str, int] = dict.fromkeys(codec.KINDS.values(), 0)
        self.num_received: dict[str, int] = {**dict.fromkeys(codec.KINDS.values(), 0), "invalid": 0}
        self.num_dropped: dict[str, int] = dict.fromkeys(codec.KINDS.values(), 0)
        self.num_connects = 0
        self.num_batches_sent = 0  # NATS messages published (each one batch; heartbeats included)
        self.num_batches_received = 0  # NATS messages delivered to this replica (its own never: no_echo)
        self.num_refused_servers = 0  # servers refused for not requiring authentication
        self._key = settings.resolved_key()
        self._token = settings.resolved_token()
        self._batch_seq = 0
        self._heartbeat_due = False
        self._last_seq: dict[tuple[str, int], int] = {}  # sender (replica, incarnation) -> last batch taken
        self._buf: list[codec.Message] = []
        self._max_buf = settings.max_buffered_messages
        self._wake: asyncio.Event | None = None
        self._woken = False
        self._nc: Any = None
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    # --- the request path ----------------------------------------------------------------------------------
    def publish(self, message: codec.Message) -> None:
        """Send `message` to the other replicas with this tick's batch (module docstring): O(1), never blocks."""
        if not self.connected or len(self._buf) >= self._max_buf:
            self.num_dropped[codec.KINDS[type(message)]] += 1
            return
        self._buf.append(message)
        if not self._woken:
            self._woken = True
            self._wake.set()  # type: ignore[union-attr]  # connected implies started

    # --- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start connecting in the background (returns at once) and the expiry timer."""
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._tasks = [loop.create_task(self._connect()), loop.create_task(self._send()),
                       loop.create_task(self._expire())]

    async def _connect(self) -> None:
        import nats  # deferred: a replica routing alone never imports it

        from nats.aio.client import Client

        s = self.settings
        servers = [u.strip() for u in s.url.split(",") if u.strip()]
        if not self._key:
            log.warning("peers: no bus key (--peers-key-file): messages are not signed, so anything that can "
                        "publish on %s.routing.* can steer this replica's routing", s.subject_prefix)
        tls = ssl.create_default_context(cafile=s.tls_ca_file) if s.tls_ca_file else None
        warned = False
        while not self._closing:
            nc = Client()
            try:
                await nc.connect(
                    servers, name=self.replica_id, connect_timeout=max(1.0, s.reconnect_wait_s),
                    allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=s.reconnect_wait_s,
                    # Nothing is buffered while reconnecting: `publish` drops while disconnected.
                    pending_size=4 * 1024 * 1024, disconnected_cb=self._on_disconnected,
                    # The server does not send this replica its own batches back: it would skip them anyway, and
                    # each costs a recv and a parse (half of what a replica receives at two replicas).
                    no_echo=True,
                    reconnected_cb=self._on_reconnected, error_cb=self._on_error, closed_cb=self._on_closed,
                    token=self._token_for(nc) if self._token else None, tls=tls)
            except Exception as exc:  # noqa: BLE001 - NATS down at start: route alone, retry forever
                with contextlib.suppress(Exception):
                    await nc.close()
                if isinstance(exc, UnauthenticatedServer) or isinstance(exc.__cause__, UnauthenticatedServer):
                    self._refused(exc)
                elif not warned:
                    warned = True
                    log.warning("peers: cannot connect to %s (%s); routing alone, retrying every %.1f s", s.url,
                                exc, s.reconnect_wait_s)
                await asyncio.sleep(s.reconnect_wait_s)
                continue
            self._nc = nc
            await nc.subscribe(self._wildcard, cb=self._on_msg)
            self.connected = True
            self.num_connects += 1
            log.warning("peers: connected to %s as %s", nc.connected_url.netloc if nc.connected_url else s.url,
                        self.replica_id)
            return

    def _token_for(self, nc: Any) -> Callable[[], str]:
        """The token as nats-py's token callable: it is called while the CONNECT is composed, after the
        server's INFO was read (on every reconnect too), and refuses a server that does not require auth."""

        def token() -> str:
            info = getattr(nc, "_server_info", None) or {}
            if not info.get("auth_required"):
                raise UnauthenticatedServer(f"NATS server {info.get('server_id', '?')} at "
                                            f"{getattr(nc, 'connected_url', None) or self.settings.url} does not "
                                            "require authentication")
            return self._token

        return token

    async def _on_disconnected(self) -> None:
        if self.connected:
            log.warning("peers: disconnected from NATS; routing alone until it is back")
        self.connected = False

    async def _on_reconnected(self) -> None:
        self.connected = True
        self.num_connects += 1
        log.warning("peers: reconnected to NATS")

    async def _on_error(self, exc: Exception) -> None:
        if isinstance(exc, UnauthenticatedServer) or isinstance(exc.__cause__, UnauthenticatedServer):
            self._refused(exc)  # while reconnecting (nats-py retries by itself, forever)
            return
        log.debug("peers: NATS error: %s", exc)

    def _refused(self, exc: BaseException) -> None:
        self.num_refused_servers += 1
        if self.num_refused_servers in (1, 10, 100) or self.num_refused_servers % 1000 == 0:
            log.error("peers: %s; refusing it (an impostor on the NATS port?), routing alone", exc)

    async def _on_closed(self) -> None:
        self.connected = False

    async def close(self) -> None:
        self._closing = True
        self.connected = False
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.close(), 2.0)

    # --- background tasks ------------------------------------------------------------------------------------
    async def _send(self) -> None:
        wake = self._wake
        assert wake is not None
        step = self.settings.max_batch_messages
        linger_s = self.settings.linger_ms / 1000.0
        while True:
            await wake.wait()
            if linger_s > 0:
                # Several requests' messages in one NATS message (PeerSettings.linger_ms): the per-message cost
                # at every replica is paid once per linger, not once per tick.
                await asyncio.sleep(linger_s)
            wake.clear()
            self._woken = False
            buf, self._buf = self._buf, []
            heartbeat, self._heartbeat_due = self._heartbeat_due, False
            if not buf and not heartbeat:
                continue
            nc = self._nc
            max_bytes = self._max_payload(nc) - codec.TAG_BYTES
            # Numbered here, sent in order by this one task: a receiver's replay check sees them ascending.
            batches = codec.encode_split(self.replica_id, self.incarnation, self._batch_seq + 1, buf, step, max_bytes)
            self._batch_seq += len(batches)
            n_sent = 0
            for data, n in batches:
                if nc is None or not self.connected:
                    break
                try:
                    await nc.publish(self.subject, codec.seal(self._key, self.subject, data))
                except Exception as exc:  # noqa: BLE001 - a lost connection mid-publish: dropped
                    log.debug("peers: publish failed: %s", exc)
                    break
                n_sent += n
                self.num_batches_sent += 1
            # Batches keep the buffer's order: the first `n_sent` messages went out, the rest were dropped.
            for j, m in enumerate(buf):
                (self.num_sent if j < n_sent else self.num_dropped)[codec.KINDS[type(m)]] += 1

    @staticmethod
    def _max_payload(nc: Any) -> int:
        info = getattr(nc, "_server_info", None) or {}
        mp = info.get("max_payload")
        return int(mp) if isinstance(mp, int) and mp > 1024 else codec.MAX_PAYLOAD_BYTES

    async def _on_msg(self, msg: Any) -> None:
        self.num_batches_received += 1
        if msg.subject == self.subject:
            return
        payload = codec.open_sealed(self._key, msg.subject, msg.data)
        if payload is None:  # not signed with the bus key: forged, or from a replica of another gateway
            self.num_received["invalid"] += 1
            return
        try:
            batch = codec.decode(payload)
        except msgspec.DecodeError:
            self.num_received["invalid"] += 1
            return
        if batch.replica == self.replica_id and batch.incarnation == self.incarnation:
            return
        if msg.subject != f"{self.settings.subject_prefix}.routing.{batch.replica}":
            self.num_received["invalid"] += 1  # a sender speaks on its own subject only
            return
        origin = (batch.replica, batch.incarnation)
        last = self._last_seq.get(origin)
        if last is not None and batch.seq <= last:
            self.num_received["invalid"] += 1  # replayed (or reordered: NATS keeps one sender's order)
            return
        self._last_seq.pop(origin, None)
        self._last_seq[origin] = batch.seq
        if len(self._last_seq) > MAX_ORIGINS:
            self._last_seq.pop(next(iter(self._last_seq)))
        received = self.num_received
        for m in batch.messages:
            received[codec.KINDS[type(m)]] += 1
        try:
            self.sink.apply_peer_batch((batch.replica, batch.incarnation), batch.messages, self.clock())
        except Exception:  # noqa: BLE001 - one bad batch must not stop the subscription
            log.exception("peers: applying a batch from %s failed", batch.replica)

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_INTERVAL_S)
            if self._nc is not None and self.connected:  # the heartbeat: an empty batch, from the sender task
                self._heartbeat_due = True
                self._wake.set()  # type: ignore[union-attr]
            try:
                self.sink.expire_peers(self.clock())
            except Exception:  # noqa: BLE001 - the timer must never stop
                log.exception("peers: expiring stale picks failed")


class PeersCollector:
    """prometheus_client collector of a `PeerBus` (register it on the router's metrics registry)."""

    def __init__(self, bus: PeerBus, num_pending: Callable[[], int] | None = None,
                 num_in_flight: Callable[[], int] | None = None, num_ignored: Callable[[], int] | None = None) -> None:
        self.bus = bus
        self.num_pending = num_pending
        self.num_in_flight = num_in_flight
        self.num_ignored = num_ignored

    def describe(self) -> list:
        return []

    def collect(self):  # noqa: ANN201
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        b = self.bus
        yield GaugeMetricFamily("prefixroute_peer_connected", "1 while this replica is connected to the NATS "
                                "server its peers share state through, else 0 (it routes alone).",
                                value=1 if b.connected else 0)
        msgs = CounterMetricFamily("prefixroute_peer_messages", "Messages to and from the other replicas, by "
                                   "direction (sent, received, dropped: not sent, NATS being down or the buffer "
                                   "full) and kind (pick, done, release, failover, response; invalid: a batch that did not "
                                   "decode).", labels=["direction", "kind"])
        for direction, counts in (("sent", b.num_sent), ("received", b.num_received), ("dropped", b.num_dropped)):
            for kind, n in dict(counts).items():
                msgs.add_metric([direction, kind], n)
        yield msgs
        batches = CounterMetricFamily("prefixroute_peer_batches", "NATS messages to and from the other replicas "
                                      "(each carries the messages of --peers-linger-ms, heartbeats included), by "
                                      "direction: messages over batches is how many each costs the receivers "
                                      "once.", labels=["direction"])
        batches.add_metric(["sent"], b.num_batches_sent)
        batches.add_metric(["received"], b.num_batches_received)
        yield batches
        yield CounterMetricFamily("prefixroute_peer_refused_servers", "NATS servers this replica refused because they "
                                  "did not require its auth token (an impostor on the NATS port?).",
                                  value=b.num_refused_servers)
        if self.num_ignored is not None:
            yield CounterMetricFamily("prefixroute_peer_ignored_messages", "Other replicas' messages this replica "
                                      "ignored: a claim outside what the sender could know (a response id for an "
                                      "endpoint its pick did not go to, a failover of no pick in flight here), more "
                                      "in flight than --peers-max-in-flight-per-peer, or figures out of range.",
                                      value=self.num_ignored())
        if self.num_pending is not None:
            yield GaugeMetricFamily("prefixroute_peer_pending_picks", "Other replicas' picks still prefilling that "
                                    "this replica counts in its endpoints' queues (each expires after "
                                    "--peers-pending-ttl-s without its end).", value=self.num_pending())
        if self.num_in_flight is not None:
            yield GaugeMetricFamily("prefixroute_peer_in_flight", "Other replicas' requests in flight that this "
                                    "replica counts in its endpoints' loads.", value=self.num_in_flight())
