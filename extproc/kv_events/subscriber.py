"""Subscribers to the endpoints' KV-event publishers (ZMQ on the router's event loop), feeding `KVEventIndex`.

One `EndpointSubscriber` per endpoint: a SUB socket on the endpoint's PUB address (topic-prefix filter) and,
when the endpoint has one, a DEALER on its replay (ROUTER) address, speaking the ``ZmqEventPublisher`` protocol
of vLLM and SGLang (`prefixroute.kv_events_wire`; every release's wire form decodes, detected per batch).
`KVEventsManager` starts and stops them as the pool's endpoints change.

States (`SubscriberStats.state`; the KV-events link routes by events only for ``live`` endpoints, every other
endpoint is matched by the router's own index, *feedback*, as when it publishes nothing):

- ``syncing``: subscribed, rebuilding the index from the replay socket (or never yet connected).
- ``live``: the index follows the publisher's stream.
- ``down``: the SUB connection is not up (socket monitor; heartbeats catch a silent host).
- ``undecodable``: `UNDECODABLE_IN_A_ROW` batches in a row, or `UNDECODABLE_IN_WINDOW` of the last
  `UNDECODABLE_WINDOW`, did not decode (a publisher speaking a form no release we know speaks). Logged once as an
  ERROR naming the endpoint, the payload's first bytes and the decoder's message. Ends after `RECOVER_AFTER`
  batches in a row decode.
- ``block_size_mismatch``: the publisher's GPU blocks are not a multiple of the router's ``kv_block_tokens`` (none of
  them can match a request); ends when a GPU store of the right size arrives.
(The link adds ``token_mismatch``, a tokenization that never matches: `KVEventIndex.tokens_unverified`.)

Late join: on subscribing the subscriber asks the replay socket for the publisher's whole buffer at once (not
at the first live batch: a quiet publisher sends none, and a cache hit publishes nothing) and applies it before
the endpoint is ``live``: a publisher younger than its replay buffer (vLLM and SGLang keep ``buffer_steps`` =
10,000 batches) is rebuilt in full; an older one leaves out blocks stored before the buffer's oldest batch (an
under-estimate: a suffix of the event stream applied in order to an empty index can only miss stores, and
blocks chained to missed ones are dropped as orphans). The same resync runs when the connection comes back
after a drop: the replay shows whether the publisher is the one we followed (the batch we applied last is in
its buffer, byte for byte: continue after it) or a new process (its buffer ends before our last batch:
``publisher_restart``; or does not hold our last batch: ``reconnect_gap``): then the endpoint is cleared and
rebuilt from the replay. A replay that does not answer leaves the endpoint ``syncing`` until the next live
batch, which is then applied as at first contact (with what a replay up to it returns).

Sequence handling on the live stream (``last`` = the sequence number of the last batch applied):
- ``seq == last + 1``: applied; ``seq <= last``: a duplicate (already replayed), dropped.
- ``seq > last + 1`` (a gap: the subscriber fell behind its receive buffer, or a message was lost): replay
  from ``last + 1``; the replayed batches are applied in order and duplicates dropped. When the replay cannot
  fill the gap (no replay address, the buffer no longer holds ``last + 1``, no answer within
  ``replay_timeout_s``) the endpoint is cleared (a lost `BlockRemoved` would leave blocks the server no longer
  holds) and the contiguous tail of what the replay did return is applied, as at first contact.
- ``seq <=`` the last sequence number seen on the live stream: the publisher restarted (sequence numbers
  restart from 0 per process): cleared and rebuilt as at first contact.
- A payload that does not decode: counted, the endpoint cleared (its events are lost), and the undecodable
  rule above applied.
ZMQ reconnects by itself (100 ms, backing off to 2 s); heartbeats (``heartbeat_s``) detect a publisher that
went silent without closing the connection (host gone), so a restart behind it is noticed.

Blocks on other media (CPU offload, disk: vLLM's offloading connector, SGLang's HiCache) are counted per medium
(`SubscriberStats.stored_blocks_by_medium`, ``removed_blocks_by_medium``) and not indexed; ``on_batch`` sees
every decoded batch before it is applied (a tier-aware index can follow them).

Ingestion never delays a routing decision for long: it runs on the router's event loop (a thread would contend
for the GIL and add up to the 5 ms switch interval to a decision), decodes with msgspec (one decode per batch,
the form cached), and applies at most ``chunk_blocks`` blocks between ``await asyncio.sleep(0)`` (about 0.1 ms
of work at the default 64). ``scripts/bench_kv_events.py`` measures throughput and the latency added to
concurrent ``match`` calls.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import xxhash
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from prefixroute.extproc.kv_events.index import KVEventIndex
from prefixroute.types import EndpointId
from prefixroute.kv_events_wire import (END_SEQ, GPU_MEDIA, BatchDecoder, BlockRemoved, BlockStored, EventBatch,
                                   KVEventsDecodeError, seq_from_bytes, seq_to_bytes)

log = logging.getLogger(__name__)

CLEAR_REASONS: dict[str, str] = {
    "all_blocks_cleared": "the server emptied its prefix cache (AllBlocksCleared event)",
    "replay_unavailable": "a sequence gap the replay could not fill (no replay socket, buffer too short, timeout)",
    "publisher_restart": "the sequence went backwards, or the replay after a reconnect ends before the last batch "
                         "applied: the server's publisher restarted",
    "reconnect_gap": "after a reconnect the publisher's stream is not the one followed: it may have restarted",
    "decode_error": "a batch that does not decode (its events are lost)",
    "address_changed": "the endpoint's event address changed",
}
"""Why an endpoint's events-index entries were dropped, as passed to ``on_cleared(endpoint, reason)``."""

