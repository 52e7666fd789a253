"""`extproc.kv_events.link.KVEventsLink`: an endpoint is matched by its events only while its subscriber is live
and the index trusts its hashing; every other state routes it by feedback and shows why (info, ready line,
logs once); a server whose scraped KV block size differs from --kv-block-tokens is reported once."""

from __future__ import annotations

import logging

from prefixroute.extproc.kv_events import KVEventIndex, SubscriberStats
from prefixroute.extproc.kv_events.link import (DOWN_GRACE_S, TOKEN_MISMATCH_MIN_AGE_S, TOKEN_MISMATCH_MIN_REQUESTS,
                                                KVEventsLink)
from prefixroute.extproc.routing.hashing import hash_token_blocks, token_seed_for
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.types import EndpointId, EndpointState
from prefixroute.kv_events_wire import BlockStored

A, B, C = EndpointId("10.0.0.1:8000"), EndpointId("10.0.0.2:8000"), EndpointId("10.0.0.3:8000")


class _Manager:
    def __init__(self) -> None:
        self.state = {A: "live", B: "down", C: "syncing"}

    def stats(self):
        return {ep: SubscriberStats(pub_address="tcp://x:1", replay_address=None, connected=s != "down",
                                    state=s, state_detail="why" if s == "undecodable" else "", last_seq=3)
                for ep, s in self.state.items()}

    def states(self):
        return dict(self.state)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _link(snap=()):
    core = RouterCore(RoutingSettings(tokenizer="sim"), event_index=KVEventIndex(16))
    mgr = _Manager()
    clock = _Clock()
    link = KVEventsLink(core, mgr, {A: ("tcp://a:1", None), B: ("tcp://b:1", None), C: ("tcp://c:1", None)},  # type: ignore[arg-type]
                        lambda: snap, clock=clock)
    link.endpoints = [A, B, C]
    return core, mgr, link, clock


def test_only_live_endpoints_are_matched_by_events_and_every_state_shows(caplog):
    core, mgr, link, clock = _link()
    with caplog.at_level(logging.WARNING, logger="prefixroute.extproc"):
        link.check()
    assert core.index_sources([A, B, C]) == {A: "events", B: "feedback", C: "feedback"}
    assert {ep: link.info[ep]["events_state"] for ep in (A, B, C)} == {A: "live", B: "down", C: "syncing"}
    assert link.summary() == "x3 (1 live, 1 syncing, 1 down)"
    # Never connected yet: down is news only once it lasts (a start-up's replay can end just before the connect).
    assert [r for r in caplog.records if B in r.getMessage()] == []
    clock.t += DOWN_GRACE_S
    with caplog.at_level(logging.WARNING, logger="prefixroute.extproc"):
        link.check()
        link.check()
    assert [r.levelno for r in caplog.records if B in r.getMessage()] == [logging.WARNING]  # down: said once
    mgr.state[C] = "undecodable"  # (the subscriber logs the ERROR with the bytes it saw)
    mgr.state[B] = "live"
    with caplog.at_level(logging.WARNING, logger="prefixroute.extproc"):
        link.on_state(C, "undecodable")
    assert core.index_sources([A, B, C]) == {A: "events", B: "events", C: "feedback"}
    assert link.info[C]["events_state"] == "undecodable" and link.info[C]["events_detail"] == "why"
    assert any("live: matching by its events again" in r.getMessage() and B in r.getMessage()
               for r in caplog.records)


