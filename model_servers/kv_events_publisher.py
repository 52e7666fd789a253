"""KV-cache event publishing of a simulated server, the way vLLM does it (`--kv-events-config`).

Follows the vLLM 0.33.0 release: ``vllm/config/kv_events.py`` (`KVEventsConfig`: the JSON keys, their
defaults, ``publisher`` defaulting to ``"zmq"`` when events are enabled) and ``vllm/distributed/kv_events.py``
(`ZmqEventPublisher`). The wire format is `prefixroute.kv_events_wire`, in its "mixed" form (what 0.33 sends: the
batch a positional array, events tagged maps with 0.33's field set).

Transport, as vLLM's publisher:

- a PUB socket at ``endpoint`` sends each batch as multipart ``(topic, seq, payload)``: ``seq`` 8-byte
  big-endian from 0 in this process, ``payload`` the msgpack `EventBatch`; the PUB high-water mark is ``hwm``
  (past it ZMQ drops messages for a slow subscriber, which sees a gap in ``seq``);
- an optional ROUTER socket at ``replay_endpoint`` answers a request ``(b"", start_seq)`` with every buffered
  ``(topic, seq, payload)`` whose seq >= start_seq, then ``(b"", END_SEQ, b"")`` (vLLM >= 0.26's frames); the
  buffer holds the last ``buffer_steps`` batches;
- bind or connect: an endpoint containing ``*`` or ``::``, or an ``ipc://`` / ``inproc://`` one, is bound;
  any other is connected to (vLLM's "bind stable, connect volatile" rule: vLLM 0.32's
  ``ZmqEventPublisher._is_bind_endpoint``). Loopback only, in a form real vLLM binds:
  ``tcp://[::ffff:127.0.0.1]:5557`` (an IPv4-mapped address: it holds ``::``, and ZMQ binds it on 127.0.0.1,
  where the router connects as ``tcp://127.0.0.1:5557``); `config_json`, the local stack and the bench use
  it. ``tcp://[::1]:5557`` does not bind in ZMQ (IPv6 is off on its sockets: "No such device"), in vLLM or
  here: refused at startup with that reason. This simulator's one deviation, kept for configurations written
  for it: ``tcp://127.0.0.1:5557`` and ``tcp://localhost:5557`` are bound too (vLLM would connect to them,
  and a router would receive nothing), with a WARNING naming the form vLLM binds. ``tcp://*:5557`` binds
  every interface (the bound address is printed at startup, see server.serve). The replay socket is always
  bound.

Threading: the engine loop calls `ZmqEventPublisher.publish` (assign a sequence number, put on a queue; never
touches ZMQ, never blocks). One daemon thread owns both sockets: it encodes, sends, buffers and answers replay
requests. A batch published while the queue holds ``max_queue_size`` batches is dropped *after* taking its
sequence number, so subscribers see the loss as a gap (and, the batch never having been buffered, replay
cannot fill it: they must drop what they know of this server), rather than silently drifting; vLLM blocks the
engine there instead.
"""

from __future__ import annotations

import json

import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import Any

import msgspec
import numpy as np
import orjson
import zmq

from prefixroute.kv_events_wire import END_SEQ, BlockStored, EventBatch, encode_batch, seq_to_bytes

log = logging.getLogger("prefixroute.model_server.kv_events")

PUBLISHERS = ("null", "zmq")


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `KVEventsConfig` (same keys, same defaults). `publisher` None means "zmq" when events are
    enabled, else "null"."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        """Events are recorded and published (enabled, with the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher_name == "zmq"

    @property
    def publisher_name(self) -> str:
        if self.publisher is None:
            return "zmq" if self.enable_kv_cache_events else "null"
        return self.publisher


_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,), "publisher": (str, type(None)), "endpoint": (str,),
    "replay_endpoint": (str, type(None)), "buffer_steps": (int,), "hwm": (int,), "max_queue_size": (int,),
    "topic": (str,),
}


