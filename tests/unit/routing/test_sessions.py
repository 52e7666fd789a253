"""Chat sessions (issue 14 item 3): `SessionTable` (routing/sessions.py) and how `RouterCore.route` credits a
session's endpoint with its previous turn's prompt, priced by the prefix policy's time model."""

from __future__ import annotations

import dataclasses
import random

import orjson
import pytest
from hypothesis import given, settings as hsettings, strategies as st

from prefixroute.extproc.routing.request import InferenceRequest, parse_request
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.sessions import SessionTable
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.types import BlockHash, EndpointId, EndpointState

S = RoutingSettings(rng_seed=3)
EPS = tuple(EndpointState(EndpointId(f"127.0.0.1:80{i:02d}")) for i in range(4))
NAMES = tuple(s.endpoint for s in EPS)
IDLE = {ep: 0 for ep in NAMES}
SYSTEM = "You are a careful travel agent; answer with sources and prices. " * 120  # ~7.7k chars, ~1.9k tokens


def turn(n: int, key: str | None = "s1", *, tenant: str | None = None, system: str = SYSTEM,
         settings: RoutingSettings = S) -> InferenceRequest:
    """Turn `n` (1-based) of a chat: the system prompt, then n user questions with the answers between."""
    msgs = [{"role": "system", "content": system}]
    for i in range(n):
        msgs.append({"role": "user", "content": f"question {i}: how do I get from A to B? " * 8})
        if i < n - 1:
            msgs.append({"role": "assistant", "content": f"answer {i}: take the train, then walk. " * 12})
    headers = {"x-prefixroute-tenant": tenant} if tenant else {}
    req = parse_request("POST", "/v1/chat/completions", headers,
                        orjson.dumps({"model": "m", "messages": msgs}), settings)
    req.session_key = key  # what request.py parses from the configured source (helper rtr's part)
    return req


def hashes(*xs: int) -> list[BlockHash]:
    return [BlockHash(x) for x in xs]


# --- SessionTable --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recorded,new,credit", [
    ([1, 2, 3], [1, 2, 3, 4, 5], 3),  # extends: the tail hash matches at the old length
    ([1, 2, 3], [1, 2, 3], 3),  # the same prompt again (a retry)
    ([1, 2, 3], [1, 2, 9, 4], None),  # history rewritten: chained hashes differ from the change on
    ([1, 2, 3], [1, 2], None),  # shortened (a sliding window dropped turns)
    ([], [7, 8], 0),  # the last turn hashed no block: trivially extended, nothing to credit
])
def test_credit_only_when_the_new_prompt_extends_the_last_turn(recorded, new, credit):
    t = SessionTable(8, 60.0)
    t.record(None, "k", NAMES[0], hashes(*recorded), 0.0)
    s = t.lookup(None, "k", 1.0)
    assert s is not None and s.endpoint == NAMES[0]
    assert s.credit(hashes(*new)) == credit


def test_sessions_are_salted_by_tenant():
    t = SessionTable(8, 60.0)
    t.record("tenant-a", "chat-1", NAMES[0], hashes(1, 2), 0.0)
    t.record("tenant-b", "chat-1", NAMES[1], hashes(1, 2), 0.0)
    assert t.lookup("tenant-a", "chat-1", 1.0).endpoint == NAMES[0]
    assert t.lookup("tenant-b", "chat-1", 1.0).endpoint == NAMES[1]
    assert t.lookup(None, "chat-1", 1.0) is None  # no tenant is a tenant of its own
    assert len(t) == 2


def test_entries_expire_ttl_after_the_last_turn():
    t = SessionTable(8, 10.0)
    t.record(None, "k", NAMES[0], hashes(1), 0.0)
    t.record(None, "k", NAMES[0], hashes(1, 2), 8.0)  # a new turn restarts the clock
    assert t.lookup(None, "k", 18.0) is not None
    assert t.lookup(None, "k", 18.5) is None and len(t) == 0 and t.num_expired == 1
    t.record(None, "k", NAMES[0], hashes(1), 100.0)
    assert t.lookup(None, "k", None) is not None  # no clock: only the LRU bounds the table


