"""KV-event subscribers over real ZMQ on loopback (tests/helpers/kv_publisher.py speaks vLLM's protocol):
live events, gaps filled by replay, replays that cannot fill them, publisher restarts and outages."""

from __future__ import annotations

import asyncio

import pytest
import xxhash

from helpers.kv_publisher import KVPublisher
from helpers.waiting import until_async
from prefixroute.extproc.kv_events import KVEventIndex, KVEventsManager
from prefixroute.extproc.routing.hashing import hash_token_blocks, token_seed_for
from prefixroute.kv_events_wire import AllBlocksCleared, BlockRemoved, BlockStored

pytestmark = pytest.mark.integration

BS = 4
EP = "127.0.0.1:8001"


def prompt(i: int, n_blocks: int = 4) -> list[int]:
    return [1000 + i] * BS + list(range(BS * (n_blocks - 1)))


def srv(tokens, end_block) -> int:
    return xxhash.xxh3_64_intdigest(repr(tokens[:end_block * BS]).encode(), 99)  # any hash: vLLM's are random


def stored(tokens, first=0, last=None):
    last = len(tokens) // BS if last is None else last
    return BlockStored(block_hashes=[srv(tokens, i + 1) for i in range(first, last)],
                       parent_block_hash=srv(tokens, first) if first else None,
                       token_ids=tokens[first * BS:last * BS], block_size=BS, lora_id=None, medium="GPU",
                       lora_name=None)


def removed(tokens, blocks):
    return BlockRemoved(block_hashes=[srv(tokens, i + 1) for i in blocks], medium="GPU")


def held(index: KVEventIndex, tokens) -> int:
    return index.match(hash_token_blocks(tokens, BS, token_seed_for(None, None))).get(EP, 0)


class Harness:
    def __init__(self, **manager_kwargs):
        self.index = KVEventIndex(BS)
        self.cleared: list[str] = []
        manager_kwargs.setdefault("replay_timeout_s", 0.5)
        manager_kwargs.setdefault("heartbeat_s", 0.2)
        self.manager = KVEventsManager(self.index, topic="kv", on_cleared=lambda ep, why: self.cleared.append(why),
                                       **manager_kwargs)

    async def subscribe(self, pub: KVPublisher, *, replay: bool = True, live: bool = True):
        """Subscribe and (`live`) wait until the subscriber is live: its replay of the publisher's buffer done
        (a replay that does not answer keeps it syncing until the first live batch)."""
        self.manager.sync({EP: (pub.pub_address, pub.replay_address if replay else None)})
        await asyncio.to_thread(pub.wait_subscribed)
        if live:
            await until_async(lambda: self.stats().state == "live", 5, message="live")

    def stats(self):
        return self.manager.stats()[EP]

    async def applied(self, seq: int, timeout_s: float = 5.0):
        await until_async(lambda: self.stats().last_seq == seq, timeout_s, message=f"seq {seq} applied")


@pytest.fixture
async def harness():
    h = Harness()
    yield h
    await h.manager.close()


@pytest.mark.parametrize("array_like", [False, True])
async def test_live_events_of_every_type_reach_the_index(harness, array_like):
    with KVPublisher() as pub:
        await harness.subscribe(pub)
        a, b = prompt(1), prompt(2)
        pub.publish([stored(a, 0, 2)], array_like=array_like)
        pub.publish([stored(a, 2, 4), stored(b)], array_like=array_like)
        await harness.applied(1)
        assert held(harness.index, a) == 4 and held(harness.index, b) == 4
        pub.publish([removed(a, [3])], array_like=array_like)
        await harness.applied(2)
        assert held(harness.index, a) == 3
        pub.publish([AllBlocksCleared()], array_like=array_like)
        await harness.applied(3)
        assert held(harness.index, a) == 0 and held(harness.index, b) == 0
        assert harness.cleared == ["all_blocks_cleared"]
        s = harness.stats()
        assert (s.connected, s.num_batches, s.num_events, s.num_gaps, s.num_decode_errors) == (True, 4, 5, 0, 0)
        assert s.last_event_monotonic_s is not None


