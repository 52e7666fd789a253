"""Block hashing and the KV block pool: chained hashes, LRU eviction, held blocks never evicted."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixroute.model_servers.kv_cache import KVCache, hash_block, hash_blocks, root_hash


@given(st.lists(st.integers(0, 128255), max_size=200), st.sampled_from([1, 4, 16, 32]), st.text(max_size=8))
def test_vectorised_hashes_equal_folding_the_pure_function(ids, bs, key):
    root = root_hash((key,))
    got = hash_blocks(np.array(ids, dtype=np.int64), bs, root)
    parent, want = root, []
    for i in range(len(ids) // bs):
        parent = hash_block(parent, ids[i * bs:(i + 1) * bs])
        want.append(parent)
    assert got == want


def test_only_full_blocks_and_chain_dependence():
    ids = np.arange(40)
    h = hash_blocks(ids, 16, root_hash(("m",)))
    assert len(h) == 2
    other = ids.copy()
    other[0] = 999  # a change in block 0 changes every later hash (chaining)
    h2 = hash_blocks(other, 16, root_hash(("m",)))
    assert h2[0] != h[0] and h2[1] != h[1]
    same_tail = hash_blocks(ids[16:], 16, root_hash(("m",)))
    assert same_tail[0] != h[1]  # the same block content under another parent differs


@pytest.mark.parametrize("keys", [("m", None), ("m", "salt"), ("adapter", None)])
def test_extra_keys_change_every_block(keys):
    ids = np.arange(64)
    base = hash_blocks(ids, 16, root_hash(("base", None)))
    other = hash_blocks(ids, 16, root_hash(keys))
    assert all(a != b for a, b in zip(base, other))


def test_lru_eviction_order_and_held_blocks_never_evicted():
    c = KVCache(4, 16)
    a = c.allocate(2)
    for i, b in enumerate(a):
        c.register(b, 100 + i)
    b_blocks = c.allocate(2)
    for i, b in enumerate(b_blocks):
        c.register(b, 200 + i)
    assert c.allocate(1) is None  # everything held: nothing is evicted
    assert c.usage_ratio == 1.0
    c.release(a)  # freed tail first: block a[1] is evicted before a[0]
    c.release(b_blocks)
    assert c.num_cached_prefix_blocks([100, 101]) == 2
    got = c.allocate(1)
    assert got == [a[1]] and c.num_cached_prefix_blocks([100, 101]) == 1
    assert c.num_evictions == 1
    # a hit takes a free cached block out of the queue: it survives the next allocations
    held = c.take_prefix([200, 201])
    assert held == b_blocks
    assert c.allocate(2) is None  # only a[0] is free; held blocks are not evicted
    assert c.allocate(1) == [a[0]]
    assert c.num_cached_prefix_blocks([200, 201]) == 2 and c.num_cached_prefix_blocks([100]) == 0


def test_eviction_prefers_least_recently_freed():
    c = KVCache(3, 16)
    blocks = [c.allocate(1)[0] for _ in range(3)]
    for i, b in enumerate(blocks):
        c.register(b, i)
    for b in blocks:
        c.release([b])  # freed in order 0, 1, 2
    c.take_prefix([0])  # touching 0 moves it out of the queue
    c.release([blocks[0]])  # and back at the tail
    c.allocate(1)
    assert c.num_cached_prefix_blocks([1]) == 0  # block 1 was least recently used
    assert c.num_cached_prefix_blocks([0]) == 1 and c.num_cached_prefix_blocks([2]) == 1


def test_allocation_failure_changes_nothing():
    c = KVCache(2, 16)
    c.allocate(1)
    assert c.allocate(2) is None
    assert c.num_free_blocks == 1


class ReferenceCache:
    """Obvious per-block model of the documented semantics (an ordered LRU queue), to check KVCache against."""

    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.hash = [None] * num_blocks
        self.cached = {}
        self.empty = []  # unhashed free blocks, most recently freed reused first
        self.lru = __import__("collections").OrderedDict()  # hashed free blocks, least recently freed first
        self.unused = 0
        self.evictions = 0

    @property
    def held(self):
        return sum(1 for r in self.ref if r > 0)

    def take_prefix(self, hashes):
        out = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            if self.ref[b] == 0:
                self.lru.pop(b, None)
            self.ref[b] += 1
            out.append(b)
        return out

    def allocate(self, n):
        if n > self.num_blocks - self.held:
            return None
        out = []
        while self.empty and len(out) < n:
            out.append(self.empty.pop())
        while self.unused < self.num_blocks and len(out) < n:
            out.append(self.unused)
            self.unused += 1
        while len(out) < n:
            b, _ = self.lru.popitem(last=False)
            if self.hash[b] is not None:
                if self.cached.get(self.hash[b]) == b:
                    del self.cached[self.hash[b]]
                self.hash[b] = None
                self.evictions += 1
            out.append(b)
        for b in out:
            self.ref[b] = 1
        return out

    def register(self, b, h):
        if h not in self.cached:
            self.cached[h] = b
            self.hash[b] = h

    def release(self, blocks):
        zero = []
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                zero.append(b)
        k = 0
        while k < len(zero) and self.hash[zero[k]] is None:
            self.empty.append(zero[k])
            k += 1
        for b in zero[k:]:
            self.lru[b] = None


@given(st.integers(4, 24), st.lists(st.tuples(st.integers(0, 5), st.integers(1, 8), st.booleans()), max_size=120))
def test_kv_cache_matches_reference_model(num_blocks, ops):
    """Random admit/finish sequences: same blocks, cached hashes and evictions as the per-block reference,
    with compaction forced often (COMPACT_SLACK 0)."""
    KVCache.COMPACT_SLACK = 0
    try:
        real, ref = KVCache(num_blocks, 16), ReferenceCache(num_blocks)
        live = []  # (blocks in real, blocks in ref)
        for prompt, length, finish_one in ops:
            if finish_one and live:
                a, b = live.pop(0)
                real.release(a)
                ref.release(b)
            else:
                hashes = [hash((prompt, i)) & ((1 << 64) - 1) for i in range(length)]
                a, b = real.take_prefix(hashes), ref.take_prefix(hashes)
                assert a == b
                need = length - len(a) + 1  # +1: an unhashed tail block (generated tokens)
                got_a, got_b = real.allocate(need), ref.allocate(need)
                assert got_a == got_b
                if got_a is None:
                    real.release(a)
                    ref.release(b)
                    continue
                a, b = a + got_a, b + got_b
                real.register_many(a[len(a) - need:-1], hashes[len(hashes) - need + 1:])
                for blk, h in zip(b[len(b) - need:-1], hashes[len(hashes) - need + 1:]):
                    ref.register(blk, h)
                live.append((a, b))
            assert real.cached == ref.cached
            assert real.num_evictions == ref.evictions
            assert real.num_held == ref.held
        assert real._run_entries <= 2 * num_blocks + len(live) * 9 + 9
    finally:
        KVCache.COMPACT_SLACK = 1024
