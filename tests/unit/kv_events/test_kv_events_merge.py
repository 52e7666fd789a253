"""Pages smaller than the router's block, merged into router blocks (extproc/kv_events/merge.py): SGLang at its
default page of 1 token, whose radix cache forks a branch at any token and publishes nothing when it splits a node.

The model below is SGLang's radix cache as its recorder reports it (one BlockStored per new node with the node's
page hashes and tokens, the parent's last page as ``parent_block_hash``; a split keeps every page's hash; eviction
removes leaves, a BlockRemoved per node). After every operation the index must give each prompt the complete
router blocks of the longest prefix the model's tree holds, and count the tree's pages."""

from __future__ import annotations

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.extproc.kv_events.index import KVEventIndex
from prefixroute.extproc.kv_events.merge import PageMerger
from prefixroute.extproc.routing.hashing import hash_token_blocks, token_seed_for
from prefixroute.kv_events_wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

BS = 16  # the router's block, its default
EP = "10.0.0.1:30000"


def page_hash(prefix: tuple[int, ...], salt: str | None = None) -> int:
    """A page's hash: a function of the whole prefix through it (SGLang chains sha256), signed int64 as SGLang
    publishes it."""
    h = xxhash.xxh3_64_intdigest(repr((salt, prefix)).encode())
    return h - (1 << 64) if h >= 1 << 63 else h


class _Node:
    def __init__(self, tokens: list[int], hashes: list[int], parent: _Node | None) -> None:
        self.tokens, self.hashes, self.parent = tokens, hashes, parent
        self.children: dict[tuple[int, ...], _Node] = {}  # by the first page's tokens, as SGLang keys them


class RadixModel:
    """SGLang's radix cache at `page` tokens per page, as its KVCacheEventRecorder publishes it."""

    def __init__(self, page: int, salt: str | None = None) -> None:
        self.page, self.salt = page, salt
        self.root = _Node([], [], None)
        self.events: list = []

    def key(self, tokens: list[int]) -> tuple[int, ...]:
        return tuple(tokens[:self.page])

    def insert(self, tokens: list[int]) -> None:
        tokens = tokens[:len(tokens) // self.page * self.page]  # SGLang caches whole pages
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tuple(tokens[i:i + self.page]))
            if child is None:
                break
            k = 0
            while k < len(child.tokens) and i + k < len(tokens) and child.tokens[k] == tokens[i + k]:
                k += 1
            k -= k % self.page
            if k < len(child.tokens):  # split: the first k tokens become a new node above; nothing is published
                top = _Node(child.tokens[:k], child.hashes[:k // self.page], node)
                node.children[self.key(tokens[i:])] = top
                child.tokens, child.hashes, child.parent = child.tokens[k:], child.hashes[k // self.page:], top
                top.children[self.key(child.tokens)] = child
                node, i = top, i + k
                break
            node, i = child, i + k
        if i >= len(tokens):
            return
        new = tokens[i:]
        hashes = [page_hash(tuple(tokens[:j + self.page]), self.salt) for j in range(i, len(tokens), self.page)]
        leaf = _Node(new, hashes, node)
        node.children[self.key(new)] = leaf
        self.events.append(BlockStored(block_hashes=list(leaf.hashes),
                                       parent_block_hash=node.hashes[-1] if node.parent is not None else None,
                                       token_ids=list(new), block_size=self.page, medium="GPU",
                                       cache_salt=self.salt))

    def leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            stack += n.children.values()
            if not n.children and n.parent is not None:
                out.append(n)
        return out

    def evict(self, leaf: _Node) -> None:
        del leaf.parent.children[self.key(leaf.tokens)]
        self.events.append(BlockRemoved(block_hashes=list(leaf.hashes), medium="GPU"))

    def clear(self) -> None:
        self.root.children = {}
        self.events.append(AllBlocksCleared())

    def cached_tokens(self, tokens: list[int]) -> int:
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(self.key(tokens[i:]))
            if child is None:
                break
            k = 0
            while k < len(child.tokens) and i + k < len(tokens) and child.tokens[k] == tokens[i + k]:
                k += 1
            i += k - k % self.page
            if k < len(child.tokens):
                break
            node = child
        return i

    def num_pages(self) -> int:
        out, stack = 0, [self.root]
        while stack:
            n = stack.pop()
            out += len(n.hashes)
            stack += n.children.values()
        return out

    def take(self) -> EventBatch:
        batch, self.events = EventBatch(ts=1.0, events=self.events), []
        return batch


def blocks(tokens: list[int], salt: str | None = None) -> list:
    return hash_token_blocks(tokens, BS, token_seed_for(None, salt))


def check(idx: KVEventIndex, model: RadixModel, prompts: list[list[int]]) -> None:
    for p in prompts:
        want = model.cached_tokens(p) // BS
        got = idx.match(blocks(p, model.salt)).get(EP, 0)
        assert got == want, (p[:8], len(p), got, want)
    assert idx.num_blocks(EP) == model.num_pages()


SEGMENTS = [list(range(1000 * s, 1000 * s + 60)) for s in range(4)]
PROMPTS = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 45)), min_size=1, max_size=4).map(
    lambda parts: [t for s, n in parts for t in SEGMENTS[s][:n]])
OPS = st.lists(st.one_of(
    st.tuples(st.just("insert"), PROMPTS),
    st.tuples(st.just("evict"), st.integers(0, 50)),
    st.tuples(st.just("clear"), st.none())), min_size=1, max_size=25)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), OPS, st.sampled_from([None, "tenant-7"]), st.sampled_from([1, 2, 256]))
