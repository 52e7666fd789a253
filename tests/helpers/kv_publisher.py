"""A small KV-event publisher for tests: ZMQ PUB + ROUTER replay, the protocol of vLLM's ZmqEventPublisher.

Contract (what the router's subscriber relies on, `prefixroute.kv_events_wire`):
- PUB (an XPUB here, identical on the wire, so a test can wait until a subscriber is there) sends multipart
  ``(topic, seq, payload)``: ``seq`` 8-byte big-endian from `start_seq` (0, like a fresh vLLM process).
- ROUTER replay socket: a request ``[identity, b"", start_seq]`` gets every buffered batch with
  ``seq >= start_seq`` as ``[identity, b"", topic, seq, payload]`` then ``[identity, b"", b"", END_SEQ, b""]``
  (vLLM >= 0.26, SGLang 0.5.23), or with ``replay_topic=False`` as ``[identity, b"", seq, payload]`` then
  ``[identity, b"", END_SEQ, b""]`` (vLLM <= 0.25). The buffer keeps the last `buffer_steps` batches. Serviced by a background thread, so the test's event loop (where the
  subscriber runs) is never needed to answer.
- Test knobs: ``publish(..., send=False)`` numbers and buffers a batch without sending it (a lost message, a
  gap the replay can fill); `forget_before` drops buffered batches (a gap it cannot fill); ``replay_delay_s``
  holds answers back (a replay timeout); ``replay=False`` binds no replay socket. A new instance on the same
  ports starts again from 0 (a publisher restart); `reopen` rebinds the PUB socket keeping the sequence (the
  same publisher back after an outage).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from prefixroute.kv_events_wire import END_SEQ, EventBatch, encode_batch, seq_from_bytes, seq_to_bytes
from prefixroute.procs import free_ports
from helpers.waiting import until


def _bind(sock: zmq.Socket, port: int, timeout_s: float = 5.0) -> None:
    def bound() -> bool:
        try:
            sock.bind(f"tcp://127.0.0.1:{port}")
        except zmq.ZMQError as exc:  # the previous socket on this port may still be closing
            if exc.errno != zmq.EADDRINUSE:
                raise
            return False
        return True

    until(bound, timeout_s, message=f"binding 127.0.0.1:{port} (its previous socket still closing)")


class KVPublisher:
    def __init__(self, pub_port: int | None = None, replay_port: int | None = None, *, topic: str = "kv-events",
                 buffer_steps: int = 10_000, replay: bool = True, start_seq: int = 0,
                 replay_delay_s: float = 0.0, replay_topic: bool = True) -> None:
        ports = free_ports(2)
        self.pub_port = pub_port or ports[0]
        self.replay_port = replay_port or ports[1]
        self.topic = topic.encode()
        self.replay_delay_s = replay_delay_s
        self.replay_topic = replay_topic
        self.next_seq = start_seq
        self._ctx = zmq.Context()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._pub = self._open_pub()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_replay_requests = 0
        if replay:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            _bind(self._router, self.replay_port)
            self._thread = threading.Thread(target=self._serve_replay, daemon=True, name="kv-replay")
            self._thread.start()

    @property
    def pub_address(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay_address(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def _open_pub(self) -> zmq.Socket:
        pub = self._ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        _bind(pub, self.pub_port)
        return pub

    def wait_subscribed(self, timeout_s: float = 10.0) -> None:
        """Block until a subscriber's subscription arrives (raises TimeoutError)."""
        if not self._pub.poll(int(timeout_s * 1000)):
            raise TimeoutError("no subscriber connected")
        while self._pub.poll(0):
            self._pub.recv()

    def publish(self, events: Sequence, *, array_like: bool = False, send: bool = True,
                topic: bytes | None = None) -> int:
        """Publish one EventBatch of `events`; its sequence number."""
        return self.publish_raw(encode_batch(EventBatch(ts=time.time(), events=list(events), data_parallel_rank=0),
                                             array_like=array_like), send=send, topic=topic)

    def publish_raw(self, payload: bytes, *, send: bool = True, topic: bytes | None = None) -> int:
        seq = self.next_seq
        self.next_seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        if send:
            self._pub.send_multipart([self.topic if topic is None else topic, seq_to_bytes(seq), payload])
        return seq

    def forget_before(self, seq: int) -> None:
        """Drop buffered batches numbered below `seq` (the replay can no longer resend them)."""
        with self._lock:
            while self._buffer and self._buffer[0][0] < seq:
                self._buffer.popleft()

    def go_down(self) -> None:
        """Close the PUB socket (the subscriber's connection drops); `reopen` brings it back."""
        self._pub.close(linger=0)

    def reopen(self) -> None:
        """Bind the PUB socket again, keeping the sequence (the same publisher after an outage)."""
        self._pub = self._open_pub()

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(20):
                continue
            frames = self._router.recv_multipart()
            if len(frames) not in (2, 3):
                continue
            self.num_replay_requests += 1
            ident, start = frames[0], seq_from_bytes(frames[-1])
            if self.replay_delay_s:
                time.sleep(self.replay_delay_s)  # a slow replay, on purpose (the tests' knob)
            with self._lock:
                batches = [(s, p) for s, p in self._buffer if s >= start]
            head = [ident, b"", self.topic] if self.replay_topic else [ident, b""]
            for s, p in batches:
                self._router.send_multipart([*head, seq_to_bytes(s), p])
            self._router.send_multipart([*head[:2], *([b""] if self.replay_topic else []), END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._router.close(linger=0)
        if not self._pub.closed:
            self._pub.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KVPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