def test_an_endpoint_whose_blocks_never_match_routed_requests_is_a_token_mismatch(caplog):
    core, mgr, link, clock = _link()
    index = core.event_index
    # A stores blocks under its own tokenization (other token ids than the router's for the same prompts).
    for _ in index.apply_events(A, [BlockStored([1, 2], None, list(range(1000, 1032)), 16, None, "GPU", None)]):
        pass
    for i in range(TOKEN_MISMATCH_MIN_REQUESTS):
        index.note_routed(A, hash_token_blocks([i] * 32, 16, token_seed_for(None, None))[0], clock.t)
    link.check()
    assert link.info[A]["events_state"] == "live", "not before min_age_s: the server may still be computing"
    clock.t += TOKEN_MISMATCH_MIN_AGE_S
    with caplog.at_level(logging.ERROR, logger="prefixroute.extproc"):
        link.check()
    assert link.info[A]["events_state"] == "token_mismatch" and core.index_sources([A])[A] == "feedback"
    assert any("token_mismatch" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    # One routed request whose first block the server then stores verifies it: back to events.
    tokens = [7] * 32
    first = hash_token_blocks(tokens, 16, token_seed_for(None, None))[0]
    index.note_routed(A, first, clock.t)
    for _ in index.apply_events(A, [BlockStored([9, 10], None, tokens, 16, None, "GPU", None)]):
        pass
    link.check()
    assert link.info[A]["events_state"] == "live" and core.index_sources([A])[A] == "events"


def test_a_verified_endpoint_is_never_a_token_mismatch():
    core, mgr, link, clock = _link()
    index = core.event_index
    tokens = [5] * 32
    for _ in index.apply_events(A, [BlockStored([1, 2], None, tokens, 16, None, "GPU", None)]):
        pass
    first = hash_token_blocks(tokens, 16, token_seed_for(None, None))[0]
    index.note_routed(A, first, clock.t)  # held already: verified at once
    for i in range(5 * TOKEN_MISMATCH_MIN_REQUESTS):
        index.note_routed(A, hash_token_blocks([100 + i] * 32, 16, token_seed_for(None, None))[0], clock.t)
    clock.t += 10 * TOKEN_MISMATCH_MIN_AGE_S
    link.check()
    assert link.info[A]["events_state"] == "live"


def test_block_sizes_from_the_scrape_are_checked_once(caplog):
    """A size that is neither a multiple nor a divisor of the router's is a WARNING, once; a multiple (vLLM 0.34's
    64) or a divisor (SGLang's page of 1) an INFO, once: its blocks are split or merged, so its events are
    matched."""
    d = "10.0.0.4:8000"
    snap = (EndpointState(A, block_size=16), EndpointState(B, block_size=24), EndpointState(C, block_size=64),
            EndpointState(d, block_size=1))
    core, mgr, link, _ = _link(snap)
    with caplog.at_level(logging.INFO, logger="prefixroute.extproc"):
        link.check()
        link.check()
    size_warnings = [r for r in caplog.records if "KV block size 24" in r.getMessage()]
    assert len(size_warnings) == 1 and B in size_warnings[0].getMessage()
    assert size_warnings[0].levelno == logging.WARNING
    split = [r for r in caplog.records if "KV block size 64" in r.getMessage()]
    assert len(split) == 1 and C in split[0].getMessage() and split[0].levelno == logging.INFO
    assert "4 x --kv-block-tokens 16" in split[0].getMessage()
    merged = [r for r in caplog.records if "KV block size 1 " in r.getMessage()]
    assert len(merged) == 1 and d in merged[0].getMessage() and merged[0].levelno == logging.INFO
    assert "merged into 16-token blocks" in merged[0].getMessage()


def test_a_start_up_race_is_no_warning_but_losing_a_live_publisher_is_one_at_once(caplog):
    # Start-up: the replay ends a moment before the connection is reported (down, then live, within a millisecond).
    core, mgr, link, clock = _link()
    mgr.state = {A: "down", B: "live", C: "live"}
    with caplog.at_level(logging.INFO, logger="prefixroute.extproc"):
        link.check()
        mgr.state[A] = "live"
        link.check()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert core.index_sources([A, B, C]) == {A: "events", B: "events", C: "events"}
    # Later, a live publisher goes away: said at once, and its return too.
    mgr.state[B] = "down"
    with caplog.at_level(logging.WARNING, logger="prefixroute.extproc"):
        link.check()
        assert [r.levelno for r in caplog.records if B in r.getMessage()] == [logging.WARNING]
        mgr.state[B] = "live"
        link.check()
    assert any("down -> live: matching by its events again" in r.getMessage() and B in r.getMessage()
               for r in caplog.records)


def test_an_endpoint_failing_its_probes_is_unhealthy_not_live_and_live_again_when_back(caplog):
    """A publisher can outlive its server (vLLM's EngineCore after its API server is killed): the pool's verdict
    overrides a live or syncing subscriber; a down one says so itself. Panic-routed counts as failing."""
    snap = [EndpointState(A, healthy=False), EndpointState(B, healthy=False), EndpointState(C, panic=True)]
    core, mgr, link, clock = _link(snap)
    with caplog.at_level(logging.WARNING, logger="prefixroute.extproc"):
        link.check()  # A was never live: no warning yet
        assert {ep: link.info[ep]["events_state"] for ep in (A, B, C)} == {A: "unhealthy", B: "down",
                                                                            C: "unhealthy"}
        assert core.index_sources([A, B, C]) == {A: "feedback", B: "feedback", C: "feedback"}
        assert "fails its health probes" in str(link.info[A]["events_detail"])
        snap[0] = EndpointState(A)
        link.on_pool_change(snap)
        assert link.info[A]["events_state"] == "live" and core.index_sources([A])[A] == "events"
        snap[0] = EndpointState(A, healthy=False)
        link.on_pool_change(snap)
        link.check()
    assert link.info[A]["events_state"] == "unhealthy" and core.index_sources([A])[A] == "feedback"
    said = [r.getMessage() for r in caplog.records if A in r.getMessage()]
    assert len([m for m in said if "unhealthy: the endpoint fails its health probes" in m]) == 1, said