def test_expired_entries_at_the_old_end_go_as_new_turns_are_recorded():
    t = SessionTable(100, 10.0)
    for i in range(5):
        t.record(None, f"old{i}", NAMES[0], hashes(i), 0.0)
    for i in range(3):
        t.record(None, f"new{i}", NAMES[1], hashes(i), 50.0 + i)
    assert len(t) == 3 and t.num_expired == 5  # two per record, without any lookup of the old keys
    assert t.num_sessions_by_endpoint() == {NAMES[1]: 3}


def test_bounded_lru_drops_the_least_recently_recorded():
    t = SessionTable(3, 1e9)
    for k in ("a", "b", "c"):
        t.record(None, k, NAMES[0], hashes(1), 0.0)
    t.record(None, "a", NAMES[0], hashes(1, 2), 1.0)  # a's new turn: b is now the oldest
    t.record(None, "d", NAMES[1], hashes(3), 2.0)
    assert len(t) == 3 and t.num_evicted == 1
    assert t.lookup(None, "b", 3.0) is None
    assert all(t.lookup(None, k, 3.0) is not None for k in ("a", "c", "d"))
    assert t.num_sessions_by_endpoint() == {NAMES[0]: 2, NAMES[1]: 1}


def test_forget_endpoint_drops_only_its_sessions():
    t = SessionTable(8, 60.0)
    t.record(None, "a", NAMES[0], hashes(1), 0.0)
    t.record(None, "b", NAMES[1], hashes(1), 0.0)
    t.record(None, "c", NAMES[0], hashes(1), 0.0)
    t.record(None, "c", NAMES[1], hashes(1, 2), 1.0)  # moved: now NAMES[1]'s
    assert t.forget_endpoint(NAMES[0]) == 1 and t.forget_endpoint(NAMES[2]) == 0
    assert t.lookup(None, "a", 2.0) is None
    assert t.lookup(None, "b", 2.0).endpoint == t.lookup(None, "c", 2.0).endpoint == NAMES[1]


def test_moved_follows_a_failover_only_for_the_last_turn():
    t = SessionTable(8, 60.0)
    t.record(None, "k", NAMES[0], hashes(1, 2), 0.0)
    t.moved(None, "k", NAMES[1], hashes(1))  # an earlier turn's failover report, arriving late
    assert t.lookup(None, "k", 1.0).endpoint == NAMES[0]
    t.moved(None, "k", NAMES[1], hashes(1, 2))
    assert t.lookup(None, "k", 1.0).endpoint == NAMES[1]
    assert t.num_sessions_by_endpoint() == {NAMES[1]: 1}


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        SessionTable(0, 1.0)
    with pytest.raises(ValueError):
        SessionTable(1, 0.0)


# --- RouterCore with sessions ------------------------------------------------------------------------------

def cold_top() -> EndpointId:
    """Where a first turn of SYSTEM lands on an idle fleet (rendezvous on its first blocks)."""
    return RouterCore(S).route(turn(1), EPS, IDLE, 0.0).endpoints[0]


def other_than(ep: EndpointId) -> EndpointId:
    return next(x for x in NAMES if x != ep)


def lost_first_turn(key: str | None) -> tuple[RouterCore, EndpointId]:
    """A core whose turn 1 went to E (not the rendezvous choice: the others were busy) and whose prefix index
    then lost E's blocks (an LRU estimate: other traffic, or feedback shrinking it, evicted them)."""
    e = other_than(cold_top())
    core = RouterCore(S)
    d1 = core.route(turn(1, key), EPS, {ep: (0 if ep == e else 1) for ep in NAMES}, 0.0)
    assert d1.endpoints[0] == e
    core.index.clear_endpoint(e)
    assert not core.index.match(turn(2).block_hashes)
    return core, e