async def test_the_topic_is_a_prefix_filter():
    # One vLLM publisher sends one topic ("kv-events"; llm-d deployments use kv@<pod>@<model>): "kv" matches it,
    # another prefix receives nothing.
    h = Harness()
    other = KVEventsManager(KVEventIndex(BS), topic="other")
    try:
        with KVPublisher() as pub:
            await h.subscribe(pub)
            other.sync({EP: (pub.pub_address, pub.replay_address)})
            await asyncio.to_thread(pub.wait_subscribed)
            pub.publish([stored(prompt(1))])
            await h.applied(0)
            await asyncio.sleep(0.2)  # lets time pass on purpose: the other topic's subscriber must get nothing
            assert held(h.index, prompt(1)) == 4
            assert other.stats()[EP].num_batches == 0 and held(other.index, prompt(1)) == 0
    finally:
        await h.manager.close()
        await other.close()


@pytest.mark.parametrize("replay_topic", [True, False], ids=["replay-3-frames", "replay-2-frames"])
async def test_a_gap_is_filled_by_replay(harness, replay_topic):
    with KVPublisher(replay_topic=replay_topic) as pub:
        await harness.subscribe(pub)
        a = prompt(1)
        pub.publish([stored(a, 0, 2)])
        pub.publish([stored(a, 2, 3)], send=False)  # lost on the wire, still in the replay buffer
        pub.publish([removed(a, [0])], send=False)
        pub.publish([stored(a, 0, 1)])
        pub.publish([stored(a, 3, 4)])
        await harness.applied(4)
        assert held(harness.index, a) == 4, "the replayed store of block 2 chains block 3"
        s = harness.stats()
        assert s.num_gaps == 1 and s.num_replays >= 1 and s.num_replay_failures == 0 and harness.cleared == []


@pytest.mark.parametrize("how", ["no_replay_socket", "buffer_too_short", "replay_timeout"])
async def test_a_gap_the_replay_cannot_fill_clears_the_endpoint(how):
    h = Harness(replay_timeout_s=0.3)
    pub = KVPublisher(replay=how != "no_replay_socket", replay_delay_s=1.0 if how == "replay_timeout" else 0.0)
    try:
        await h.subscribe(pub, replay=how != "no_replay_socket", live=how != "replay_timeout")
        a, b = prompt(1), prompt(2)
        pub.publish([stored(a)])
        await h.applied(0)
        pub.publish([removed(a, [0, 1, 2, 3])], send=False)  # lost: the index would keep `a` forever
        if how == "buffer_too_short":
            pub.forget_before(2)
        pub.publish([stored(b)])
        await h.applied(2)
        assert held(h.index, a) == 0, "the endpoint was cleared"
        assert held(h.index, b) == 4, "and continues from the new batch"
        assert h.cleared == ["replay_unavailable"]
        assert h.stats().num_gaps == 1 and h.stats().num_replay_failures == 1
    finally:
        await h.manager.close()
        pub.close()


async def test_history_published_before_subscribing_is_replayed(harness):
    with KVPublisher() as pub:
        a, b = prompt(1), prompt(2)
        pub.publish([stored(a)])
        pub.publish([stored(b)])
        pub.publish([removed(b, [2, 3])])
        await harness.subscribe(pub)
        pub.publish([stored(prompt(3))])
        await harness.applied(3)
        assert (held(harness.index, a), held(harness.index, b), held(harness.index, prompt(3))) == (4, 2, 4)
        assert harness.cleared == []


