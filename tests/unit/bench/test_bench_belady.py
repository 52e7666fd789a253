"""The capacity-aware bound: Belady's MIN on one cache of the fleet's KV capacity (bench/upper_bound.py).

Hand-made sequences whose optimum is worked out in the comments, a brute-force optimum on tiny sequences, a
naive O(n x C) MIN as the reference for long ones (the heap version compacts its heap there), and the
ordering properties: LRU <= MIN (present) <= infinite cache, MIN monotone in the capacity.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.bench import upper_bound as ub
from prefixroute.bench import workloads as w
from prefixroute.model_servers.profiles import get_profile

B = ub.CACHE_BLOCK_TOKENS


def req(*hashes: str) -> ub.RequestBlocks:
    """A request of the given block names plus a partial tail block (so the n - 1 cap never binds)."""
    return ub.RequestBlocks(len(hashes) * B + 1, tuple(hash(h) for h in hashes))


def chain(group: str, n: int) -> tuple[str, ...]:
    return tuple(f"{group}{i}" for i in range(n))


@pytest.mark.parametrize("capacity,requests,present,leading", [
    # One block, referenced twice: the second is a hit.
    (1, [("a",), ("a",)], [0, 1], [0, 1]),
    # C=2; at c the cache holds a (next use: request 3) and b (never again): MIN evicts b, so a hits.
    # (LRU would evict a, the least recently used, and miss: see test_min_beats_lru_where_lru_evicts_the_reused)
    (2, [("a",), ("b",), ("c",), ("a",)], [0, 0, 0, 1], [0, 0, 0, 1]),
    # Chains: C=2 after [a0 a1] holds both; b0 evicts the one used farthest: a1 (used after a0 in request 3).
    (2, [chain("a", 2), ("b0",), chain("a", 2)], [0, 0, 1], [0, 0, 1]),
    # a1 is dead after request 1 (request 3 is [a0] alone): b0 evicts it, not a0.
    (2, [chain("a", 2), ("b0",), ("a0",)], [0, 0, 1], [0, 0, 1]),
    # Present but not leading: C=2, [a0 a1 a2] twice. Request 1: a2 evicts a1 (next use 4, farther than a0's 3);
    # request 2: a0 hits, a1 misses and evicts a0 (dead now), a2 hits. Present 2, leading 1.
    (2, [chain("a", 3), chain("a", 3)], [0, 2], [0, 1]),
    # Enough room for everything: the infinite cache's hits.
    (10, [chain("a", 3), chain("b", 2), chain("a", 3), chain("b", 2)], [0, 0, 3, 2], [0, 0, 3, 2]),
    # Classic sequence 1 2 3 4 1 2 5 1 2 3 4 5 with C=3: MIN faults 7 times, so 5 hits of 12.
    (3, [(x,) for x in "123412512345"], [0, 0, 0, 0, 1, 1, 0, 1, 1, 0, 0, 1],
     [0, 0, 0, 0, 1, 1, 0, 1, 1, 0, 0, 1]),
])
def test_belady_hand_made_sequences(capacity, requests, present, leading):
    got = list(ub.replay_belady([req(*r) for r in requests], capacity))
    assert [p // B for _, p, _ in got] == present
    assert [lead // B for _, _, lead in got] == leading


def test_min_beats_lru_where_lru_evicts_the_reused():
    reqs = [req("a"), req("b"), req("c"), req("a")]
    assert [c for _, c in ub.replay_lru(reqs, 2)] == [0, 0, 0, 0]
    assert ub.capacity_bound(reqs, 2).cached_tokens == B


def test_leading_hits_are_capped_like_a_server():
    # A block-aligned prompt fully cached still computes its last token: 2 blocks, 1 counted as leading hit.
    r = ub.RequestBlocks(2 * B, (1, 2))
    (_, _, _), (_, present, leading) = ub.replay_belady([r, r], 4)
    assert present == 2 * B and leading == B


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        list(ub.replay_belady([req("a")], 0))
    with pytest.raises(ValueError):
        list(ub.replay_lru([req("a")], 0))


# ------------------------------------------------------------------------------------------ references


def brute_force_max_hits(flat: list[int], capacity: int) -> int:
    """The most hits any demand-paging policy gets on `flat` (exhaustive over every eviction choice)."""

    @functools.lru_cache(maxsize=None)
    def best(p: int, cache: frozenset[int]) -> int:
        if p == len(flat):
            return 0
        x = flat[p]
        if x in cache:
            return 1 + best(p + 1, cache)
        if len(cache) < capacity:
            return best(p + 1, cache | {x})
        return max(best(p + 1, (cache - {v}) | {x}) for v in cache)

    return best(0, frozenset())


def naive_min_hits(flat: list[int], capacity: int) -> int:
    """Belady MIN, scanning the future for each eviction (O(n^2)): the textbook definition."""
    cache: set[int] = set()
    hits = 0
    for p, x in enumerate(flat):
        if x in cache:
            hits += 1
            continue
        if len(cache) >= capacity:
            def next_use(y: int) -> int:
                try:
                    return flat.index(y, p + 1)
                except ValueError:
                    return len(flat)
            cache.remove(max(cache, key=next_use))
        cache.add(x)
    return hits


def _requests(draw_groups: list[tuple[int, int]]) -> list[ub.RequestBlocks]:
    """(group, length) pairs -> chained requests: request of group g and length k = the first k blocks of g."""
    return [ub.RequestBlocks(k * B + 1, tuple(g * 1000 + i for i in range(k))) for g, k in draw_groups]


requests_st = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4)), min_size=1, max_size=7)


@settings(max_examples=150, deadline=None)
@given(requests_st, st.integers(1, 4))
def test_min_present_hits_equal_the_brute_force_optimum(groups, capacity):
    reqs = _requests(groups)
    flat = [h for r in reqs for h in r.hashes]
    got = sum(p for _, p, _ in ub.replay_belady(reqs, capacity)) // B
    assert got == brute_force_max_hits(flat, capacity)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 40)), min_size=1, max_size=120), st.integers(1, 60))
def test_orderings_lru_min_infinite(groups, capacity):
    reqs = _requests(groups)
    mins = list(ub.replay_belady(reqs, capacity))
    present = sum(p for _, p, _ in mins)
    leading = sum(lead for _, _, lead in mins)
    infinite = sum(c for _, c in ub.replay_infinite_cache_blocks(reqs))
    lru = sum(c for _, c in ub.replay_lru(reqs, capacity))
    assert lru <= present <= infinite
    assert leading <= present
    # A stack algorithm: more room never loses a hit.
    assert present <= sum(p for _, p, _ in ub.replay_belady(reqs, capacity + 7))
    # Room for every distinct block: nothing is ever evicted, so MIN is the infinite cache.
    distinct = len({h for r in reqs for h in r.hashes})
    assert sum(p for _, p, _ in ub.replay_belady(reqs, distinct)) == infinite


def test_long_sequence_matches_the_naive_min_through_heap_compaction():
    rng = np.random.default_rng(7)
    # 600 requests of chains over 40 groups, Zipf-ish: ~6,000 references, far above 2 C + 1024 heap entries.
    weights = 1.0 / np.arange(1, 41) ** 0.9
    groups = rng.choice(40, size=600, p=weights / weights.sum())
    reqs = _requests([(int(g), int(rng.integers(1, 20))) for g in groups])
    flat = [h for r in reqs for h in r.hashes]
    for capacity in (5, 37, 150):
        got = sum(p for _, p, _ in ub.replay_belady(reqs, capacity)) // B
        assert got == naive_min_hits(flat, capacity)


def test_infinite_replay_over_blocks_equals_the_token_replay():
    wl = w.shared_prompts(num_groups=3, prefix_tokens=200, question_tokens=20, num_requests=12, seed=1)
    tokens = [ub.prompt_token_ids(r) for r in wl.requests]
    assert (list(ub.replay_infinite_cache(tokens))
            == list(ub.replay_infinite_cache_blocks(ub.request_blocks(wl))))


# --------------------------------------------------------------------------------------------- fleet


SMALL_PRESSURE = dict(num_groups=12, min_prefix_tokens=256, max_prefix_tokens=1024, num_requests=60, seed=2)


@pytest.mark.parametrize("server_args,servers,blocks,source", [
    (("--num-gpu-blocks=300",), 4, 300, "--num-gpu-blocks"),
    (("--num-gpu-blocks", "120"), 2, 120, "--num-gpu-blocks"),
    ((), 3, get_profile("llama-3.1-70b-h200-tp4").num_gpu_blocks(), "profile default"),
])
def test_fleet_bounds_take_the_capacity_from_the_server_args_or_the_profile(server_args, servers, blocks, source):
    wl = w.capacity_pressure(**SMALL_PRESSURE)
    b = ub.fleet_bounds(wl, servers, "llama-3.1-70b-h200-tp4", server_args)
    assert b["num_gpu_blocks"] == blocks and b["num_gpu_blocks_source"] == source
    assert b["capacity_blocks"] == servers * blocks
    assert b["belady_hit_ratio"] <= b["infinite_cache_hit_ratio"]
    assert b["lru_pooled_hit_ratio"] <= b["belady_hit_ratio"]
    assert b["infinite_cache_hit_ratio"] == pytest.approx(ub.upper_bound(wl).hit_ratio, abs=1e-6)


def test_fleet_bounds_skip_the_capacity_bound_with_a_note_when_the_capacity_is_unknown():
    wl = w.capacity_pressure(**SMALL_PRESSURE)
    b = ub.fleet_bounds(wl, 4, "", ("--no-such-flag",))
    assert b["capacity_blocks"] is None and b["belady_hit_ratio"] is None
    assert "capacity bound skipped" in b["note"] and "--no-such-flag" in b["note"]
    assert b["infinite_cache_hit_ratio"] > 0