@pytest.mark.parametrize("load_at_e", [0, 40])
def test_session_stays_on_its_endpoint_while_it_is_predicted_fastest(load_at_e):
    core, e = lost_first_turn("s1")
    in_flight = {**IDLE, e: load_at_e}  # 40 decoding requests: slower steps, still far faster than a prefill
    d2 = core.route(turn(2), EPS, in_flight, 1.0)
    n1 = len(turn(1).block_hashes)
    assert (d2.endpoints[0], d2.reason, d2.matched_blocks, d2.session_blocks) == (e, "affinity", n1, n1)
    assert d2.predicted_ttft_ms < d2.alternative_ttft_ms
    # The same history without a session key: the index forgot, so turn 2 is a cold prefix placed elsewhere.
    control, _ = lost_first_turn(None)
    c2 = control.route(turn(2, None), EPS, in_flight, 1.0)
    assert c2.endpoints[0] != e and c2.reason == "cold" and c2.session_blocks == 0


def test_a_tie_keeps_the_session_where_it_is():
    """Two endpoints hold the prompt (the index knows both): without a session the tie goes to rendezvous
    order, with one to the session's endpoint."""
    r = cold_top()
    e = other_than(r)
    for key, expected in (("s1", e), (None, r)):
        core = RouterCore(S)
        assert core.route(turn(1, "someone"), EPS, IDLE, 0.0).endpoints[0] == r
        r_down = tuple(dataclasses.replace(s, healthy=False) if s.endpoint == r else s for s in EPS)
        assert core.route(turn(1, key), r_down, {ep: (0 if ep == e else 1) for ep in NAMES}, 0.5).endpoints[0] == e
        d2 = core.route(turn(2, key), EPS, IDLE, 1.0)
        assert d2.endpoints[0] == expected and d2.reason == "affinity" and d2.session_blocks == 0


def test_overloaded_session_endpoint_moves_and_the_session_follows():
    core = RouterCore(S)
    e = core.route(turn(1), EPS, IDLE, 0.0).endpoints[0]
    # Decode-bound: 10k requests decoding there make its steps slower than a whole prefill elsewhere (3k do
    # not: 0.51 s there against 0.19 s elsewhere plus the 2 x 0.17 s of prefill work a move adds).
    busy = {**IDLE, e: 10000}
    d2 = core.route(turn(2), EPS, busy, 1.0)
    f = d2.endpoints[0]
    assert f != e and d2.matched_blocks == 0
    assert core.sessions.lookup(None, "s1", 1.0).endpoint == f
    d3 = core.route(turn(3), EPS, busy, 2.0)
    assert d3.endpoints[0] == f and d3.matched_blocks == len(turn(2).block_hashes)


def test_moved_session_is_credited_where_it_went():
    """After a move, the session credits the new endpoint even when the index lost the turn there."""
    core = RouterCore(S)
    e = core.route(turn(1), EPS, IDLE, 0.0).endpoints[0]
    f = core.route(turn(2), EPS, {**IDLE, e: 10000}, 1.0).endpoints[0]
    core.index.clear_endpoint(f)
    d3 = core.route(turn(3), EPS, IDLE, 2.0)
    assert d3.endpoints[0] == f and d3.session_blocks == len(turn(2).block_hashes)


def twin_decisions(requests, settings=S, states=EPS, in_flight=IDLE):
    core = RouterCore(settings)
    return [core.route(r, states, in_flight, float(i)) for i, r in enumerate(requests)], core


def test_unknown_key_routes_as_without_a_key():
    with_key, core = twin_decisions([turn(1, "other"), turn(2, "new-session")])
    without, _ = twin_decisions([turn(1, None), turn(2, None)])
    assert with_key == without
    assert core.sessions.lookup(None, "new-session", 2.0).endpoint == with_key[1].endpoints[0]  # recorded


def test_expired_session_gets_no_credit():
    core, e = lost_first_turn("s1")
    d2 = core.route(turn(2), EPS, IDLE, 1.0 + S.session_ttl_s)
    assert d2.session_blocks == 0 and d2.endpoints[0] != e and d2.reason == "cold"


def test_router_keeps_at_most_max_sessions():
    settings = dataclasses.replace(S, max_sessions=2)
    core = RouterCore(settings)
    for i, key in enumerate(("a", "b", "c")):
        core.route(turn(1, key, system=f"[{key}] " + SYSTEM, settings=settings), EPS, IDLE, float(i))
    assert len(core.sessions) == 2 and core.sessions.lookup(None, "a", 3.0) is None