STATES = ("syncing", "live", "down", "undecodable", "block_size_mismatch")
"""`SubscriberStats.state` values (module docstring)."""
UNDECODABLE_IN_A_ROW = 2
"""Batches in a row that do not decode before the endpoint is ``undecodable``: a publisher of an unknown form
fails every batch, so two are proof enough, and one stray batch (a bug in one event) is not."""
UNDECODABLE_WINDOW = 16
UNDECODABLE_IN_WINDOW = 4
"""... or this many of the last `UNDECODABLE_WINDOW` batches (a form that fails on some batches only)."""
RECOVER_AFTER = 8
"""Batches decoded in a row that end an ``undecodable`` state."""

OnCleared = Callable[[EndpointId, str], Any]
OnState = Callable[[EndpointId, str], Any]
OnBatch = Callable[[EndpointId, int, EventBatch], Any]

_RCVHWM = 100_000  # vLLM's publisher default hwm: queue this many batches while a replay or a long batch runs
_DRAIN_MESSAGES = 64  # messages read per wake-up before the monitor socket is looked at again
_digest = xxhash.xxh3_64_intdigest


@dataclasses.dataclass
class SubscriberStats:
    """One endpoint's subscription, for /metrics (cumulative counts)."""

    pub_address: str
    replay_address: str | None
    connected: bool = False  # the SUB socket's TCP connection is up (socket monitor)
    state: str = "syncing"  # STATES (module docstring)
    state_detail: str = ""  # why, for a state other than live/syncing (the decoder's message, ...)
    form: str | None = None  # the wire form of the last batch decoded (prefixroute.kv_events_wire.FORMS)
    last_seq: int | None = None  # sequence number of the last batch applied
    num_batches: int = 0  # batches applied (live and replayed)
    num_events: int = 0  # events in them
    num_gaps: int = 0  # sequence gaps detected
    num_replays: int = 0  # replay requests sent (gaps, subscribing, reconnects)
    num_replay_failures: int = 0  # replays that could not cover a gap
    num_sync_failures: int = 0  # replays at subscribe/reconnect that did not answer
    num_duplicates: int = 0  # batches dropped as already applied
    num_restarts: int = 0  # publisher restarts detected
    num_decode_errors: int = 0  # messages that did not decode
    num_unknown_events: int = 0  # events of a type no release defines (skipped)
    num_clears: int = 0  # times the endpoint's entries were dropped (any CLEAR_REASONS)
    num_reconnects: int = 0  # connections re-established after a drop
    last_event_monotonic_s: float | None = None  # time.monotonic() of the last message received
    stored_blocks_by_medium: dict[str, int] = dataclasses.field(default_factory=dict)  # not GPU: not indexed
    removed_blocks_by_medium: dict[str, int] = dataclasses.field(default_factory=dict)


