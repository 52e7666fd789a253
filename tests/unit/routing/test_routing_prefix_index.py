"""The prefix index (routing/prefix_index.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from prefixroute.extproc.routing.prefix_index import PrefixIndex
from prefixroute.types import BlockHash, EndpointId

A, B, C = EndpointId("a:1"), EndpointId("b:1"), EndpointId("c:1")


def hs(*xs: int) -> list[BlockHash]:
    return [BlockHash(x) for x in xs]


@pytest.mark.parametrize("records,query,expected", [
    ([], [1, 2, 3], {}),
    ([(A, [1, 2, 3])], [], {}),
    ([(A, [1, 2, 3])], [1, 2, 3], {A: 3}),
    ([(A, [1, 2, 3])], [1, 2, 3, 4, 5], {A: 3}),
    ([(A, [1, 2, 3])], [9, 1, 2], {}),  # a hit after a miss means nothing: blocks are chained
    ([(A, [1, 2, 3]), (B, [1, 2])], [1, 2, 3], {A: 3, B: 2}),
    ([(A, [1, 2, 3]), (B, [1, 7])], [1, 2, 3], {A: 3, B: 1}),
    ([(A, [1, 2]), (B, [1, 2, 3, 4])], [1, 2, 3, 4], {A: 2, B: 4}),
])
def test_match(records, query, expected):
    idx = PrefixIndex(100)
    for ep, blocks in records:
        idx.record(hs(*blocks), ep)
    assert idx.match(hs(*query)) == expected


def test_lru_evicts_least_recent_and_keeps_prefix_heads():
    idx = PrefixIndex(4)
    idx.record(hs(1, 2, 3), A)
    idx.record(hs(10, 11, 12), A)  # 6 entries > 4: two evicted, from the *tails* of the older prefix
    assert idx.num_entries(A) == 4
    assert idx.match(hs(1, 2, 3)) == {A: 1}
    assert idx.match(hs(10, 11, 12)) == {A: 3}


def test_record_refreshes_recency():
    idx = PrefixIndex(4)
    idx.record(hs(1, 2), A)
    idx.record(hs(3, 4), A)
    idx.record(hs(1, 2), A)  # used again: now most recent
    idx.record(hs(5, 6), A)
    assert idx.match(hs(1, 2)) == {A: 2}
    assert idx.match(hs(3, 4)) == {}


def test_match_does_not_refresh_recency():
    idx = PrefixIndex(4)
    idx.record(hs(1, 2), A)
    idx.record(hs(3, 4), A)
    idx.match(hs(1, 2))
    idx.record(hs(5, 6), A)
    assert idx.match(hs(1, 2)) == {}


def test_capacity_per_endpoint_and_shrinking():
    idx = PrefixIndex(100)
    idx.set_capacity(A, 2)
    idx.record(hs(*range(10)), A)
    idx.record(hs(*range(10)), B)
    assert (idx.num_entries(A), idx.num_entries(B), idx.capacity(A), idx.capacity(B)) == (2, 10, 2, 100)
    idx.set_capacity(B, 3)
    assert idx.num_entries(B) == 3
    assert idx.match(hs(*range(10))) == {A: 2, B: 3}
    with pytest.raises(ValueError):
        idx.set_capacity(A, 0)


def test_remove_endpoint_takes_its_entries():
    idx = PrefixIndex(100)
    idx.set_capacity(A, 5)
    idx.record(hs(1, 2, 3), A)
    idx.record(hs(1, 2), B)
    idx.remove_endpoint(A)
    assert idx.match(hs(1, 2, 3)) == {B: 2}
    assert (idx.num_entries(), idx.num_entries(A), idx.num_entries_by_endpoint(), idx.capacity(A)) == (2, 0, {B: 2}, 100)
    idx.remove_endpoint(B)
    assert (idx.num_entries(), idx.num_entries_by_endpoint()) == (0, {})
    idx.remove_endpoint(C)  # unknown: no-op


def chained(tokens: list[int]) -> list[BlockHash]:
    """Realistic block hashes: each names its whole prefix (like hashing.hash_blocks), so prompts sharing
    leading tokens share leading hashes and nothing else."""
    return [BlockHash(hash(tuple(tokens[: i + 1])) & (2**64 - 1)) for i in range(len(tokens))]


prompts = st.lists(st.integers(0, 2), max_size=8)  # tiny alphabet: many shared prefixes
ops = st.lists(st.one_of(
    st.tuples(st.just("record"), st.sampled_from([A, B, C]), prompts),
    st.tuples(st.just("cap"), st.sampled_from([A, B, C]), st.integers(1, 12)),
    st.tuples(st.just("remove"), st.sampled_from([A, B, C]), st.just(0))), max_size=40)


@hsettings(max_examples=300, deadline=None)
@given(ops=ops, query=prompts)
def test_matches_a_reference_model(ops, query):
    """Against a plain list-based LRU per endpoint and a linear scan: same contents, same answers (the
    binary search in `match` relies on prefix closure), capacity never exceeded."""
    idx = PrefixIndex(10)
    ref: dict[EndpointId, list[int]] = {}
    cap: dict[EndpointId, int] = {}
    for op, ep, arg in ops:
        if op == "record":
            blocks = chained(arg)
            lru = ref.setdefault(ep, [])
            for h in reversed(blocks):
                if h in lru:
                    lru.remove(h)
                lru.append(h)
            del lru[: max(0, len(lru) - cap.get(ep, 10))]
            idx.record(blocks, ep)
        elif op == "cap":
            cap[ep] = arg
            if ep in ref:
                del ref[ep][: max(0, len(ref[ep]) - arg)]
            idx.set_capacity(ep, arg)
        else:
            ref.pop(ep, None)
            cap.pop(ep, None)
            idx.remove_endpoint(ep)
    for ep in (A, B, C):
        assert idx.num_entries(ep) == len(ref.get(ep, []))
        assert idx.num_entries(ep) <= idx.capacity(ep)
    q = chained(query)
    expected = {}
    for ep, lru in ref.items():
        n = 0
        while n < len(q) and q[n] in lru:
            n += 1
        if n:
            expected[ep] = n
    assert idx.match(q) == expected
    assert idx.num_entries_by_endpoint() == {ep: len(lru) for ep, lru in ref.items() if lru}