def test_removed_endpoint_takes_its_sessions():
    core, e = lost_first_turn("s1")
    core.sync_endpoints(EPS)
    core.sync_endpoints(tuple(s for s in EPS if s.endpoint != e))
    assert core.sessions.lookup(None, "s1", 1.0) is None
    core.sync_endpoints(EPS)  # it comes back (same name): it starts from nothing
    d2 = core.route(turn(2), EPS, IDLE, 1.0)
    assert d2.session_blocks == 0 and d2.endpoints[0] != e


def test_restarted_endpoint_takes_its_sessions():
    core, e = lost_first_turn("s1")
    core.sync_endpoints(EPS)
    core.sync_endpoints(tuple(dataclasses.replace(s, restart_epoch=1) if s.endpoint == e else s for s in EPS))
    assert core.num_caches_cleared == 1 and core.sessions.lookup(None, "s1", 1.0) is None
    d2 = core.route(turn(2), EPS, IDLE, 1.0)
    assert d2.session_blocks == 0 and d2.endpoints[0] != e


def test_unhealthy_session_endpoint_is_not_credited():
    core, e = lost_first_turn("s1")
    states = tuple(dataclasses.replace(s, healthy=False) if s.endpoint == e else s for s in EPS)
    d2 = core.route(turn(2), states, IDLE, 1.0)
    assert e not in d2.endpoints and d2.session_blocks == 0
    assert core.sessions.lookup(None, "s1", 1.0).endpoint == d2.endpoints[0]


def test_rewritten_history_gets_no_credit():
    core, e = lost_first_turn("s1")
    edited = turn(2, system=SYSTEM.replace("travel agent", "tour guide", 1))  # first block differs
    d2 = core.route(edited, EPS, IDLE, 1.0)
    assert d2.session_blocks == 0 and d2.matched_blocks == 0 and d2.endpoints[0] != e


def test_other_tenant_with_the_same_key_gets_no_credit():
    core, e = lost_first_turn("s1")
    d2 = core.route(turn(2, tenant="someone-else"), EPS, IDLE, 1.0)
    assert d2.session_blocks == 0 and d2.endpoints[0] != e


def test_failover_moves_the_session():
    core, e = lost_first_turn("s1")
    d2 = core.route(turn(2), EPS, IDLE, 1.0)
    assert d2.endpoints[0] == e
    core.record_failover(turn(2), d2.endpoints[1])  # Envoy: e refused the connection, the fallback served
    assert core.sessions.lookup(None, "s1", 1.0).endpoint == d2.endpoints[1]


def test_session_credit_does_not_shrink_the_index_on_a_miss():
    """The server may have evicted what the session credited: that says nothing of the index LRU's size."""
    core, e = lost_first_turn("s1")
    req = turn(2)
    d2 = core.route(req, EPS, IDLE, 1.0)
    assert d2.session_blocks > 0 and core.sourced.source_of(e) == "feedback"
    before = core.index.capacity(e)
    core.observe_usage(req, d2, prompt_tokens=2500, cached_tokens=0, served_by=e)
    assert core.index.capacity(e) == before
    assert core.hit_stats[e].num_responses == 1 and core.hit_stats[e].predicted_tokens > 0  # still counted


def test_sampled_pool_still_scores_and_credits_the_session_endpoint():
    eps = tuple(EndpointState(EndpointId(f"10.0.0.{i}:8000")) for i in range(64))
    settings = dataclasses.replace(S, max_scored_endpoints=8)
    core = RouterCore(settings)
    first = turn(1, settings=settings)
    top = core.route(first, eps, {}, 0.0).endpoints[0]
    # Turn 1 of the real session went elsewhere: the rendezvous choice was busy then.
    e = eps[40].endpoint if eps[40].endpoint != top else eps[41].endpoint
    core = RouterCore(settings)
    core.route(first, tuple(s for s in eps if s.endpoint in (e,)), {}, 0.0)
    core.index.clear_endpoint(e)
    d2 = core.route(turn(2, settings=settings), eps, {}, 1.0)
    assert d2.endpoints[0] == e and d2.session_blocks == len(first.block_hashes)