class EndpointSubscriber:
    """Follows one endpoint's KV events into `index` (module docstring). `start()` from the event loop.

    Hooks (called on the event loop; exceptions are logged, never raised): `on_cleared(endpoint, reason)` when
    its entries are dropped, `on_state(endpoint, state)` when its state changes, `on_batch(endpoint, seq,
    batch)` with every decoded batch before it is applied."""

    def __init__(self, endpoint: EndpointId, index: KVEventIndex, pub_address: str, replay_address: str | None,
                 *, context: zmq.asyncio.Context, topic: str = "", replay_timeout_s: float = 1.0,
                 chunk_blocks: int = 64, heartbeat_s: float = 1.0, on_cleared: OnCleared | None = None,
                 on_state: OnState | None = None, on_batch: OnBatch | None = None) -> None:
        self.endpoint = endpoint
        self.index = index
        self.pub_address = pub_address
        self.replay_address = replay_address or None
        self._ctx = context
        self._topic = topic.encode("utf-8")
        self._replay_timeout_s = replay_timeout_s
        self._chunk_blocks = max(1, chunk_blocks)
        self._heartbeat_ms = max(1, int(heartbeat_s * 1000))
        self._on_cleared = on_cleared
        self._on_state = on_state
        self._on_batch = on_batch
        self._stats = SubscriberStats(pub_address, self.replay_address)
        self._decoder = BatchDecoder()
        self._last_live: int | None = None  # last sequence number seen on the live stream (this publisher)
        self._last_digest: int | None = None  # xxh3 of the last batch applied (is the publisher still ours?)
        self._dropped = False  # the connection dropped since the last message
        self._ever_connected = False
        self._synced = False  # the index holds the publisher's history (module docstring: late join)
        self._syncing = True  # a replay of the whole buffer is running (or has not run yet)
        self._undecodable = False
        self._undecodable_detail = ""
        self._bad_in_a_row = 0
        self._good_in_a_row = 0
        self._window: collections.deque[bool] = collections.deque(maxlen=UNDECODABLE_WINDOW)
        self._size_mismatch: int | None = None
        self._reported_state: str | None = None
        self._task: asyncio.Task | None = None

    # --- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events {self.endpoint}")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - already logged by _run
                pass

    def stats(self) -> SubscriberStats:
        st = self._stats
        st.state, st.state_detail = self._state()
        st.num_unknown_events = self._decoder.num_unknown_events
        return dataclasses.replace(st, stored_blocks_by_medium=dict(st.stored_blocks_by_medium),
                                   removed_blocks_by_medium=dict(st.removed_blocks_by_medium))

    @property
    def state(self) -> str:
        return self._state()[0]

    def _state(self) -> tuple[str, str]:
        st = self._stats
        if self._undecodable:
            return "undecodable", self._undecodable_detail
        if self._size_mismatch is not None:
            return "block_size_mismatch", (f"its GPU blocks hold {self._size_mismatch} tokens, not a multiple of "
                                           f"the router's {self.index.block_size}-token blocks (--kv-block-tokens)")
        if self._syncing:
            return "syncing", ""
        if not st.connected:
            return "down", f"not connected to {self.pub_address}"
        if not self._synced:
            return "syncing", ""
        return "live", ""

    def _report_state(self) -> None:
        state = self._state()[0]
        if state == self._reported_state:
            return
        self._reported_state = state
        if self._on_state is not None:
            try:
                self._on_state(self.endpoint, state)
            except Exception:  # noqa: BLE001 - a hook must not stop the subscription
                log.exception("on_state hook failed for %s", self.endpoint)

    # --- the loop ------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        mon = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, _RCVHWM)
            sub.setsockopt(zmq.RECONNECT_IVL, 100)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sub.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ms)
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * self._heartbeat_ms)
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            mon = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sub.connect(self.pub_address)
            # Late join: ask for the publisher's buffer now (live batches queue in the SUB socket meanwhile).
            await self._resync()
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(mon, zmq.POLLIN)
            while True:
                ready = dict(await poller.poll())
                if mon in ready:
                    await self._drain_monitor(mon)
                if sub in ready:
                    for _ in range(_DRAIN_MESSAGES):
                        try:
                            frames = await sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        await self._on_message(frames)
                        if mon.poll(0):  # a drop must be seen before the next message (reconnect_gap)
                            await self._drain_monitor(mon)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("KV-event subscriber for %s stopped", self.endpoint)
            raise
        finally:
            self._stats.connected = False
            if mon is not None:
                try:
                    sub.disable_monitor()
                except zmq.ZMQError:
                    pass
                mon.close(linger=0)
            sub.close(linger=0)

    async def _drain_monitor(self, mon: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                event = parse_monitor_message(frames)["event"]
            except Exception:  # noqa: BLE001 - a malformed monitor message is not worth dying for
                continue
            if event == zmq.EVENT_CONNECTED:
                self._stats.connected = True
                if self._ever_connected:
                    self._stats.num_reconnects += 1
                self._ever_connected = True
                if self.replay_address and (self._dropped or not self._synced):
                    await self._resync()  # back after a drop (or the first sync found nobody): rebuild
                self._report_state()
            elif event == zmq.EVENT_DISCONNECTED:
                self._stats.connected = False
                self._dropped = True
                self._report_state()

    async def _on_message(self, frames: list[bytes]) -> None:
        st = self._stats
        st.last_event_monotonic_s = time.monotonic()
        if len(frames) not in (2, 3):
            st.num_decode_errors += 1  # without a sequence number the loss shows as the next gap
            return
        try:
            seq = seq_from_bytes(frames[-2])
        except KVEventsDecodeError:
            st.num_decode_errors += 1
            return
        last = st.last_seq
        if self._last_live is not None and seq <= self._last_live:
            st.num_restarts += 1
            self._clear("publisher_restart")
        elif self._dropped and last is not None and seq > last + 1:
            st.num_gaps += 1
            self._clear("reconnect_gap")
        self._dropped = False
        self._last_live = seq
        last = st.last_seq
        if last is None:
            if seq > 0 and self.replay_address:
                await self._catch_up(0, seq, must_cover=False)
            self._synced = True
        elif seq <= last:
            st.num_duplicates += 1
            return
        elif seq > last + 1:
            st.num_gaps += 1
            await self._catch_up(last + 1, seq, must_cover=True)
        await self._apply(seq, frames[-1])
        self._report_state()

    # --- replay --------------------------------------------------------------------------------------------
    async def _resync(self) -> None:
        """Replay the publisher's whole buffer (module docstring: late join, reconnects). Without a replay
        address the index is trusted as it is (it follows the live stream from here)."""
        st = self._stats
        if not self.replay_address:
            self._synced = True
            self._syncing = False
            self._report_state()
            return
        self._syncing = True
        self._report_state()
        answered = False
        try:
            got = await self._replay(0)
            if got is None:  # no answer: live batches decide (first contact, or the reconnect rules)
                st.num_sync_failures += 1
                if st.last_seq is None:
                    self._synced = False
                return
            answered = True
            by_seq = dict(got)
            last = st.last_seq
            if last is not None:
                mine = by_seq.get(last)
                if mine is not None and _digest(mine) == self._last_digest:
                    s = last + 1  # the same publisher: apply what it published meanwhile
                    while s in by_seq:
                        await self._apply(s, by_seq[s])
                        s += 1
                    self._synced = True
                    return
                if not by_seq or max(by_seq) < last:
                    st.num_restarts += 1
                    self._clear("publisher_restart")
                else:
                    self._clear("reconnect_gap")
                self._last_live = None
            if by_seq:
                end = max(by_seq)
                s = end
                while s - 1 in by_seq:
                    s -= 1
                for k in range(s, end + 1):  # the contiguous run that ends at the newest batch
                    await self._apply(k, by_seq[k])
            self._synced = True
        finally:
            self._syncing = False
            if answered:
                self._dropped = False
            self._report_state()

    async def _catch_up(self, start: int, upto: int, *, must_cover: bool) -> None:
        """Apply the batches ``start .. upto - 1`` from the replay socket. `must_cover`: the index already
        holds batches up to ``start - 1``, so an incomplete replay clears the endpoint first. Either way the
        contiguous run of replayed batches ending at ``upto - 1`` is applied (to a cleared endpoint, a suffix
        of the stream)."""
        got = await self._replay(start) if self.replay_address else None
        run: list[tuple[int, bytes]] = []
        if got:
            by_seq = {s: p for s, p in got if start <= s < upto}
            s = upto - 1
            while s in by_seq:  # the contiguous run ending just before `upto`
                run.append((s, by_seq[s]))
                s -= 1
            run.reverse()
        covered = bool(run) and run[0][0] == start or upto == start
        if must_cover and not covered:  # (at first contact a partial history is expected, not a failure)
            self._stats.num_replay_failures += 1
            self._clear("replay_unavailable")
        for s, payload in run:
            await self._apply(s, payload)

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The (seq, payload) pairs the publisher's replay socket returns from `start` on, in order, up to its
        end marker or `replay_timeout_s` of silence (what arrived by then; None when nothing did). Reads both
        answer forms: ``(seq, payload)`` and ``(topic, seq, payload)`` (the last two frames; with a topic, only
        the subscribed topic prefix's batches, as on the live stream)."""
        assert self.replay_address is not None
        self._stats.num_replays += 1
        sock = self._ctx.socket(zmq.DEALER)  # a fresh socket per replay: a late answer to an old one is never read
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        timeout_ms = max(1, int(self._replay_timeout_s * 1000))
        try:
            sock.connect(self.replay_address)
            await asyncio.wait_for(sock.send_multipart([b"", seq_to_bytes(start)]), self._replay_timeout_s)
            while True:
                if not await sock.poll(timeout_ms):  # silence between messages: the publisher is not answering
                    return out or None
                frames = await sock.recv_multipart()
                if len(frames) < 2:
                    continue
                raw_seq, payload = frames[-2], frames[-1]  # after the delimiter (and the topic, vLLM >= 0.26)
                if raw_seq == END_SEQ:
                    return out
                if len(frames) >= 4 and not frames[-3].startswith(self._topic):
                    continue  # a batch of a topic not subscribed to (the live stream's prefix filter)
                try:
                    out.append((seq_from_bytes(raw_seq), payload))
                except KVEventsDecodeError:
                    self._stats.num_decode_errors += 1
        except (asyncio.TimeoutError, zmq.ZMQError):
            return out or None
        finally:
            sock.close(linger=0)

    # --- applying ------------------------------------------------------------------------------------------
    async def _apply(self, seq: int, payload: bytes) -> None:
        st = self._stats
        try:
            batch = self._decoder.decode(payload)
        except KVEventsDecodeError as exc:
            self._undecodable_batch(seq, payload, exc)
            return
        self._window.append(True)
        self._bad_in_a_row = 0
        self._good_in_a_row += 1
        if self._undecodable and self._good_in_a_row >= RECOVER_AFTER:
            self._undecodable = False
            log.warning("KV events of %s decode again (%d batches in a row, form %s): matching by its events",
                        self.endpoint, self._good_in_a_row, self._decoder.form)
        st.form = self._decoder.form
        if self._on_batch is not None:
            try:
                self._on_batch(self.endpoint, seq, batch)
            except Exception:  # noqa: BLE001
                log.exception("on_batch hook failed for %s", self.endpoint)
        index, ep = self.index, self.endpoint
        before = index.num_all_cleared(ep)
        for ev in batch.events:  # other media: counted here, skipped by the index
            t = type(ev)
            if (t is BlockStored or t is BlockRemoved) and ev.medium not in GPU_MEDIA:
                by = st.stored_blocks_by_medium if t is BlockStored else st.removed_blocks_by_medium
                by[ev.medium] = by.get(ev.medium, 0) + len(ev.block_hashes)  # type: ignore[index]
        for _ in index.apply_events(ep, batch.events, self._chunk_blocks):
            await asyncio.sleep(0)  # let routing decisions run between chunks
        st.last_seq = seq
        self._last_digest = _digest(payload)
        st.num_batches += 1
        st.num_events += len(batch.events)
        if index.num_all_cleared(ep) != before:
            st.num_clears += 1
            self._notify("all_blocks_cleared")
        mismatch = index.block_size_mismatch(ep)
        if mismatch != self._size_mismatch:
            self._size_mismatch = mismatch
            if mismatch is not None:
                log.error("KV events of %s (%s): its GPU blocks hold %d tokens, neither a multiple nor a divisor "
                          "of the router's %d-token blocks (--kv-block-tokens): none can match a request; its prefix matches come "
                          "from the router's own index (feedback) until they agree (set --kv-block-tokens to %d or "
                          "a divisor of it, or the server's block/page size to a multiple of %d)", self.endpoint,
                          self.pub_address, mismatch, index.block_size, mismatch, index.block_size)
            self._report_state()

    def _undecodable_batch(self, seq: int, payload: bytes, exc: KVEventsDecodeError) -> None:
        st = self._stats
        st.num_decode_errors += 1
        self._window.append(False)
        self._bad_in_a_row += 1
        self._good_in_a_row = 0
        if st.num_decode_errors in (1, 10, 100) or st.num_decode_errors % 1000 == 0:
            log.warning("KV events of %s: batch %d does not decode (%d so far): %s", self.endpoint, seq,
                        st.num_decode_errors, exc)
        self._clear("decode_error")
        st.last_seq = seq
        self._last_digest = _digest(payload)
        if not self._undecodable and (self._bad_in_a_row >= UNDECODABLE_IN_A_ROW
                                      or self._window.count(False) >= UNDECODABLE_IN_WINDOW):
            self._undecodable = True
            self._undecodable_detail = f"{exc} (first bytes {payload[:24].hex()})"
            log.error("KV events of %s (%s) do not decode: %d of the last %d batches failed; first bytes %s: %s. "
                      "Its prefix matches come from the router's own index (feedback) until its events decode "
                      "again", self.endpoint, self.pub_address, self._window.count(False), len(self._window),
                      payload[:24].hex(), exc)
            self._report_state()

    def _clear(self, reason: str) -> None:
        """Drop the endpoint's entries and restart its stream as at first contact."""
        self.index.clear_endpoint(self.endpoint)
        self._stats.last_seq = None
        self._last_digest = None
        self._stats.num_clears += 1
        self._notify(reason)

    def _notify(self, reason: str) -> None:
        if reason != "all_blocks_cleared":
            log.info("KV events of %s: index entries dropped (%s)", self.endpoint, reason)
        if self._on_cleared is not None:
            try:
                self._on_cleared(self.endpoint, reason)
            except Exception:  # noqa: BLE001 - a hook must not stop the subscription
                log.exception("on_cleared hook failed for %s", self.endpoint)


class KVEventsManager:
    """One `EndpointSubscriber` per endpoint that publishes events; `sync` follows the pool's membership.

    `sync`, `stats` and `close` are called from the router's event loop. An endpoint leaving (or its address
    changing) takes its index entries with it."""

    def __init__(self, index: KVEventIndex, *, topic: str = "", replay_timeout_s: float = 1.0,
                 chunk_blocks: int = 64, heartbeat_s: float = 1.0, on_cleared: OnCleared | None = None,
                 on_state: OnState | None = None, on_batch: OnBatch | None = None,
                 context: zmq.asyncio.Context | None = None) -> None:
        self.index = index
        self.replay_timeout_s = replay_timeout_s
        self._own_context = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._kwargs = dict(topic=topic, replay_timeout_s=replay_timeout_s, chunk_blocks=chunk_blocks,
                            heartbeat_s=heartbeat_s, on_cleared=on_cleared, on_state=on_state, on_batch=on_batch)
        self._on_cleared = on_cleared
        self._subs: dict[EndpointId, EndpointSubscriber] = {}
        self._closing: set[asyncio.Task] = set()

    def sync(self, addresses: Mapping[EndpointId, tuple[str, str | None]]) -> None:
        """Subscribe to exactly these endpoints: ``{endpoint: (pub_address, replay_address or None)}``.
        New ones start, missing ones stop (their entries are removed from the index), changed addresses
        restart (entries cleared, reason ``address_changed``)."""
        for ep in [ep for ep in self._subs if ep not in addresses]:
            self._stop(ep)
            self.index.remove_endpoint(ep)
        for ep, (pub, replay) in addresses.items():
            old = self._subs.get(ep)
            if old is not None:
                if (old.pub_address, old.replay_address) == (pub, replay or None):
                    continue
                self._stop(ep)
                self.index.clear_endpoint(ep)
                if self._on_cleared is not None:
                    try:
                        self._on_cleared(ep, "address_changed")
                    except Exception:  # noqa: BLE001
                        log.exception("on_cleared hook failed for %s", ep)
            sub = self._subs[ep] = EndpointSubscriber(ep, self.index, pub, replay, context=self._ctx,
                                                      **self._kwargs)
            sub.start()

    def _stop(self, ep: EndpointId) -> None:
        sub = self._subs.pop(ep)
        task = asyncio.get_running_loop().create_task(sub.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def endpoints(self) -> list[EndpointId]:
        return list(self._subs)

    def stats(self) -> dict[EndpointId, SubscriberStats]:
        """Per subscribed endpoint: its `SubscriberStats` (copies)."""
        return {ep: sub.stats() for ep, sub in list(self._subs.items())}

    def states(self) -> dict[EndpointId, str]:
        """Per subscribed endpoint: its state (`STATES`)."""
        return {ep: sub.state for ep, sub in list(self._subs.items())}

    async def close(self) -> None:
        """Stop every subscriber and release the ZMQ context (when the manager made it)."""
        for ep in list(self._subs):
            self._stop(ep)
        if self._closing:
            await asyncio.gather(*list(self._closing), return_exceptions=True)
        if self._own_context:
            self._ctx.term()