def test_merged_index_holds_exactly_the_router_blocks_the_server_holds_whole(page, ops, salt, chunk_blocks):
    """`chunk_blocks` 1 and 2 cut most stores into pieces of 16 or 32 pages' worth (`_apply_merged`)."""
    idx, model, seen = KVEventIndex(BS), RadixModel(page, salt), []
    for op, arg in ops:
        if op == "insert":
            model.insert(arg)
            seen.append(arg)
        elif op == "evict":
            leaves = model.leaves()
            if leaves:
                model.evict(leaves[arg % len(leaves)])
        else:
            model.clear()
        for _ in idx.apply_events(EP, model.take().events, chunk_blocks):
            pass
        check(idx, model, seen)
    c = idx.counters(EP)
    assert (c.num_orphan_blocks, c.num_unknown_removed_blocks, c.num_malformed_events,
            c.num_block_size_mismatch_blocks) == (0, 0, 0, 0)
    assert idx.block_size_mismatch(EP) is None


def test_a_branch_forking_inside_a_router_block_is_matched_through_the_fork():
    """The case the merge exists for: B shares 20 tokens with A (a fork at no block boundary); SGLang splits A's
    node and publishes only B's 30 new tokens, whose parent is A's 20th page."""
    idx, model = KVEventIndex(BS), RadixModel(1)
    a = list(range(100, 148))
    b = a[:20] + list(range(500, 530))
    model.insert(a)
    model.insert(b)
    batch = model.take()
    assert [len(e.block_hashes) for e in batch.events] == [48, 30]
    assert batch.events[1].parent_block_hash == page_hash(tuple(a[:20]))
    idx.apply_batch(EP, batch)
    assert idx.match(blocks(a)) == {EP: 3} and idx.match(blocks(b)) == {EP: 3}
    model.evict(next(leaf for leaf in model.leaves() if leaf.tokens[0] == 500))  # B's branch goes
    idx.apply_batch(EP, model.take())
    assert idx.match(blocks(b)) == {EP: 1} and idx.match(blocks(a)) == {EP: 3}
    assert idx.num_blocks(EP) == 48


def test_a_child_of_an_unknown_page_is_an_orphan_and_unknown_removals_are_counted():
    idx = KVEventIndex(BS)
    idx.apply_batch(EP, EventBatch(ts=1.0, events=[
        BlockStored(block_hashes=list(range(1, 41)), parent_block_hash=999, token_ids=list(range(40)), block_size=1),
        BlockRemoved(block_hashes=[777])]))
    c = idx.counters(EP)
    assert (c.num_orphan_blocks, c.num_unknown_removed_blocks, idx.num_blocks(EP)) == (2, 1, 0)


def test_pages_of_a_prompt_shorter_than_a_router_block_are_held_but_not_matched():
    idx, model = KVEventIndex(BS), RadixModel(1)
    short = list(range(7, 17))
    model.insert(short)
    idx.apply_batch(EP, model.take())
    assert idx.match(blocks(short + list(range(50, 60)))) == {} and idx.num_blocks(EP) == 10
    model.insert(short + list(range(50, 60)))  # completes the first router block across two nodes
    idx.apply_batch(EP, model.take())
    assert idx.match(blocks(short + list(range(50, 60)))) == {EP: 1}


def test_a_restart_at_another_page_size_starts_a_new_merger_and_clear_forgets_pages():
    idx, model = KVEventIndex(BS), RadixModel(1)
    model.insert(list(range(40)))
    idx.apply_batch(EP, model.take())
    assert idx.num_blocks(EP) == 40
    idx.clear_endpoint(EP)
    assert idx.num_blocks(EP) == 0 and idx.match(blocks(list(range(40)))) == {}
    model4 = RadixModel(4)
    model4.insert(list(range(40)))
    idx.apply_batch(EP, model4.take())
    assert idx.num_blocks(EP) == 10 and idx.match(blocks(list(range(40)))) == {EP: 2}


@pytest.mark.parametrize("page, block", [(0, 16), (16, 16), (3, 16), (32, 16)])
def test_merger_refuses_page_sizes_that_do_not_divide_the_block(page, block):
    with pytest.raises(ValueError):
        PageMerger(block, page)


def test_a_long_prompts_pages_are_merged_a_piece_at_a_time():
    """A 20,000-token node (one event) is merged and applied in pieces of `chunk_blocks` router blocks' worth, a
    yield after each (the subscriber lets routing decisions run there), with the same outcome as at once."""
    model = RadixModel(1)
    long = list(range(20_000))
    model.insert(long)
    model.insert(long[:10_007] + [7] * 40)  # a fork in the middle of the long node
    events = model.take().events
    at_once, pieces = KVEventIndex(BS), KVEventIndex(BS)
    assert len(list(at_once.apply_events(EP, events, chunk_blocks=10_000))) == 1
    yields = list(pieces.apply_events(EP, events, chunk_blocks=64))
    assert len(yields) >= 20_000 // (64 * BS) and max(yields) <= 64
    for idx in (at_once, pieces):
        assert idx.match(blocks(long)) == {EP: 1250}
        assert idx.match(blocks(long[:10_007] + [7] * 40)) == {EP: (10_007 + 40) // BS}
        assert idx.num_blocks(EP) == 20_040 and idx.counters(EP).num_orphan_blocks == 0
