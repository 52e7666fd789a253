"""KVEventIndex: keying vLLM's KV events by the router's token-block hashes (extproc/kv_events/index.py)."""

from __future__ import annotations

import threading

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.extproc.kv_events.index import KVEventIndex
from prefixroute.extproc.routing.hashing import hash_token_blocks, token_seed_for
from prefixroute.kv_events_wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch

BS = 4
EP, EP2 = "10.0.0.1:8000", "10.0.0.2:8000"


def srv(path: tuple[int, ...], salt: str = "") -> int:
    """A server block hash for the block ending `path` (any injective-enough function: vLLM's are random)."""
    return xxhash.xxh3_64_intdigest(repr((salt, path)).encode(), 12345)


def chain(tokens, lora=None, salt=None):
    return hash_token_blocks(tokens, BS, token_seed_for(lora, salt))


def stored(tokens, first=0, last=None, *, parent_tokens=None, lora_name=None, extra_keys=None, salt_tag="",
           block_size=BS, medium="GPU", lora_id=None, group_idx=None, bytes_hashes=False):
    """BlockStored of blocks [first, last) of `tokens` with server hashes `srv`, chained like vLLM does."""
    n = len(tokens) // BS
    last = n if last is None else last
    hashes = [srv(tuple(tokens[:(i + 1) * BS]), salt_tag) for i in range(first, last)]
    if bytes_hashes:
        hashes = [h.to_bytes(32, "big") for h in hashes]
    parent = srv(tuple(tokens[:first * BS]), salt_tag) if first else None
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(tokens[first * BS:last * BS]),
                       block_size=block_size, lora_id=lora_id, medium=medium, lora_name=lora_name,
                       extra_keys=extra_keys, group_idx=group_idx)


def removed(tokens, blocks, salt_tag=""):
    return BlockRemoved(block_hashes=[srv(tuple(tokens[:(i + 1) * BS]), salt_tag) for i in blocks], medium="GPU")


def batch(*events):
    return EventBatch(ts=1.0, events=list(events))


TOKS = list(range(100, 132))  # 8 blocks


@pytest.mark.parametrize("array_like", [False, True])
def test_every_event_type_round_trips_the_wire_into_the_index(array_like):
    idx = KVEventIndex(BS)
    wire = encode_batch(batch(stored(TOKS, 0, 4), stored(TOKS, 4, 8, bytes_hashes=False)), array_like=array_like)
    idx.apply_batch(EP, decode_batch(wire))
    assert idx.match(chain(TOKS)) == {EP: 8}
    idx.apply_batch(EP, decode_batch(encode_batch(batch(removed(TOKS, [5, 6, 7])), array_like=array_like)))
    assert idx.match(chain(TOKS)) == {EP: 5}
    idx.apply_batch(EP2, batch(stored(TOKS, 0, 2)))
    idx.apply_batch(EP, decode_batch(encode_batch(batch(AllBlocksCleared()), array_like=array_like)))
    assert idx.match(chain(TOKS)) == {EP2: 2}, "AllBlocksCleared empties only its own endpoint"
    assert idx.num_blocks(EP) == 0 and idx.counters(EP).num_all_cleared == 1


def test_bytes_block_hashes_are_followed_like_ints():
    idx = KVEventIndex(BS)
    idx.apply_batch(EP, batch(stored(TOKS, 0, 3, bytes_hashes=True), stored(TOKS, 3, 6, bytes_hashes=True)))
    assert idx.match(chain(TOKS)) == {EP: 6}
    idx.apply_batch(EP, batch(BlockRemoved(block_hashes=[srv(tuple(TOKS[:8])).to_bytes(32, "big")], medium="GPU")))
    assert idx.match(chain(TOKS)) == {EP: 1}


def test_signed_and_wide_int_hashes_are_taken_modulo_2_64():
    idx = KVEventIndex(BS)
    ev = stored(TOKS, 0, 2)
    ev.block_hashes = [ev.block_hashes[0] - (1 << 64), ev.block_hashes[1] + (1 << 64)]  # same low 64 bits
    idx.apply_batch(EP, batch(ev, stored(TOKS, 2, 4)))
    assert idx.match(chain(TOKS)) == {EP: 4}
    idx.apply_batch(EP, batch(removed(TOKS, [1])))
    assert idx.match(chain(TOKS)) == {EP: 1}