def test_sampled_pool_scores_the_session_endpoint_without_credit():
    """A session of prompts shorter than a block (nothing hashed, nothing to credit) stays where it is on an
    idle fleet even when the pool is sampled: its endpoint is always scored, and wins the tie."""
    eps = tuple(EndpointState(EndpointId(f"10.0.0.{i}:8000")) for i in range(64))
    settings = dataclasses.replace(S, max_scored_endpoints=8)
    core = RouterCore(settings)

    def short(key: str) -> InferenceRequest:
        req = parse_request("POST", "/v1/chat/completions", {}, orjson.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]}), settings)
        req.session_key = key
        return req

    assert not short("k").block_hashes
    for i in range(20):
        first = core.route(short(f"k{i}"), eps, {}, 0.0).endpoints[0]
        assert [core.route(short(f"k{i}"), eps, {}, 1.0 + t).endpoints[0] for t in range(3)] == [first] * 3


@pytest.mark.parametrize("policy", ["consistent-hash", "least-load", "round-robin", "random"])
def test_other_policies_ignore_sessions(policy):
    settings = dataclasses.replace(S, policy=policy)
    with_key, core = twin_decisions([turn(1, "s1", settings=settings), turn(2, "s1", settings=settings)],
                                    settings=settings)
    without, _ = twin_decisions([turn(1, None, settings=settings), turn(2, None, settings=settings)],
                                settings=settings)
    assert core.sessions is None and with_key == without


def test_session_key_off_keeps_no_table():
    assert RouterCore(dataclasses.replace(S, session_key="off")).sessions is None


# --- property: without a session key nothing changes --------------------------------------------------------

WORDS = ("alpha ", "beta ", "gamma ", "delta ")


def _body(prompt: list[int], model: str) -> bytes:
    content = "".join(WORDS[i] * 40 for i in prompt)  # 240+ chars per word: several blocks each
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": content}]})


steps = st.lists(st.tuples(
    st.lists(st.integers(0, 3), min_size=0, max_size=6),  # prompt (shared prefixes likely)
    st.sampled_from(["m", "n"]),  # model
    st.lists(st.integers(0, 40), min_size=4, max_size=4),  # in flight per endpoint
    st.lists(st.booleans(), min_size=4, max_size=4),  # healthy per endpoint
    st.integers(0, 3),  # pool event: 0 none, 1 remove the last endpoint, 2 restart endpoint 0, 3 release
), min_size=1, max_size=25)


def _run(settings: RoutingSettings, steps_, track: bool) -> list:
    core = RouterCore(settings, rng=random.Random(7), track_prefill=track)
    out, open_ = [], []
    epoch = 0
    for i, (prompt, model, loads, healthy, event) in enumerate(steps_):
        states = tuple(dataclasses.replace(s, healthy=h or j == 0, restart_epoch=epoch if j == 0 else 0,
                                           models=frozenset({"m", "n"} if j % 2 == 0 else {"m"}))
                       for j, (s, h) in enumerate(zip(EPS, healthy)))
        if event == 1:
            states = states[:-1]
        elif event == 2:
            epoch += 1
        core.sync_endpoints(states)
        req = parse_request("POST", "/v1/chat/completions", {}, _body(prompt, model), settings)
        try:
            d = core.route(req, states, dict(zip(NAMES, loads)), i * 0.05)
        except Exception as exc:  # noqa: BLE001 - both runs must fail alike
            out.append(repr(exc))
            continue
        out.append(d)
        open_.append((req, d))
        if event == 3 and track and core.learner is not None:
            r, dd = open_.pop(0)
            core.learner.on_first_token(r, dd, 0.1, 100, 0)
            core.learner.on_release(r, dd)
    out.append(core.rng.random())  # the same random draws were made
    return out


