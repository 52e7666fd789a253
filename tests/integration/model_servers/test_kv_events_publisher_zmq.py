"""The simulated servers' KV-event publisher over real ZMQ on loopback: the PUB wire (topic, 8-byte big-endian seq
from 0, msgpack EventBatch), replay from a sequence number, the end marker, connect mode, a full queue's gap."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import zmq

from helpers import free_ports
from helpers.waiting import until
from prefixroute.kv_events_wire import (END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, decode_batch,
                                        seq_from_bytes, seq_to_bytes)
from prefixroute.model_servers.kv_events_publisher import KVEventsConfig, ZmqEventPublisher

pytestmark = pytest.mark.integration

TIMEOUT_MS = 5000


# -- wire ----------------------------------------------------------------------------------------------
def _stored(i: int) -> BlockStored:
    return BlockStored([1000 + i, 2000 + i], None if i == 0 else 999, np.arange(32) + i, 16, None, "GPU", None)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _publisher(ctx, **kw) -> ZmqEventPublisher:
    cfg = KVEventsConfig(enable_kv_cache_events=True, **{"endpoint": "tcp://127.0.0.1:*",
                                                         "replay_endpoint": "tcp://127.0.0.1:*", **kw})
    return ZmqEventPublisher(cfg, context=ctx)


def _subscribe(ctx, addr: str, topic: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.connect(addr)
    return sub


def _join(pub: ZmqEventPublisher, sub: zmq.Socket) -> int:
    """Publish probe batches until the subscription is live (ZMQ's slow joiner); the last probe's seq."""
    def probe() -> bool:
        pub.publish([AllBlocksCleared()])
        return bool(sub.poll(50))

    until(probe, 5, interval_s=0, message="the subscription joined")
    last = -1
    while sub.poll(50):
        last = seq_from_bytes(sub.recv_multipart()[1])
    return last


def _replay(ctx, addr: str, start: int, topic: bytes = b"") -> list[tuple[int, bytes]]:
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    req.connect(addr)
    try:
        req.send_multipart((b"", seq_to_bytes(start)))
        out = []
        while True:
            frames = req.recv_multipart()  # vLLM 0.33's frames: (b"", topic, seq, payload), (b"", b"", END, b"")
            assert frames[0] == b"" and len(frames) == 4
            if frames[2] == END_SEQ:
                assert frames[1] == frames[3] == b""
                return out
            assert frames[1] == topic
            out.append((seq_from_bytes(frames[2]), frames[3]))
    finally:
        req.close(linger=0)


def test_pub_wire_round_trip_and_replay(ctx):
    pub = _publisher(ctx, topic="kv-events")
    try:
        sub = _subscribe(ctx, pub.endpoint, b"kv-events")
        last_probe = _join(pub, sub)
        sent = [[_stored(i), BlockRemoved([1000 + i], "GPU")] for i in range(5)]
        want_tokens = [ev[0].token_ids.tolist() for ev in sent]  # the publisher hands the events off (encodes)
        seqs = [pub.publish(ev) for ev in sent]
        assert seqs == list(range(last_probe + 1, last_probe + 6))
        got = [sub.recv_multipart() for _ in sent]
        for (topic, raw_seq, payload), seq, ev, tokens in zip(got, seqs, sent, want_tokens):
            assert topic == b"kv-events" and len(raw_seq) == 8 and int.from_bytes(raw_seq, "big") == seq
            batch = decode_batch(payload)
            assert batch.data_parallel_rank == 0 and abs(batch.ts - time.time()) < 5
            s, r = batch.events
            assert s.block_hashes == ev[0].block_hashes and s.token_ids == tokens
            assert s.parent_block_hash == ev[0].parent_block_hash and s.block_size == 16 and s.medium == "GPU"
            assert r == BlockRemoved([r.block_hashes[0]], "GPU")
        # replay from 0: every batch from the first (sequence numbers start at 0), then the end marker
        everything = _replay(ctx, pub.replay_endpoint, 0, b"kv-events")
        assert [s for s, _ in everything] == list(range(seqs[-1] + 1))
        assert everything[-5:] == [(seq, payload) for (_, _, payload), seq in zip(got, seqs)]
        # replay from a sequence number: only the batches from there on
        assert [s for s, _ in _replay(ctx, pub.replay_endpoint, seqs[2], b"kv-events")] == seqs[2:]
        assert _replay(ctx, pub.replay_endpoint, seqs[-1] + 1, b"kv-events") == []  # nothing newer: just the end marker
        assert pub.num_replay_requests == 3
        assert pub.num_batches_published == seqs[-1] + 1 and pub.num_events_published == 2 * 5 + last_probe + 1
        sub.close(linger=0)
    finally:
        pub.shutdown()


def test_replay_keeps_only_buffer_steps(ctx):
    pub = _publisher(ctx, buffer_steps=3)
    try:
        for i in range(10):
            pub.publish([_stored(i)])
        until(lambda: pub.num_batches_published >= 10, 5, interval_s=0.01, message="10 batches published")
        assert [s for s, _ in _replay(ctx, pub.replay_endpoint, 0)] == [7, 8, 9]
    finally:
        pub.shutdown()


def test_connect_mode_to_a_binding_subscriber(ctx):
    """An endpoint without a wildcard is connected to (vLLM's rule): the subscriber binds, the server dials."""
    port, = free_ports(1)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.bind(f"tcp://*:{port}")
    # This host's name, not a loopback literal (which the simulator binds): dialled like any remote address.
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True,
                                           endpoint=f"tcp://{socket.gethostname()}:{port}"), context=ctx)
    try:
        assert pub.replay_endpoint is None
        _join(pub, sub)
    finally:
        pub.shutdown()
        sub.close(linger=0)


def test_full_queue_drops_whole_batches_and_leaves_a_gap(ctx):
    """The engine never blocks: past max_queue_size a batch is dropped, but its sequence number is spent, so a
    subscriber sees the gap (and replay cannot fill it)."""
    pub = _publisher(ctx, max_queue_size=1)
    try:
        total = 3000
        for i in range(total):
            pub.publish([BlockRemoved([i], "GPU")])
        until(lambda: pub.num_batches_published + pub.num_batches_dropped >= total, 10, interval_s=0.01,
              message="every batch published or dropped")
        assert pub.num_batches_published + pub.num_batches_dropped == total
        assert pub.num_batches_dropped > 0  # 3,000 back-to-back puts outrun one encoder thread
        replayed = [s for s, _ in _replay(ctx, pub.replay_endpoint, 0)]
        assert len(replayed) == pub.num_batches_published and replayed[-1] <= total - 1
        assert len(set(range(total)) - set(replayed)) == pub.num_batches_dropped
    finally:
        pub.shutdown()


def test_bind_failure_is_raised_at_startup(ctx):
    pub = _publisher(ctx)
    try:
        with pytest.raises(zmq.ZMQError):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                                             replay_endpoint=pub.replay_endpoint), context=ctx)
    finally:
        pub.shutdown()