def test_a_block_whose_parent_is_unknown_is_dropped_and_counted_with_its_children():
    idx = KVEventIndex(BS)
    idx.apply_batch(EP, batch(stored(TOKS, 2, 4), stored(TOKS, 4, 6)))  # blocks 0-1 never seen
    assert idx.counters(EP).num_orphan_blocks == 4
    assert idx.num_blocks(EP) == 0
    idx.apply_batch(EP, batch(stored(TOKS, 0, 2)))
    assert idx.match(chain(TOKS)) == {EP: 2}


def test_match_is_not_prefix_closed_and_needs_the_first_block():
    idx = KVEventIndex(BS)
    idx.apply_batch(EP, batch(stored(TOKS)))
    idx.apply_batch(EP, batch(removed(TOKS, [3])))  # a hole in the middle: blocks 4.. are still held
    assert idx.match(chain(TOKS)) == {EP: 3}
    idx.apply_batch(EP, batch(removed(TOKS, [0])))
    assert idx.match(chain(TOKS)) == {}, "only endpoints holding the first block are listed"
    assert idx.holds(EP, chain(TOKS)[5])


def test_a_hash_stored_twice_is_held_until_removed_twice():
    # vLLM v1 keeps one cached block per (hash, block id): two requests computing the same block concurrently
    # both store it, and each eviction emits BlockRemoved.
    idx = KVEventIndex(BS)
    idx.apply_batch(EP, batch(stored(TOKS, 0, 2), stored(TOKS, 0, 2)))
    idx.apply_batch(EP, batch(removed(TOKS, [0, 1])))
    assert idx.match(chain(TOKS)) == {EP: 2}
    idx.apply_batch(EP, batch(removed(TOKS, [0, 1])))
    assert idx.match(chain(TOKS)) == {}
    idx.apply_batch(EP, batch(removed(TOKS, [0])))
    assert idx.counters(EP).num_unknown_removed_blocks == 1


def test_lora_and_cache_salt_seed_the_chain_like_the_router_does():
    idx = KVEventIndex(BS)
    # vLLM: every block of an adapter's prompt carries the lora name, the first one also the salt.
    keys = [("ad", "s1")] + [("ad",)] * 7
    idx.apply_batch(EP, batch(stored(TOKS, 0, 4, lora_name="ad", extra_keys=keys[:4], salt_tag="a"),
                              stored(TOKS, 4, 8, lora_name="ad", extra_keys=keys[4:], salt_tag="a")))
    # The simulated servers: ("salt",) on the first block only, no lora.
    idx.apply_batch(EP2, batch(stored(TOKS, 0, 8, extra_keys=[("s2",)] + [None] * 7)))
    assert idx.match(chain(TOKS, "ad", "s1")) == {EP: 8}
    assert idx.match(chain(TOKS, None, "s2")) == {EP2: 8}
    for lora, salt in [(None, None), ("ad", None), (None, "s1"), ("ad", "s2")]:
        assert idx.match(chain(TOKS, lora, salt)) == {}, (lora, salt)


def test_lora_without_a_salt_and_an_old_release_lora_id_never_match_the_base_model():
    idx = KVEventIndex(BS)
    idx.apply_batch(EP, batch(stored(TOKS, lora_name="ad", extra_keys=[("ad",)] * 8)))
    idx.apply_batch(EP2, batch(stored(TOKS, lora_id=3)))  # pre-lora_name release: only an id
    assert idx.match(chain(TOKS, "ad")) == {EP: 8}
    assert idx.match(chain(TOKS)) == {}


def test_multimodal_extra_keys_are_folded_so_text_requests_never_match_them():
    idx = KVEventIndex(BS)
    mm = [(("img-hash-1", 0),), None, (("img-hash-1", 0),), None, None, None, None, None]
    idx.apply_batch(EP, batch(stored(TOKS, 0, 1), stored(TOKS, 1, 8, extra_keys=mm[1:], salt_tag="")))
    # Block 0 is plain text; block 2 holds an image: blocks 2.. never match the text-only chain.
    assert idx.match(chain(TOKS)) == {EP: 2}
    idx.apply_batch(EP2, batch(stored(TOKS, extra_keys=[("img-hash-2", "salt")] + [None] * 7)))
    assert idx.match(chain(TOKS, None, "salt")) == {}
    assert idx.num_blocks(EP2) == 8