async def test_a_publisher_restart_clears_and_rebuilds_the_endpoint(harness):
    pub = KVPublisher()
    ports = pub.pub_port, pub.replay_port
    a, b, c = prompt(1), prompt(2), prompt(3)
    try:
        await harness.subscribe(pub)
        for i in range(5):
            pub.publish([stored(prompt(10 + i))])
        pub.publish([stored(a)])
        await harness.applied(5)
        assert held(harness.index, a) == 4
    finally:
        pub.close()
    # The server restarts (empty cache, sequence from 0) and stores b before the subscriber reconnects.
    with KVPublisher(*ports) as pub2:
        pub2.publish([stored(b)])
        await asyncio.to_thread(pub2.wait_subscribed)
        pub2.publish([stored(c)])
        await harness.applied(1)
        assert held(harness.index, a) == 0, "what the old process held is gone"
        assert (held(harness.index, b), held(harness.index, c)) == (4, 4), "rebuilt, history replayed from 0"
        assert "publisher_restart" in harness.cleared
        assert harness.stats().num_restarts == 1


async def test_the_same_publisher_back_after_an_outage_keeps_the_index(harness):
    with KVPublisher() as pub:
        await harness.subscribe(pub)
        a = prompt(1)
        pub.publish([stored(a, 0, 2)])
        await harness.applied(0)
        pub.go_down()
        await until_async(lambda: not harness.stats().connected, 5, message="disconnect seen")
        await asyncio.sleep(1.0)  # on purpose, down a while: ZMQ keeps retrying with backoff
        pub.reopen()
        await asyncio.to_thread(pub.wait_subscribed)
        pub.publish([stored(a, 2, 4)])
        await harness.applied(1)
        assert held(harness.index, a) == 4 and harness.cleared == []
        assert harness.stats().connected and harness.stats().num_reconnects >= 1


async def test_a_restart_that_publishes_past_the_old_sequence_while_disconnected_is_detected(harness):
    pub = KVPublisher()
    ports = pub.pub_port, pub.replay_port
    a = prompt(1)
    try:
        await harness.subscribe(pub)
        pub.publish([stored(a)])
        pub.publish([stored(prompt(2))])
        await harness.applied(1)
    finally:
        pub.close()
    await until_async(lambda: not harness.stats().connected, 5, message="disconnect seen")
    # The new process publishes seq 0..4 while nobody listens: the first seq the subscriber sees is past its
    # old one, which on its own looks like a plain gap.
    with KVPublisher(*ports) as pub2:
        new = [prompt(20 + i) for i in range(5)]
        for p in new:
            pub2.publish([stored(p)])
        await asyncio.to_thread(pub2.wait_subscribed)
        pub2.publish([removed(new[0], [3])])
        await harness.applied(5)
        assert held(harness.index, a) == 0
        assert [held(harness.index, p) for p in new] == [3, 4, 4, 4, 4]
        assert harness.cleared == ["reconnect_gap"]


async def test_a_batch_that_does_not_decode_clears_the_endpoint(harness):
    with KVPublisher() as pub:
        await harness.subscribe(pub)
        pub.publish([stored(prompt(1))])
        pub.publish_raw(b"\xc1not msgpack")
        pub.publish([stored(prompt(2))])
        await harness.applied(2)
        assert held(harness.index, prompt(1)) == 0 and held(harness.index, prompt(2)) == 4
        assert harness.cleared == ["decode_error"] and harness.stats().num_decode_errors == 1


async def test_manager_sync_starts_stops_and_restarts_subscribers():
    h = Harness()
    ep2 = "127.0.0.1:8002"
    with KVPublisher() as p1, KVPublisher() as p2, KVPublisher() as p3:
        try:
            h.manager.sync({EP: (p1.pub_address, p1.replay_address), ep2: (p2.pub_address, None)})
            await asyncio.to_thread(p1.wait_subscribed)
            await asyncio.to_thread(p2.wait_subscribed)
            p1.publish([stored(prompt(1))])
            p2.publish([stored(prompt(1))])
            tokens = hash_token_blocks(prompt(1), BS, token_seed_for(None, None))
            await until_async(lambda: h.index.match(tokens) == {EP: 4, ep2: 4}, 5)
            assert sorted(h.manager.stats()) == sorted([EP, ep2])
            h.manager.sync({EP: (p3.pub_address, p3.replay_address)})  # ep2 left, EP moved
            assert h.index.match(tokens) == {}
            assert h.cleared == ["address_changed"] and h.manager.endpoints() == [EP]
            await asyncio.to_thread(p3.wait_subscribed)
            p3.publish([stored(prompt(2))])
            await h.applied(0)
            assert held(h.index, prompt(2)) == 4
        finally:
            await h.manager.close()