def parse_config(text: str) -> KVEventsConfig | None:
    """The config in `text` (a JSON object, vLLM's ``--kv-events-config``); None for an empty string.

    Raises ValueError naming the problem: not a JSON object, an unknown key (vLLM rejects those too), a value
    of the wrong type, a publisher other than null/zmq, a non-positive size, an empty endpoint."""
    if not text.strip():
        return None
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("--kv-events-config must be a JSON object, e.g. "
                         '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'')
    unknown = sorted(set(data) - set(_TYPES))
    if unknown:
        raise ValueError(f"--kv-events-config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                         f"{', '.join(_TYPES)}")
    for key, value in data.items():
        types = _TYPES[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ValueError(f"--kv-events-config: {key!r} must be {want}; got {value!r}")
    cfg = KVEventsConfig(**data)
    if cfg.publisher_name not in PUBLISHERS:
        raise ValueError(f"--kv-events-config: publisher must be one of {', '.join(PUBLISHERS)}; "
                         f"got {cfg.publisher!r}")
    for key, value in (("buffer_steps", cfg.buffer_steps), ("hwm", cfg.hwm), ("max_queue_size", cfg.max_queue_size)):
        if value < 1:
            raise ValueError(f"--kv-events-config: {key!r} must be >= 1; got {value}")
    if cfg.enabled and not cfg.endpoint:
        raise ValueError("--kv-events-config: 'endpoint' must not be empty")
    if cfg.replay_endpoint == "":
        raise ValueError("--kv-events-config: 'replay_endpoint' must be null or an address, not empty")
    for key, value in (("endpoint", cfg.endpoint), ("replay_endpoint", cfg.replay_endpoint)):
        if value and value.startswith("tcp://[::1]:"):
            raise ValueError(f"--kv-events-config: {key!r} {value!r} does not bind: ZMQ sockets have IPv6 off, so "
                             f"vLLM fails on it as well; for loopback use 'tcp://{LOOPBACK_HOST}:PORT' (vLLM binds "
                             "it on 127.0.0.1)")
    return cfg


_LOOPBACK_PREFIXES = ("tcp://127.", "tcp://localhost:")
LOOPBACK_HOST = "[::ffff:127.0.0.1]"
"""Loopback as real vLLM binds it (module docstring): the host of `config_json`'s addresses."""


def vllm_binds(endpoint: str) -> bool:
    """vLLM's own rule (0.32's ``ZmqEventPublisher._is_bind_endpoint``): bind an endpoint with a wildcard
    (``*``, ``::``) or a local transport, connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def binds(endpoint: str) -> bool:
    """What this simulator does: vLLM's rule (`vllm_binds`), and (its one deviation, module docstring) an IPv4
    loopback address is bound too."""
    return vllm_binds(endpoint) or endpoint.startswith(_LOOPBACK_PREFIXES)


_STOP = object()


class ZmqEventPublisher:
    """PUB + replay ROUTER publisher with a ring buffer (see the module docstring). Sockets are set up in the
    constructor (a bind failure raises zmq.ZMQError at startup) and used only by the publisher thread.

    Counters (read by /metrics; written by one thread each): `num_batches_published`, `num_events_published`,
    `num_batches_dropped`, `num_replay_requests`."""

    SHUTDOWN_TIMEOUT_S = 1.0
    IDLE_POLL_S = 0.01  # how long the thread waits on the queue before looking at the replay socket again

    def __init__(self, cfg: KVEventsConfig, *, data_parallel_rank: int = 0,
                 context: zmq.Context | None = None) -> None:
        self.config = cfg
        self.data_parallel_rank = data_parallel_rank
        self._ctx = context or zmq.Context.instance()
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.max_queue_size)
        self._seq = itertools.count()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=cfg.buffer_steps)
        self._topic = cfg.topic.encode()
        self.num_batches_published = 0
        self.num_events_published = 0
        self.num_batches_dropped = 0
        self.num_replay_requests = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(cfg.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if binds(cfg.endpoint):
                if not vllm_binds(cfg.endpoint):
                    port = cfg.endpoint.rpartition(":")[2]
                    log.warning("KV events: binding %s, but vLLM would connect to it (it binds only addresses "
                                "with '*' or '::') and a router would receive nothing from a real server; "
                                "tcp://%s:%s binds loopback in both", cfg.endpoint, LOOPBACK_HOST, port)
                self._pub.bind(cfg.endpoint)
            else:
                self._pub.connect(cfg.endpoint)
            self.endpoint = self._last_endpoint(self._pub, cfg.endpoint)
            self.replay_endpoint: str | None = None
            if cfg.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(cfg.replay_endpoint)
                self.replay_endpoint = self._last_endpoint(self._replay, cfg.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-publisher")
        self._thread.start()

    @staticmethod
    def _last_endpoint(sock: zmq.Socket, configured: str) -> str:
        try:
            got = sock.getsockopt(zmq.LAST_ENDPOINT)
            return got.decode() if got else configured
        except zmq.ZMQError:  # pragma: no cover - older libzmq
            return configured

    # -- engine side (any thread; cheap) -------------------------------------------------------------
    def publish(self, events: list[Any]) -> int:
        """Queue one engine step's events as one `EventBatch` (ts = now); returns its sequence number. Never
        blocks: on a full queue the batch is dropped and counted (its sequence number stays used)."""
        seq = next(self._seq)
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.num_batches_dropped += 1
        return seq

    def shutdown(self) -> None:
        """Send what is queued (within SHUTDOWN_TIMEOUT_S), stop the thread, close the sockets. Idempotent."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(_STOP, timeout=self.SHUTDOWN_TIMEOUT_S)
        except queue.Full:  # pragma: no cover - a stuck thread; it stops on the flag
            pass
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT_S)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    # -- publisher thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        pub, replay, q = self._pub, self._replay, self._queue
        buf = self._buffer
        rank = self.data_parallel_rank
        wait_s = self.IDLE_POLL_S if replay is not None else 0.1
        while True:
            if replay is not None and replay.poll(0):
                try:
                    self._service_replay()
                except Exception:  # noqa: BLE001 - a bad replay request must not stop publishing
                    log.exception("KV events replay failed")
            try:
                item = q.get(timeout=wait_s)
            except queue.Empty:
                if not self._running:
                    break
                continue
            if item is _STOP:
                break
            seq, ts, events = item
            try:
                payload = encode_batch(EventBatch(ts, materialize(events), rank))
                pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
                buf.append((seq, payload))
                self.num_batches_published += 1
                self.num_events_published += len(events)
            except Exception:  # noqa: BLE001 - keep publishing later batches (subscribers see the gap)
                log.exception("KV events publish failed (seq %d)", seq)
                time.sleep(0.01)

    def _service_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("invalid KV events replay request (%d frames)", len(frames))
            return
        client, _, raw = frames
        start = int.from_bytes(raw, "big")
        self.num_replay_requests += 1
        for seq, payload in [e for e in self._buffer if e[0] >= start]:
            self._replay.send_multipart((client, b"", self._topic, seq_to_bytes(seq), payload), copy=False)
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


_UINT32_ITEM = np.dtype([("marker", "u1"), ("value", ">u4")])  # msgpack uint 32: 0xce + 4 bytes big-endian


def msgpack_uint_array(ids: np.ndarray) -> msgspec.Raw:
    """Token ids (non-negative, < 2**32) as a pre-encoded msgpack array (array 32 of uint 32 items), built by
    numpy: ~10x cheaper than ``tolist()`` + encoding, the bulk of a batch's cost. Non-minimal widths are valid
    msgpack; every decoder reads them as the same ints."""
    items = np.empty(len(ids), _UINT32_ITEM)
    items["marker"] = 0xCE
    items["value"] = ids
    return msgspec.Raw(b"\xdd" + len(ids).to_bytes(4, "big") + items.tobytes())


def materialize(events: list[Any]) -> list[Any]:
    """`events` as the engine recorded them, ready to encode: a `BlockStored` may carry its token ids as a numpy
    slice (the engine loop does not convert them), pre-encoded here, on the publisher thread. Encode the
    result with msgspec (it splices `msgspec.Raw` in verbatim)."""
    for e in events:
        if type(e) is BlockStored and isinstance(e.token_ids, np.ndarray):
            e.token_ids = msgpack_uint_array(e.token_ids)
    return events


def config_json(pub_port: int, replay_port: int | None = None, *, host: str = LOOPBACK_HOST,
                topic: str = "kv-events") -> str:
    """A ``--kv-events-config`` (vLLM's KVEventsConfig JSON) publishing on `host`:`pub_port` and answering replays
    on `replay_port` (None: pub_port + 1). Loopback by default, in the form real vLLM binds as well as this
    simulator (`LOOPBACK_HOST`): the same JSON starts either; a router connects to ``tcp://127.0.0.1:PORT``."""
    replay = pub_port + 1 if replay_port is None else replay_port
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{host}:{pub_port}",
                       "replay_endpoint": f"tcp://{host}:{replay}", "topic": topic}, separators=(",", ":"))