def test_other_block_sizes_media_and_groups_are_skipped_and_counted():
    idx = KVEventIndex(BS)
    toks = list(range(64))
    idx.apply_batch(EP, batch(BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=toks[:20],
                                          block_size=10, lora_id=None, medium="GPU", lora_name=None)))
    assert idx.counters(EP).num_block_size_mismatch_blocks == 2 and idx.block_size_seen(EP) == 10
    idx.apply_batch(EP, batch(stored(TOKS, medium="CPU"), stored(TOKS, group_idx=1)))
    assert idx.counters(EP).num_skipped_blocks == 16
    bad = stored(TOKS)
    bad.token_ids = bad.token_ids[:-1]
    idx.apply_batch(EP, batch(bad))
    negative = stored(TOKS)
    negative.token_ids[0] = -1
    idx.apply_batch(EP, batch(negative))
    assert idx.counters(EP).num_malformed_events == 2
    assert idx.num_blocks(EP) == 0 and idx.match(chain(TOKS)) == {}
    # A CPU-medium removal must not take the GPU copy of the same hash.
    idx.apply_batch(EP, batch(stored(TOKS)))
    idx.apply_batch(EP, batch(BlockRemoved(block_hashes=[srv(tuple(TOKS[:4]))], medium="CPU")))
    assert idx.match(chain(TOKS)) == {EP: 8}


def test_large_stores_are_applied_in_chunks_with_the_same_result():
    toks = list(range(4000))  # 1000 blocks
    whole, chunked = KVEventIndex(BS), KVEventIndex(BS)
    ev = stored(toks)
    whole.apply_batch(EP, batch(ev))
    steps = list(chunked.apply_events(EP, [ev, removed(toks, range(600, 1000))], chunk_blocks=64))
    assert max(steps) <= 64 and sum(steps) == 1400 and len(steps) >= 1400 // 64
    assert whole.match(chain(toks)) == {EP: 1000}
    assert chunked.match(chain(toks)) == {EP: 600}


def test_clear_and_remove_endpoint():
    idx = KVEventIndex(BS)
    idx.apply_batch(EP, batch(stored(TOKS)))
    idx.apply_batch(EP2, batch(stored(TOKS)))
    idx.clear_endpoint(EP)
    assert idx.match(chain(TOKS)) == {EP2: 8} and idx.counters(EP).num_clears == 1
    idx.remove_endpoint(EP2)
    assert idx.match(chain(TOKS)) == {} and idx.num_blocks_by_endpoint() == {}
    assert EP2 not in idx.endpoints() and EP in idx.endpoints()


def test_num_blocks_by_endpoint_is_readable_from_another_thread_while_the_index_changes():
    idx = KVEventIndex(BS)
    stop = threading.Event()
    errors: list[BaseException] = []

    def read():
        try:
            while not stop.is_set():
                idx.num_blocks_by_endpoint()
                idx.counters_by_endpoint()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=read)
    t.start()
    try:
        for i in range(300):
            toks = [i] * 4 + list(range(28))
            ep = f"10.0.0.{i % 7}:8000"
            idx.apply_batch(ep, batch(stored(toks)))
            if i % 3 == 0:
                idx.apply_batch(ep, batch(removed(toks, range(8))))
            if i % 50 == 0:
                idx.remove_endpoint(ep)
    finally:
        stop.set()
        t.join()
    assert not errors


# --- the index against a brute-force model ----------------------------------------------------------------------
# A world of prompts over a tiny alphabet (so prefixes are shared); events store ranges of a prompt's blocks
# (chained like vLLM's), remove blocks, clear. The model keeps, per endpoint, a multiset of server hashes, each
# with the router hash of its *whole path* (hash_token_blocks over all tokens from the prompt's start): an
# independent computation of what the index derives incrementally from parents.

