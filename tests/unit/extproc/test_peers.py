"""Replicas sharing state (extproc/peers): the codec, and the routing side of the messages (PoolRouter /
RouterCore / PrefixPolicy / ResponseDirectory `apply_peer_*`): a replica that applies another's messages routes
as that replica would. The bus over a real nats-server: tests/integration/peers."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, strategies as st

from helpers.peers import POST, Clock, Wire, chat, replica
from prefixroute.extproc.peers import codec
from prefixroute.extproc.peers.settings import PeerSettings, default_replica_id
from prefixroute.extproc.response_directory import response_key
from prefixroute.extproc.routing.settings import RoutingSettings

u64 = st.integers(min_value=0, max_value=2**64 - 1)
text = st.text(max_size=40)
digest = st.none() | st.binary(min_size=16, max_size=16)
messages = st.one_of(
    st.builds(codec.Pick, st.integers(0, 2**63 - 1), text, st.lists(u64, max_size=70),
              st.none() | st.floats(0, 1e7, allow_nan=False), digest),
    st.builds(codec.Done, st.integers(0, 2**63 - 1)),
    st.builds(codec.Release, st.integers(0, 2**63 - 1)),
    st.builds(codec.Failover, st.integers(0, 2**63 - 1), text, st.lists(u64, max_size=70), digest),
    st.builds(codec.Response, st.integers(0, 2**63 - 1), st.binary(min_size=16, max_size=16), text,
              st.none() | st.integers(0, 2**31)),
    st.builds(codec.Observed, text, *(st.floats(0, 1e7, allow_nan=False) for _ in range(4)), st.integers(0, 4096)),
)


@given(st.text(min_size=1, max_size=30), st.integers(0, 2**48 - 1), st.lists(messages, max_size=30),
       st.integers(0, 2**63 - 1))
def test_codec_round_trip(replica_id, incarnation, msgs, seq):
    batch = codec.Batch(replica_id, incarnation, msgs, seq)
    assert codec.decode(codec.encode(batch)) == batch


def test_codec_rejects_garbage():
    with pytest.raises(msgspec.DecodeError):
        codec.decode(b"\x93\xa1x")
    with pytest.raises(msgspec.DecodeError):
        codec.decode(msgspec.msgpack.encode(["r", 1, [[9, 1]]]))  # unknown tag


DOCS = [f"document {i} " * 400 for i in range(12)]
SYSTEMS = [f"system prompt {j} " * 300 for j in range(3)]


def _requests():
    """Long shared system prompts and distinct documents: queues and pending prefixes decide the picks."""
    return [(SYSTEMS[i % 3], DOCS[i % 12] + f" q{i}") for i in range(36)]


def _route_all(num_replicas: int, share: bool):
    """Route `_requests` round-robin over `num_replicas` replicas; with `share`, each pick's messages reach the
    others before the next request (as the bus does within a tick or two). Every 5th pick gets its first token."""
    wires = [Wire((f"r{k}", k)) for k in range(num_replicas)]
    routers = [replica(peers=(lambda _, w=w: w) if share else None) for w in wires]
    out = []
    for i, (system, doc) in enumerate(_requests()):
        k = i % len(routers)
        pick = routers[k].route(*POST, {}, chat(system, doc))
        if i % 5 == 0:
            routers[k].first_token(pick, 0.2)
        for j, r in enumerate(routers):
            if j != k:
                wires[k].deliver(r) if share else None
        wires[k].messages.clear()
        out.append(pick.endpoint_ids[0])
    return out


def test_two_replicas_sharing_route_as_one():
    alone = _route_all(1, share=True)
    shared = _route_all(2, share=True)
    assert shared == alone
    unshared = _route_all(2, share=False)
    assert unshared != alone  # the control: without the messages the replicas disagree


def test_applied_pick_gives_the_same_index_and_pending_state():
    wire = Wire(("a", 1))
    a, b = replica(peers=lambda _: wire), replica()
    pick = a.route(*POST, {}, chat(SYSTEMS[0], DOCS[0]))
    wire.deliver(b)
    hashes = pick.request.block_hashes
    ep = pick.endpoint_ids[0]
    for r in (a, b):
        model = r.core.scheduler.policy.model
        assert model.pending_matches(hashes) == {ep: len(hashes)}
        assert r.core.index.match(hashes).get(ep) == len(hashes)
    assert b.core.scheduler.policy.model.pending_tokens(ep) == a.core.scheduler.policy.model.pending_tokens(ep) > 0
    assert b.pool.in_flight == a.pool.in_flight == {ep: 1}  # the fleet's load, on both
    # b routes the same prefix where a put it (its queue is pending there too).
    assert b.route(*POST, {}, chat(SYSTEMS[0], DOCS[0])).endpoint_ids[0] == ep


def test_rate_observations_are_shared_so_every_replica_prices_endpoints_alike():
    wire = Wire(("a", 1))
    a, b = replica(peers=lambda _: wire), replica()
    for i, ttft_s in enumerate((0.9, 1.4, 0.7, 2.2, 1.1, 1.8)):
        pick = a.route(*POST, {}, chat(SYSTEMS[i % 3], DOCS[i] + f" slow {i}"))
        a.first_token(pick, ttft_s)
        a.usage(pick, 4000, 0)
        a.release(pick)
    observed = [m for m in wire.messages if isinstance(m, codec.Observed)]
    assert len(observed) == 6
    ma, mb = a.core.scheduler.policy.model, b.core.scheduler.policy.model
    assert ma.num_observations_by_endpoint() != mb.num_observations_by_endpoint()  # before: b learned nothing
    wire.deliver(b)
    assert mb.num_observations_by_endpoint() == ma.num_observations_by_endpoint()
    for ep in ma.num_observations_by_endpoint():
        assert mb.priced(ep) == pytest.approx(ma.priced(ep))
    assert a.core.learner.take_observations() == []  # taken once: nothing is sent twice


def test_done_ends_the_peer_pending_and_ttl_expires_a_lost_one():
    clock = Clock()
    wire = Wire(("a", 1))
    a, b = replica(peers=lambda _: wire), replica(clock=clock)
    b.peer_pending_ttl_s = 30.0
    first = a.route(*POST, {}, chat(SYSTEMS[0], DOCS[0]))
    second = a.route(*POST, {}, chat(SYSTEMS[1], DOCS[1]))
    wire.deliver(b)
    policy = b.core.learner
    assert policy.num_peer_picks() == 2
    a.first_token(first, 0.1)
    assert [type(m) for m in wire.messages] == [codec.Done]
    wire.deliver(b)
    assert policy.num_peer_picks() == 1
    assert policy.model.pending_matches(first.request.block_hashes) == {}
    assert b.num_peer_in_flight() == 2  # the first still streams
    a.release(first)
    wire.deliver(b)
    assert b.num_peer_in_flight() == 1 and sum(b.pool.in_flight.values()) == 1
    clock.t += 29.0
    b.apply_peer_batch(("a", 1), [], clock())  # a heartbeat: a is alive
    b.expire_peers(clock())
    assert policy.num_peer_picks() == 1  # `second` is still within its TTL (no Done: a died, say)
    clock.t += 1.5
    b.apply_peer_batch(("a", 1), [], clock())
    b.expire_peers(clock())
    assert policy.num_peer_picks() == 0
    assert policy.model.pending_tokens(second.endpoint_ids[0]) == 0
    assert b.num_peer_in_flight() == 1  # in flight: the request may still stream (in_flight_ttl_s)
    b.apply_peer_batch(("a", 1), [], clock())  # a heartbeat
    clock.t += b.peer_timeout_s + 0.5
    b.expire_peers(clock())  # a silent past peer_timeout_s: gone, with its load
    assert b.num_peer_in_flight() == 0 and b.pool.in_flight == {}
    a.release(second)
    wire.deliver(b)  # its Release comes after: absorbed
    assert policy.num_peer_picks() == 0 and b.pool.in_flight == {}


def test_sessions_failover_and_response_ids_are_shared():
    wire = Wire(("a", 1))
    a, b = replica(peers=lambda _: wire), replica()
    headers = {"x-session-id": "conv-1"}
    pick = a.route(*POST, headers, chat(SYSTEMS[0], DOCS[0]))
    served = pick.endpoints[1]  # the primary refused: the fallback served
    a.served(pick, served)
    a.learn_response(pick, "resp_1", served)
    a.usage(pick, 1234, 0)
    wire.deliver(b)
    s = b.core.sessions.lookup(pick.request.tenant, "conv-1")
    assert s is not None and s.endpoint == pick.endpoint_ids[1]
    assert b.core.index.match(pick.request.block_hashes).get(pick.endpoint_ids[1]) == len(pick.request.block_hashes)
    assert b.responses.endpoint_of("resp_1") == pick.endpoint_ids[1]
    assert b.responses.prompt_tokens("resp_1") == 1234


def test_unknown_endpoint_is_ignored():
    b = replica()
    b.apply_peer_batch(("a", 1), [codec.Pick(1, "10.9.9.9:1", [1, 2, 3], 500.0, None),
                                  codec.Response(1, response_key("resp_x"), "10.9.9.9:1", 10)], b.clock())
    assert b.core.learner.num_peer_picks() == 0
    assert b.core.index.match([1, 2, 3]) == {}
    assert b.responses.endpoint_of("resp_x") is None


def test_a_policy_without_a_queue_shares_index_only():
    s = RoutingSettings(rng_seed=7, policy="consistent-hash")
    wire = Wire(("a", 1))
    a, b = replica(s, peers=lambda _: wire), replica(s)
    pick = a.route(*POST, {}, chat(SYSTEMS[0], DOCS[0]))
    assert [m.pending_tokens for m in wire.messages] == [None]
    wire.deliver(b)
    a.release(pick)
    assert [type(m) for m in wire.messages] == [codec.Release]  # no queue, no Done
    assert b.core.index.match(pick.request.block_hashes)


def test_peer_settings_validation():
    assert PeerSettings().url == ""  # routes alone by default
    assert "." not in default_replica_id()
    for bad in ({"replica_id": "a.b"}, {"replica_id": "a*"}, {"subject_prefix": "a..b"}, {"pending_ttl_s": 0.0},
                {"max_batch_messages": 0}):
        with pytest.raises(ValueError):
            PeerSettings(**bad)
    assert PeerSettings(subject_prefix="team-a.prod").subject_prefix == "team-a.prod"


# --- issue 27: bounds, signatures, and claims only within what a peer could know -----------------------------
def test_nothing_a_client_sent_travels_raw():
    wire = Wire(("a", 1))
    a = replica(peers=lambda _: wire)
    secret = "conv-" + "x" * 5000
    pick = a.route(*POST, {"x-session-id": secret}, chat(SYSTEMS[0], DOCS[0]))
    a.learn_response(pick, "resp_secret_1")
    data = codec.encode(codec.Batch("a", 1, wire.messages, 1))
    assert b"conv-" not in data and b"resp_secret_1" not in data
    assert len(data) < 4000  # block hashes and digests, not the 5,000-character key


def test_codec_bounds_fields():
    huge = codec.encode(codec.Batch("a", 1, [codec.Pick(1, "e", list(range(codec.MAX_BLOCK_HASHES + 1)))], 1))
    with pytest.raises(msgspec.ValidationError):
        codec.decode(huge)
    with pytest.raises(msgspec.ValidationError):
        codec.decode(codec.encode(codec.Batch("a", 1, [codec.Pick(1, "e" * 600, [])], 1)))


def test_a_large_message_never_drops_the_others():
    """A batch over NATS's max_payload is split (issue 27: one request's 1 MB batch took the picks and
    releases of others down with it); each part decodes, in order, and nothing is lost."""
    msgs = [codec.Pick(i, "10.0.0.1:8000", list(range(1000))) for i in range(200)] + [codec.Release(7)]
    parts = codec.encode_split("a", 1, 10, msgs, max_messages=256, max_bytes=64 * 1024)
    assert len(parts) > 1 and all(len(d) <= 64 * 1024 for d, _ in parts)
    decoded = [codec.decode(d) for d, _ in parts]
    assert [b.seq for b in decoded] == list(range(10, 10 + len(parts)))
    assert [m for b in decoded for m in b.messages] == msgs
    assert sum(n for _, n in parts) == len(msgs)


def test_sealed_messages_verify_only_under_their_key_and_subject():
    key = b"k" * 32
    sealed = codec.seal(key, "prefixroute.routing.a", b"payload")
    assert codec.open_sealed(key, "prefixroute.routing.a", sealed) == b"payload"
    assert codec.open_sealed(b"x" * 32, "prefixroute.routing.a", sealed) is None  # another key
    assert codec.open_sealed(key, "prefixroute.routing.b", sealed) is None  # replayed on another subject
    assert codec.open_sealed(key, "prefixroute.routing.a", b"payload") is None  # unsigned
    assert codec.open_sealed(None, "s", b"payload") == b"payload"  # no key: unsigned bus


def test_a_response_claim_counts_only_for_its_picks_endpoint_and_never_overwrites():
    wire = Wire(("a", 1))
    a, b = replica(peers=lambda _: wire), replica()
    pick = a.route(*POST, {}, chat(SYSTEMS[0], DOCS[0]))
    wire.deliver(b)
    ep, other = pick.endpoint_ids[0], next(e for e in b.pool.endpoints if e != pick.endpoint_ids[0])
    forged = [codec.Response(pick.peer_seq_any, response_key("resp_a"), other),  # not where the pick went
              codec.Response(999, response_key("resp_b"), ep)]  # no such pick of a's
    b.apply_peer_batch(("a", 1), forged, b.clock())
    assert b.responses.endpoint_of("resp_a") is None and b.responses.endpoint_of("resp_b") is None
    assert b.num_ignored_peer_messages == 2
    b.responses.learn("resp_c", other)  # b saw resp_c itself
    b.apply_peer_batch(("a", 1), [codec.Response(pick.peer_seq_any, response_key("resp_c"), ep)], b.clock())
    assert b.responses.endpoint_of("resp_c") == other  # a peer's claim never overwrites a local one
    a.release(pick)
    a.learn_response(pick, "resp_d")  # learned at the response's end, after the release: still counts
    wire.deliver(b)
    assert b.responses.endpoint_of("resp_d") == ep


def test_a_peer_counts_in_flight_only_up_to_a_replicas_load():
    b = replica()
    b.max_in_flight_per_peer = 10
    ep = b.pool.endpoints[0]
    flood = [codec.Pick(i, ep, [1, 2, 3], 4000.0) for i in range(1000)]
    b.apply_peer_batch(("x", 1), flood, b.clock())
    assert b.pool.in_flight == {ep: 10} and b.num_ignored_peer_messages == 990
    b.apply_peer_batch(("x", 1), [codec.Pick(2000, ep, [], -5.0), codec.Failover(5000, ep, [])], b.clock())
    assert b.num_ignored_peer_messages == 992  # pending out of range; a failover of no pick in flight
    b.apply_peer_batch(("x", 1), [codec.Observed(ep, 10.0, 20.0, 0.1, 0.0)], b.clock())  # cached > prompt
    assert b.num_ignored_peer_messages == 993