@hsettings(max_examples=60, deadline=None)
@given(steps_=steps, track=st.booleans())
def test_without_session_key_decisions_are_those_of_a_router_without_sessions(steps_, track):
    """Requests without a key: the router with its session table decides exactly as one with none
    (session_key off: `RouterCore.sessions` is None, the code path of the router before sessions)."""
    with_table = _run(S, steps_, track)
    without_table = _run(dataclasses.replace(S, session_key="off"), steps_, track)
    assert with_table == without_table


def test_kv_event_endpoints_are_not_credited_beyond_their_events():
    """An endpoint whose KV events feed the index reported what it evicted: the session does not override that
    (it would price the endpoint as holding blocks it said it dropped), but it still wins a tie."""
    from prefixroute.extproc.routing.prefix_index import PrefixIndex

    events = PrefixIndex(S.default_index_capacity_blocks)  # what the endpoints' KV events report
    core = RouterCore(S, event_index=events)
    core.set_event_endpoints(NAMES)
    e = core.route(turn(1), EPS, IDLE, 0.0).endpoints[0]
    events.record(turn(1).block_hashes, e)  # its events: stored...
    assert core.route(turn(2), EPS, IDLE, 1.0).endpoints[0] == e
    events.clear_endpoint(e)  # ...then evicted under memory pressure (BlockRemoved)
    busy = {**IDLE, e: 400}  # credited, 400 decoding there would still beat a whole prefill elsewhere
    d3 = core.route(turn(3), EPS, busy, 2.0)
    assert d3.session_blocks == 0 and d3.matched_blocks == 0 and d3.endpoints[0] != e
    # A new session's first turn lands off the rendezvous choice (the others were busy); its events have not
    # come yet when its next turn arrives on an idle fleet: nothing is credited, and the tie keeps it there.
    other = "[s2] " + SYSTEM
    top = RouterCore(S).route(turn(1, None, system=other), EPS, IDLE, 0.0).endpoints[0]
    e2 = other_than(top)
    d4 = core.route(turn(1, "s2", system=other), EPS, {ep: (0 if ep == e2 else 1) for ep in NAMES}, 3.0)
    d5 = core.route(turn(2, "s2", system=other), EPS, IDLE, 4.0)
    assert d4.endpoints[0] == d5.endpoints[0] == e2 and d5.matched_blocks == 0


@pytest.mark.parametrize("source,where", [("header", "header"), ("user", "body"), ("prompt_cache_key", "body")])
def test_parsed_session_keys_reach_the_table(source, where):
    """End to end in the routing core: the key as request.py parses it from the configured source."""
    settings = dataclasses.replace(S, session_key=source)
    core = RouterCore(settings)
    body = {"model": "m", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]}
    headers = {}
    if where == "header":
        headers[settings.session_header] = "conv-42"
    else:
        body[source] = "conv-42"
    req = parse_request("POST", "/v1/chat/completions", headers, orjson.dumps(body), settings)
    assert req.session_key == "conv-42"
    d = core.route(req, EPS, IDLE, 0.0)
    assert core.sessions.lookup(req.tenant, "conv-42", 1.0).endpoint == d.endpoints[0]
    assert len(core.sessions) == 1


def test_sessions_collector_exposes_counts_by_endpoint_and_drops():
    from prometheus_client import CollectorRegistry, generate_latest

    from prefixroute.extproc.routing.sessions import SessionsCollector, SessionTable

    table = SessionTable(max_sessions=2, ttl_s=10.0)
    table.record(None, "a", "e1:1", [1, 2], 0.0)
    table.record(None, "b", "e2:1", [3], 0.0)
    table.record(None, "c", "e2:1", [4], 0.0)  # evicts "a" (the bound is 2)
    assert table.lookup(None, "b", 100.0) is None  # expired
    reg = CollectorRegistry()
    reg.register(SessionsCollector(table))
    text = generate_latest(reg).decode()
    assert 'prefixroute_sessions{endpoint="e2:1"} 1.0' in text
    assert 'e1:1' not in text
    assert 'prefixroute_sessions_dropped_total{reason="evicted"} 1.0' in text
    assert 'prefixroute_sessions_dropped_total{reason="expired"} 1.0' in text