PROMPTS = st.lists(st.lists(st.integers(0, 2), min_size=BS, max_size=5 * BS).map(lambda t: t[:len(t) // BS * BS]),
                   min_size=1, max_size=5)
OPS = st.lists(st.tuples(st.sampled_from(["store", "store", "store", "remove", "clear"]), st.integers(0, 1),
                         st.integers(0, 4), st.integers(0, 4), st.integers(1, 5)), max_size=40)


class Model:
    def __init__(self):
        self.refs: dict[str, dict[int, int]] = {EP: {}, EP2: {}}
        self.key: dict[int, int] = {}

    def store(self, ep, tokens, first, last):
        refs = self.refs[ep]
        if first and refs.get(srv(tuple(tokens[:first * BS])), 0) == 0:
            return  # orphan: the parent is not held
        for i in range(first, last):
            s = srv(tuple(tokens[:(i + 1) * BS]))
            refs[s] = refs.get(s, 0) + 1
            self.key[s] = chain(tokens[:(i + 1) * BS])[-1]

    def remove(self, ep, tokens, blocks):
        refs = self.refs[ep]
        for i in blocks:
            s = srv(tuple(tokens[:(i + 1) * BS]))
            if refs.get(s):
                refs[s] -= 1
                if not refs[s]:
                    del refs[s]

    def match(self, hashes):
        out = {}
        for ep, refs in self.refs.items():
            held = {self.key[s] for s in refs}
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            if n:
                out[ep] = n
        return out


@settings(max_examples=150, deadline=None)
@given(PROMPTS, OPS)
def test_match_equals_a_brute_force_model(prompts, ops):
    idx, model = KVEventIndex(BS), Model()
    eps = [EP, EP2]
    for kind, e, p, a, b in ops:
        ep, tokens = eps[e], prompts[p % len(prompts)]
        n = len(tokens) // BS
        if kind == "store":
            first = a % n
            last = min(n, first + b)
            idx.apply_batch(ep, batch(stored(tokens, first, last)))
            model.store(ep, tokens, first, last)
        elif kind == "remove":
            blocks = list(range(a % n, min(n, a % n + b)))
            idx.apply_batch(ep, batch(removed(tokens, blocks)))
            model.remove(ep, tokens, blocks)
        else:
            idx.apply_batch(ep, batch(AllBlocksCleared()))
            model.refs[ep] = {}
        for q in prompts:
            for cut in range(BS, len(q) + 1, BS):
                assert idx.match(chain(q[:cut])) == model.match(chain(q[:cut]))
    for ep in eps:
        assert idx.num_blocks(ep) == len(model.refs[ep])


def test_media_are_tested_before_placeholders_before_block_sizes():
    """vLLM 0.33's offloading placeholders (CPU, block_size 0, no tokens) are skipped blocks, never a block-size
    mismatch; a GPU placeholder is counted as one and leaves the block size seen alone."""
    idx = KVEventIndex(BS)
    idx.apply_batch(EP, batch(BlockStored([1], None, [], 0, None, "CPU", None, None, 0)))
    assert (idx.counters(EP).num_skipped_blocks, idx.counters(EP).num_block_size_mismatch_blocks) == (1, 0)
    assert idx.block_size_seen(EP) is None and idx.block_size_mismatch(EP) is None
    idx.apply_batch(EP, batch(BlockStored([2], None, [], 0, None, "GPU", None)))
    assert idx.counters(EP).num_placeholder_blocks == 1 and idx.block_size_mismatch(EP) is None
    idx.apply_batch(EP, batch(stored(TOKS[:30], block_size=6)))  # not a multiple of BS: never split
    assert idx.block_size_mismatch(EP) == 6
    idx.apply_batch(EP, batch(stored(TOKS)))
    assert idx.block_size_mismatch(EP) is None, "the latest GPU store has the router's block size"


def test_sglang_cache_salt_field_seeds_the_chain():
    idx = KVEventIndex(BS)
    ev = stored(TOKS, salt_tag="t")
    ev.cache_salt = "tenant-1"
    idx.apply_batch(EP, batch(ev))
    assert idx.match(chain(TOKS, salt="tenant-1")) == {EP: 8} and idx.match(chain(TOKS)) == {}


def test_router_hash_of_follows_int_and_bytes_server_hashes():
    idx = KVEventIndex(BS)
    idx.apply_batch(EP, batch(stored(TOKS)))
    h = srv(tuple(TOKS[:4]))
    assert idx.router_hash_of(EP, h) == chain(TOKS)[0] == idx.router_hash_of(EP, h.to_bytes(32, "big"))
    assert idx.router_hash_of(EP, 12345) is None and idx.router_hash_of(EP2, h) is None
    assert idx.server_hashes(EP) == {srv(tuple(TOKS[:(i + 1) * 4])) for i in range(8)}


def test_tokenization_is_verified_by_a_routed_request_stored_before_or_after():
    idx = KVEventIndex(BS)
    idx.apply_batch(EP, batch(stored(TOKS)))
    other = [t + 1000 for t in TOKS]
    for i in range(20):  # requests whose first block the server never stores under the router's hash
        idx.note_routed(EP, chain([i] * 8)[0], 100.0)
    assert idx.tokens_unverified(EP, 105.0) == 0, "too early: the server may still be computing"
    assert idx.tokens_unverified(EP, 110.0) == 20
    idx.note_routed(EP, chain(other)[0], 110.0)  # routed before the server stored it ...
    idx.apply_batch(EP, batch(stored(other)))  # ... then stored: verified
    assert idx.is_verified(EP) and idx.tokens_unverified(EP, 200.0) == 0
    idx.clear_endpoint(EP)  # verification restarts with the endpoint's entries
    assert not idx.is_verified(EP)
    idx.apply_batch(EP, batch(stored(TOKS)))
    idx.note_routed(EP, chain(TOKS)[0], 300.0)  # held already
    assert idx.is_verified(EP)


def test_an_endpoint_that_stores_nothing_is_never_a_token_mismatch():
    idx = KVEventIndex(BS)
    idx.apply_batch(EP, batch(AllBlocksCleared()))
    for i in range(50):
        idx.note_routed(EP, chain([i] * 8)[0], 0.0)
    assert idx.tokens_unverified(EP, 1000.0) == 0  # prefix caching off, or events lost: no evidence


def test_the_sourced_index_never_returns_an_untrusted_endpoints_events_entries():
    """An endpoint leaves the event endpoints (syncing, down, undecodable ...) while its events index still
    holds a partial or stale view: matches come from the own index for it."""
    from prefixroute.extproc.routing.index_sources import SourcedIndex
    from prefixroute.extproc.routing.prefix_index import PrefixIndex

    idx = KVEventIndex(BS)
    idx.apply_batch(EP, batch(stored(TOKS)))
    idx.apply_batch(EP2, batch(stored(TOKS)))
    own = PrefixIndex(1000)
    own.record(chain(TOKS)[:2], EP2)
    sourced = SourcedIndex(own, idx, own_source="feedback", event_endpoints=[EP, EP2])
    assert sourced.match(chain(TOKS)) == {EP: 8, EP2: 8}
    sourced.event_endpoints = frozenset([EP])
    assert sourced.match(chain(TOKS)) == {EP: 8, EP2: 2}, "EP2 from the own index only"
    sourced.event_endpoints = frozenset()
    assert sourced.match(chain(TOKS)) == {EP2: 2}


# --- server blocks a multiple of the router's (vLLM 0.34: 64 tokens; the router: 16) -----------------------------
K = 3  # router blocks per server block in these tests
KB = K * BS


def kstored(tokens, first=0, last=None, medium="GPU", extra_keys=None):
    """BlockStored of server blocks [first, last) of `tokens` at KB tokens per block, chained like vLLM."""
    n = len(tokens) // KB
    last = n if last is None else last
    hashes = [srv(tuple(tokens[:(i + 1) * KB])) for i in range(first, last)]
    parent = srv(tuple(tokens[:first * KB])) if first else None
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(tokens[first * KB:last * KB]),
                       block_size=KB, lora_id=None, medium=medium, lora_name=None, extra_keys=extra_keys)


def kremoved(tokens, blocks, medium="GPU"):
    return BlockRemoved(block_hashes=[srv(tuple(tokens[:(i + 1) * KB])) for i in blocks], medium=medium)


KPROMPTS = st.lists(st.lists(st.integers(0, 1), min_size=KB, max_size=4 * KB).map(lambda t: t[:len(t) // KB * KB]),
                    min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(KPROMPTS, OPS)
def test_server_blocks_k_times_the_routers_match_their_sub_blocks_exactly(prompts, ops):
    """A router hashing BS-token blocks, fed a server's KB-token events, holds exactly the BS-token sub-blocks of
    the server blocks held (brute force: each held server block's path, hashed at BS), and counts the server's
    blocks as an index at KB does."""
    idx, at_kb = KVEventIndex(BS), KVEventIndex(KB)
    refs: dict[str, dict[tuple, int]] = {EP: {}, EP2: {}}  # held server blocks by their token path
    eps = [EP, EP2]
    for kind, e, p, a, b in ops:
        ep, tokens = eps[e], prompts[p % len(prompts)]
        n = len(tokens) // KB
        if kind == "store":
            first = a % n
            last = min(n, first + b)
            ev = batch(kstored(tokens, first, last))
            if not first or refs[ep].get(tuple(tokens[:first * KB]), 0):
                for i in range(first, last):
                    path = tuple(tokens[:(i + 1) * KB])
                    refs[ep][path] = refs[ep].get(path, 0) + 1
        elif kind == "remove":
            blocks = list(range(a % n, min(n, a % n + b)))
            ev = batch(kremoved(tokens, blocks))
            for i in blocks:
                path = tuple(tokens[:(i + 1) * KB])
                if refs[ep].get(path):
                    refs[ep][path] -= 1
                    if not refs[ep][path]:
                        del refs[ep][path]
        else:
            ev = batch(AllBlocksCleared())
            refs[ep] = {}
        idx.apply_batch(ep, ev)
        at_kb.apply_batch(ep, ev)
        held = {ep: {h for path in r for h in chain(list(path))[-K:]} for ep, r in refs.items()}
        for q in prompts:
            for cut in range(BS, len(q) + 1, BS):
                hashes = chain(q[:cut])
                want = {}
                for ep, hs in held.items():
                    m = 0
                    while m < len(hashes) and hashes[m] in hs:
                        m += 1
                    if m:
                        want[ep] = m
                assert idx.match(hashes) == want
    for ep in eps:
        assert idx.num_blocks(ep) == at_kb.num_blocks(ep) == len(refs[ep])
        assert idx.server_hashes(ep) == at_kb.server_hashes(ep)
        assert idx.block_size_mismatch(ep) is None


def test_a_server_block_size_not_a_multiple_is_a_mismatch_and_a_multiple_is_split():
    idx = KVEventIndex(BS)
    toks = list(range(40))
    idx.apply_batch(EP, batch(BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=toks[:12],
                                          block_size=6, lora_id=None, medium="GPU", lora_name=None)))
    assert idx.block_size_mismatch(EP) == 6 and idx.counters(EP).num_block_size_mismatch_blocks == 2
    assert idx.num_blocks(EP) == 0
    idx.apply_batch(EP2, batch(kstored(toks[:2 * KB])))
    assert (idx.block_size_seen(EP2), idx.block_size_mismatch(EP2), idx.split_of(EP2)) == (KB, None, K)
    assert idx.match(chain(toks[:2 * KB])) == {EP2: 2 * K} and idx.num_blocks(EP2) == 2
    # A removal carries no block size: it takes the server block's K sub-blocks, by the endpoint's K.
    idx.apply_batch(EP2, batch(kremoved(toks[:2 * KB], [1])))
    assert idx.match(chain(toks[:2 * KB])) == {EP2: K} and idx.num_blocks(EP2) == 1
    assert idx.router_hash_of(EP2, srv(tuple(toks[:KB]))) == chain(toks[:KB])[-1]


def test_a_block_over_max_split_times_the_routers_is_a_mismatch_not_thousands_of_entries():
    from prefixroute.extproc.kv_events.index import MAX_SPLIT

    idx = KVEventIndex(BS)
    size = (MAX_SPLIT + 1) * BS
    idx.apply_batch(EP, batch(BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[1] * size,
                                          block_size=size, lora_id=None, medium="GPU", lora_name=None),
                              BlockRemoved(block_hashes=[7], medium="GPU")))
    assert idx.block_size_mismatch(EP) == size and idx.split_of(EP) == 1
    assert idx.counters(EP).num_block_size_mismatch_blocks == 1 and idx.num_blocks(EP) == 0


def test_split_extra_keys_keep_the_salt_on_the_first_sub_block():
    idx = KVEventIndex(BS)
    toks = list(range(50, 50 + 2 * KB))
    idx.apply_batch(EP, batch(kstored(toks, extra_keys=[["tenant-7"], None])))
    assert idx.match(chain(toks, None, "tenant-7")) == {EP: 2 * K}
    assert idx.match(chain(toks)) == {}