async def test_a_quiet_publisher_is_replayed_at_once_on_subscribing(harness):
    """Late join: nothing is published after the router subscribes (a cache hit publishes nothing), yet the
    index holds the publisher's history as soon as the subscriber is live."""
    with KVPublisher() as pub:
        a, b = prompt(1), prompt(2)
        pub.publish([stored(a)], send=False)
        pub.publish([stored(b)], send=False)
        pub.publish([removed(b, [3])], send=False)
        await harness.subscribe(pub)
        assert (held(harness.index, a), held(harness.index, b)) == (4, 3)
        s = harness.stats()
        assert (s.last_seq, s.num_replays, s.num_batches) == (2, 1, 3)


async def test_a_publisher_restarted_while_quiet_empties_the_endpoint_on_reconnect(harness):
    """The server restarts (empty cache) and publishes nothing: the reconnect's replay shows a buffer that ends
    before the last batch applied, so the endpoint is cleared without waiting for a live batch."""
    pub = KVPublisher()
    ports = pub.pub_port, pub.replay_port
    try:
        await harness.subscribe(pub)
        pub.publish([stored(prompt(1))])
        pub.publish([stored(prompt(2))])
        await harness.applied(1)
    finally:
        pub.close()
    await until_async(lambda: harness.stats().state == "down", 5, message="down")
    with KVPublisher(*ports):
        await until_async(lambda: harness.stats().state == "live", 10, message="live again")
        assert held(harness.index, prompt(1)) == 0 and held(harness.index, prompt(2)) == 0
        assert harness.cleared == ["publisher_restart"] and harness.stats().num_restarts == 1


async def test_undecodable_batches_two_in_a_row_or_a_quarter_of_the_window_and_recovery():
    states: list[str] = []
    h = Harness(on_state=lambda ep, s: states.append(s))
    try:
        with KVPublisher() as pub:
            await h.subscribe(pub)
            pub.publish([stored(prompt(1))])
            pub.publish_raw(b"\xc1one stray batch")
            pub.publish([stored(prompt(2))])
            await h.applied(2)
            assert h.stats().state == "live", "one stray batch is not a stream we cannot read"
            for i in range(10):  # every third fails: with the stray one 4 of the last 16, never two in a row
                if i % 3 == 2:
                    pub.publish_raw(b"\xc1bad")
                else:
                    pub.publish([stored(prompt(10 + i))])
            await until_async(lambda: h.stats().state == "undecodable", 5, message="undecodable (window)")
            assert "first bytes c1626164" in h.stats().state_detail
            for i in range(8):
                pub.publish([stored(prompt(30 + i))])
            await until_async(lambda: h.stats().state == "live", 5, message="recovered")
            pub.publish_raw(b"\xc1x")
            pub.publish_raw(b"\xc1y")
            await until_async(lambda: h.stats().state == "undecodable", 5, message="undecodable (in a row)")
            assert states.count("undecodable") == 2 and h.stats().num_decode_errors == 6
    finally:
        await h.manager.close()


async def test_other_media_are_counted_not_indexed_and_every_batch_reaches_on_batch():
    seen: list[int] = []
    h = Harness(on_batch=lambda ep, seq, b: seen.append(seq))
    try:
        with KVPublisher() as pub:
            await h.subscribe(pub)
            a = prompt(1)
            pub.publish([stored(a), BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[],
                                                block_size=0, lora_id=None, medium="CPU", lora_name=None)])
            pub.publish([BlockRemoved(block_hashes=[1], medium="CPU"), BlockRemoved(block_hashes=[5], medium="DISK")])
            await h.applied(1)
            s = h.stats()
            assert s.stored_blocks_by_medium == {"CPU": 2} and s.removed_blocks_by_medium == {"CPU": 1, "DISK": 1}
            assert held(h.index, a) == 4 and seen == [0, 1]
    finally:
        await h.manager.close()
