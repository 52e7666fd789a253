"""A real `prefixroute model-server --kv-events-config` process publishing while requests run: a subscriber
that joins late and fills the start by replay ends up with exactly as many blocks as the server reports
(`prefixroute:kv_cached_blocks`), through evictions and a /reset_prefix_cache."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import orjson
import pytest
import zmq
from helpers import free_ports
from helpers.waiting import until_async
from prometheus_client.parser import text_string_to_metric_families

from prefixroute.kv_events_wire import (END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, decode_batch,
                                   seq_from_bytes, seq_to_bytes)

pytestmark = pytest.mark.integration

TOPIC = "kv-events"


class Subscriber(threading.Thread):
    """A consumer as a router would be: SUB on the PUB port; on the first message it asks the replay socket for
    everything before it; applies batches strictly in sequence order."""

    def __init__(self, pub: str, replay: str) -> None:
        super().__init__(daemon=True)
        self.pub, self.replay = pub, replay
        self.ctx = zmq.Context()
        self.held: set[int] = set()
        self.next_seq = 0
        self.num_replayed = 0
        self.topics: set[bytes] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.error: BaseException | None = None

    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.next_seq, f"gap: got {seq}, expected {self.next_seq}"
        for ev in decode_batch(payload).events:
            if isinstance(ev, BlockStored):
                self.held.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.held.difference_update(ev.block_hashes)
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.held.clear()
        self.next_seq = seq + 1

    def fill(self, upto: int) -> None:
        req = self.ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.RCVTIMEO, 5000)
        req.connect(self.replay)
        req.send_multipart((b"", seq_to_bytes(self.next_seq)))
        while True:
            raw, payload = req.recv_multipart()[-2:]  # (b"", topic, seq, payload); end: (b"", b"", END, b"")
            if raw == END_SEQ:
                break
            seq = seq_from_bytes(raw)
            if seq < upto:
                self.apply(seq, payload)
                self.num_replayed += 1
        req.close(linger=0)

    def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        sub.connect(self.pub)
        try:
            # A fixed wait on purpose: ZMQ says nothing when a subscription has reached the publisher (the slow
            # joiner); batches missed meanwhile would be filled from the replay socket all the same.
            time.sleep(0.3)
            self.ready.set()
            while not self.stop.is_set():
                if not sub.poll(50):
                    continue
                topic, raw, payload = sub.recv_multipart()
                self.topics.add(topic)
                seq = seq_from_bytes(raw)
                with self.lock:
                    if seq > self.next_seq:
                        self.fill(seq)
                    self.apply(seq, payload)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            sub.close(linger=0)
            self.ctx.destroy(linger=0)


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


async def _running(session: aiohttp.ClientSession, url: str) -> bool:
    return (await metrics(session, url))["vllm:num_requests_running"] >= 1


async def settle(session, url, sub: Subscriber) -> dict[str, float]:
    """The server's metrics once the subscriber has applied every published batch and holds as many blocks as
    the server reports (or has failed: its caller asserts `sub.error`): the engine's gauge moves at once, the
    publisher thread a moment later, so the test asks for convergence; a wrong event stream never converges
    and fails the test after 10 s."""
    async def converged() -> dict[str, float] | None:
        m = await metrics(session, url)
        published = m["prefixroute:kv_events_batches_published_total"]
        with sub.lock:
            done = sub.next_seq == published and len(sub.held) == m["prefixroute:kv_cached_blocks"]
        return m if done or sub.error is not None else None

    return await until_async(converged, 10, interval_s=0.05, message="the subscriber's blocks equal the server's")


def test_server_events_match_its_cache(server_factory):
    pub_port, replay_port = free_ports(2)
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub_port}",
           "replay_endpoint": f"tcp://*:{replay_port}", "topic": TOPIC}
    # 300 blocks = 4,800 tokens: a few prompts fill it, so blocks are evicted
    srv = server_factory("--num-gpu-blocks", "300", "--time-scale", "0.02", "--lora-modules", "ad1",
                         "--kv-events-config", orjson.dumps(cfg).decode())
    sub = Subscriber(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")

    async def chat(session, i: int) -> dict:
        system = f"System prompt {i % 5}: " + "you are a careful assistant. " * 40
        body = {"model": "ad1" if i % 4 == 0 else "meta-llama/Llama-3.1-8B-Instruct", "max_tokens": 4,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i} " * 30}]}
        if i % 3 == 0:
            body["cache_salt"] = f"tenant-{i % 2}"
        async with session.post(srv.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            # requests before the subscriber exists: it must get their events by replay
            await asyncio.gather(*(chat(session, i) for i in range(6)))
            sub.start()
            await asyncio.get_running_loop().run_in_executor(None, sub.ready.wait, 5)
            for wave in range(6):
                await asyncio.gather(*(chat(session, 6 + wave * 8 + i) for i in range(8)))
            m = await settle(session, srv.url, sub)
            assert sub.error is None, sub.error
            assert m["prefixroute:kv_block_evictions_total"] > 0  # removals were exercised
            assert sub.num_replayed > 0  # the late start was filled from the replay socket
            assert sub.next_seq == m["prefixroute:kv_events_batches_published_total"]
            assert m["prefixroute:kv_events_batches_dropped_total"] == 0
            assert m["prefixroute:kv_events_replay_requests_total"] >= 1
            assert len(sub.held) == m["prefixroute:kv_cached_blocks"] > 0
            assert sub.topics == {TOPIC.encode()}
            # reset: every hash dropped at once, but AllBlocksCleared is queued as vLLM queues it and goes out
            # with the next engine step (first in its batch): until then the subscriber holds the old blocks
            published = m["prefixroute:kv_events_batches_published_total"]
            held = set(sub.held)
            async with session.post(srv.url + "/reset_prefix_cache") as r:
                assert r.status == 200
            await asyncio.sleep(0.3)
            m = await metrics(session, srv.url)
            assert m["prefixroute:kv_cached_blocks"] == 0
            assert m["prefixroute:kv_events_batches_published_total"] == published and sub.held == held
            await chat(session, 1)
            m = await settle(session, srv.url, sub)
            assert sub.error is None, sub.error
            assert len(sub.held) == m["prefixroute:kv_cached_blocks"] > 0  # the clear applied, then the new blocks

    try:
        asyncio.run(main())
    finally:
        sub.stop.set()
        sub.join(5)


def test_reset_prefix_cache_refused_while_busy_unless_forced(server_factory):
    """vLLM: the reset fails while requests hold blocks (409 here, OpenAI format); reset_running_requests=true
    preempts them first (they recompute and still finish)."""
    srv = server_factory("--time-scale", "1.0")

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": "x " * 400, "max_tokens": 150}
            task = asyncio.ensure_future(session.post(srv.url + "/v1/completions", json=body))
            await until_async(lambda: _running(session, srv.url), 10, message="the request holding blocks")
            async with session.post(srv.url + "/reset_prefix_cache") as r:
                assert r.status == 409
                err = (await r.json())["error"]
                assert err["code"] == 409 and err["type"] == "ConflictError" and "reset_running_requests" in \
                    err["message"]
            async with session.post(srv.url + "/reset_prefix_cache?reset_running_requests=true") as r:
                assert r.status == 200
            async with session.post(srv.url + "/reset_prefix_cache?reset_running_requests=maybe") as r:
                assert r.status == 400
            async with session.get(srv.url + "/reset_prefix_cache") as r:
                assert r.status == 405
            resp = await task
            assert resp.status == 200
            out = await resp.json()
            assert out["usage"]["completion_tokens"] == 150
            m = await metrics(session, srv.url)
            assert m["vllm:num_preemptions_total"] >= 1
            assert "prefixroute:kv_events_batches_published_total" not in m  # no events configured

    asyncio.run(main())


def test_bad_kv_events_config_is_a_startup_error():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "prefixroute", "model-server", "--port", "0", "--kv-events-config",
                          '{"enable_kv_cache_events": true, "replay": "tcp://*:1"}'],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "unknown key(s) 'replay'" in out.stderr and "Traceback" not in out.stderr
