"""Cached-token feedback (issue 13 item 4): a server that held much less than the index predicted shrinks that
endpoint's index LRU (its oldest entries go); predictions that come true grow it back; the hit statistics
compare predicted and actual cached tokens. Pure RouterCore, no processes."""

from __future__ import annotations

import orjson
import pytest

from prefixroute.extproc.routing.request import parse_request
from prefixroute.extproc.routing.router import FEEDBACK_SHRINK_RATIO, RouterCore
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.types import EndpointId, EndpointState

A, B = EndpointId("10.0.0.1:8000"), EndpointId("10.0.0.2:8000")
POOL = (EndpointState(A), EndpointState(B))


def _req(doc: int, q: int = 0, settings: RoutingSettings | None = None):
    body = {"model": "m", "messages": [{"role": "system", "content": f"document {doc} " * 400},
                                       {"role": "user", "content": f"question {q}"}]}
    return parse_request("POST", "/v1/chat/completions", {}, orjson.dumps(body), settings or RoutingSettings())


def _core(source: str) -> RouterCore:
    core = RouterCore(RoutingSettings(index_source=source, policy="consistent-hash", rng_seed=1))
    core.set_capacity(A, 1000)
    core.set_capacity(B, 1000)
    return core


@pytest.mark.parametrize("source,shrinks", [("feedback", True), ("auto", True), ("approximate", False)])
def test_a_miss_shrinks_the_lru_in_feedback_mode_only(source, shrinks):
    core = _core(source)
    r1 = _req(1)
    d1 = core.route(r1, POOL, {})
    ep = d1.endpoints[0]
    again = _req(1, q=1)
    d2 = core.route(again, POOL, {})
    assert d2.endpoints[0] == ep and d2.matched_blocks > 10  # the index predicts a long hit
    predicted = core.predicted_cached_tokens(again, d2)
    assert predicted > 500
    core.observe_usage(again, d2, prompt_tokens=int(predicted) + 20, cached_tokens=0, served_by=ep)
    st = core.hit_stats[ep]
    assert st.num_responses == 1 and st.cached_tokens == 0 and st.predicted_tokens == predicted
    cap = core.index.capacity(ep)
    assert (cap == int(1000 * FEEDBACK_SHRINK_RATIO)) is shrinks and (cap == 1000) is (not shrinks)
    assert st.num_misses == (1 if shrinks else 0)


def test_repeated_misses_drop_the_oldest_entries_and_hits_grow_capacity_back():
    core = _core("feedback")
    old = _req(7)
    d_old = core.route(old, POOL, {})
    ep = d_old.endpoints[0]
    n_old = len(old.block_hashes)
    assert core.index.match(old.block_hashes) == {ep: n_old}
    # A stream of misses at `ep`: the server evicts much sooner than the LRU thinks.
    for i in range(12):
        r = _req(100 + i)
        d = core.route(r, POOL, {})
        if d.endpoints[0] != ep:
            continue
        r2 = _req(100 + i, q=1)
        d2 = core.route(r2, POOL, {})
        core.observe_usage(r2, d2, prompt_tokens=2000, cached_tokens=0, served_by=ep)
    shrunk = core.index.capacity(ep)
    assert shrunk < 1000 * FEEDBACK_SHRINK_RATIO ** 3
    # The oldest prefix (recorded first) is forgotten there: no longer predicted a hit.
    assert core.index.match(old.block_hashes).get(ep, 0) < n_old
    # Predictions that come true grow the capacity back, never above the ceiling.
    doc = next(k for k in range(500, 600) if core.route(_req(k), POOL, {}).endpoints[0] == ep)
    for i in range(400):
        ri = _req(doc, q=i)
        di = core.route(ri, POOL, {})
        if di.endpoints[0] == ep and di.matched_blocks:
            core.observe_usage(ri, di, prompt_tokens=5000, cached_tokens=int(core.predicted_cached_tokens(ri, di)),
                               served_by=ep)
    assert shrunk < core.index.capacity(ep) <= 1000


def test_feedback_ignores_fallbacks_and_pending_blocks():
    core = _core("feedback")
    r = _req(3)
    d = core.route(r, POOL, {})
    ep = d.endpoints[0]
    other = B if ep == A else A
    r2 = _req(3, q=2)
    d2 = core.route(r2, POOL, {})
    core.observe_usage(r2, d2, prompt_tokens=3000, cached_tokens=0, served_by=other)  # a fallback served it
    assert core.index.capacity(ep) == 1000 and ep not in core.hit_stats


def test_a_short_shared_instruction_does_not_pull_new_documents_onto_its_holders():
    """Issue 13's capacity-pressure shape: every request starts with the same short instruction, then one of
    many documents. The instruction's holders match 4 blocks of ~300: not a reason to win ties, so new
    documents spread by rendezvous (keyed past the instruction) instead of all following the first endpoint
    (with the old tie-break by longest match, every one of them went to it)."""
    from collections import Counter

    eps = tuple(EndpointState(EndpointId(f"10.0.0.{i}:8000")) for i in range(4))
    core = RouterCore(RoutingSettings(rng_seed=3))
    instruction = "Answer from the document below, citing it. " * 6  # ~260 characters: 4 text blocks

    def doc_request(d: int):
        body = {"model": "m", "messages": [{"role": "user", "content": instruction + f"doc {d} text " * 300}]}
        return parse_request("POST", "/v1/chat/completions", {}, orjson.dumps(body), RoutingSettings())

    first = core.route(doc_request(0), eps, {})
    assert first.matched_blocks == 0
    picks = Counter(core.route(doc_request(d), eps, {}).endpoints[0] for d in range(1, 81))
    assert len(picks) == 4 and max(picks.values()) <= 40, picks
    # A document seen before still goes back to where it is (a significant match wins the tie).
    again = core.route(doc_request(5), eps, {})
    assert again.matched_blocks > 0.9 * again.total_blocks and again.reason == "affinity"
