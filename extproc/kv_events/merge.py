"""Server pages smaller than the router's block, merged into router blocks (SGLang at its default page of 1 token).

SGLang's radix cache publishes one hash per page, and at ``--page-size 1`` (its default on most attention backends)
a page is one token. Its recorder coalesces a radix node's pages into one `BlockStored` (n hashes, n tokens,
``block_size`` 1) whose ``parent_block_hash`` is the last page of the node above. A node split publishes nothing: the
two halves keep their page hashes, so a later branch's ``parent_block_hash`` may name *any* page of an earlier event,
at any token, not only a multiple of the router's block.

`PageMerger` rewrites one endpoint's events in the router's block size (``block_size`` tokens, m pages of
``page_size`` each, ``block_size`` = m x ``page_size``):
- It keeps, for every page stored and not removed, the *run* (the stored event) it came from. A run knows the chain
  state at its first page: the server hash of the last complete router block before it (None at a prompt's
  start) and the tokens of its first router block that come from the pages above it (fewer than m pages). The state
  at any page of the run follows from those, its tokens and its position, so a branch can start at any page.
- A `BlockStored` becomes one router-sized `BlockStored` of the router blocks it *completes*: their tokens (the
  first one starting with the pages above, when the run starts inside a router block), each block named by its
  last page's server hash, chained to the last complete router block above (``parent_block_hash``; None for a
  prompt's first block, whose seed comes from the event's ``lora_name`` and ``cache_salt`` as for any first block).
  Pages after the last complete router block are held, not indexed: a server holding 40 tokens of a prompt is
  credited with 32, as a router block is credited only when every token of it is cached.
- A `BlockRemoved` becomes the removal of the router blocks whose *last* page it removes. SGLang evicts leaves
  first (a node goes before the node above it), so a router block's last page, being deepest, goes first; the
  block's other pages go after it and remove nothing more. A page it never saw (an orphan, or stored before the
  subscription) is passed on for the index to count as unknown.
- A `BlockStored` whose parent page is unknown here (evicted before we saw it, events lost) is dropped and counted
  (``num_orphan_blocks``, in the router blocks it would have completed, at least 1).
- `AllBlocksCleared` forgets every page. Events on other media (SGLang's host tier), and stores of another block
  size, pass through unchanged (the index skips or counts them).

Invariant (tests/unit/kv_events/test_kv_events_merge.py, against a radix-tree model of SGLang's cache): after every
batch, the index holds exactly the router blocks every token of which the server holds, keyed by the router's
own chained hash of their tokens, so `KVEventIndex.match` gives each endpoint the complete router blocks of the
longest prefix it caches.

Memory: one dict entry per cached page (its key is the event's own int, shared with the run) and 4 bytes of
token: 97 bytes per cached token at page 1 (tracemalloc, the events freed), so ~40 MB per endpoint for a
400k-token cache, against 9.3 bytes per token for the index at 16-token blocks: the price of following a server
that names every token. Time: ~0.2-0.3 us per page on this 2-core host (an 8k-token node ~2.6 ms to store, ~1.4 ms
to remove), against ~0.04 us per token at 16-token blocks; `KVEventIndex` merges a long node in pieces of
``chunk_blocks`` router blocks (4,096 pages at the subscriber's 256: ~1.6 ms at most between two yields to the
event loop). Pure Python, not thread-safe: the index's thread only.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import repeat
from typing import Any

from prefixroute.kv_events_wire import (GPU_MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEventsDecodeError,
                                        block_hash_int)


def _page_hashes(hashes: Sequence[Any]) -> list[int]:
    """`hashes` as non-negative ints (`block_hash_int`), at C speed for SGLang's signed int64 (or unsigned) ints."""
    for signed in ("q", "Q"):
        try:
            return array("Q", array(signed, hashes).tobytes()).tolist()
        except (OverflowError, TypeError):
            pass
    return [block_hash_int(h) for h in hashes]


class _Run:
    """The pages of one stored event and the chain state at its first page (module docstring)."""

    __slots__ = ("hashes", "tokens", "head_parent", "head_tokens", "offset")

    def __init__(self, hashes: Sequence[int], tokens: Sequence[Any], head_parent: int | None, head_tokens: list,
                 offset: int) -> None:
        self.hashes = hashes  # the pages' server hashes (non-negative ints), in chain order
        self.tokens = tokens  # their tokens, page_size per page (an array("I"), or the event's list)
        self.head_parent = head_parent  # server hash of the last complete router block before the run; None: none
        self.head_tokens = head_tokens  # tokens of the run's first router block from the pages above it
        self.offset = offset  # pages above the run in its first router block (0 <= offset < m)


class PageMerger:
    """One endpoint's events rewritten from pages of `page_size` tokens into router blocks of `block_size`
    (`page_size` divides `block_size`; module docstring). Counts into the index's `counters` what it drops."""

    __slots__ = ("block_size", "page_size", "m", "where")

    def __init__(self, block_size: int, page_size: int) -> None:
        if page_size < 1 or block_size % page_size or page_size >= block_size:
            raise ValueError(f"page_size must divide block_size and be smaller, got {page_size} / {block_size}")
        self.block_size = block_size
        self.page_size = page_size
        self.m = block_size // page_size
        self.where: dict[int, _Run] = {}  # server page hash -> the run that stored it

    @property
    def num_pages(self) -> int:
        """Pages held (stored and not removed), in the server's own units."""
        return len(self.where)

    def clear(self) -> None:
        self.where = {}

    def merge(self, events: Sequence[Any], counters: Any) -> list[Any]:
        """`events` in router blocks (module docstring), in order; a new list."""
        out: list[Any] = []
        for ev in events:
            t = type(ev)
            if t is BlockStored and ev.medium in GPU_MEDIA and ev.group_idx in (None, 0) \
                    and ev.block_size == self.page_size and len(ev.token_ids):
                stored = self._store(ev, counters)
                if stored is not None:
                    out.append(stored)
            elif t is BlockRemoved and ev.medium in GPU_MEDIA and ev.group_idx in (None, 0):
                removed = self._remove(ev, counters)
                if removed is not None:
                    out.append(removed)
            else:
                if t is AllBlocksCleared:
                    self.clear()
                out.append(ev)
        return out

    def _state_after(self, run: _Run, i: int) -> tuple[int | None, list, int]:
        """(parent router block's server hash, tokens of the open router block, its pages) after page `i` of
        `run`."""
        m, p = self.m, self.page_size
        t = run.offset + i + 1  # pages from the run's first router block start through page i
        c, rem = divmod(t, m)
        if c == 0:
            return run.head_parent, run.head_tokens + list(run.tokens[:(i + 1) * p]), rem
        start = c * m - run.offset  # the run's first page after its c-th complete router block
        return run.hashes[start - 1], list(run.tokens[start * p:(i + 1) * p]), rem

    def _store(self, ev: BlockStored, counters: Any) -> BlockStored | None:
        n = len(ev.block_hashes)
        m, p = self.m, self.page_size
        if len(ev.token_ids) != n * p:
            counters.num_malformed_events += 1
            return None
        try:
            hashes = _page_hashes(ev.block_hashes)
            parent = None if ev.parent_block_hash is None else block_hash_int(ev.parent_block_hash)
        except KVEventsDecodeError:
            counters.num_malformed_events += 1
            return None
        if parent is None:
            head_parent, head_tokens, offset = None, [], 0
        else:
            above = self.where.get(parent)
            if above is None:
                counters.num_orphan_blocks += max(1, n // m)
                return None
            head_parent, head_tokens, offset = self._state_after(above, above.hashes.index(parent))
        try:  # 4 bytes a token instead of a list's pointer and int object: a third of the memory per page
            kept = array("I", ev.token_ids)
        except (OverflowError, TypeError, ValueError):  # ids out of range, SGLang's EAGLE bigram pairs
            kept = ev.token_ids
        run = _Run(hashes, kept, head_parent, head_tokens, offset)
        self.where.update(zip(hashes, repeat(run)))
        num_blocks = (offset + n) // m
        if num_blocks == 0:
            return None
        tokens = (head_tokens + list(ev.token_ids[:(num_blocks * m - offset) * p])) if offset else \
            list(ev.token_ids[:num_blocks * m * p])
        ends = [hashes[(k + 1) * m - offset - 1] for k in range(num_blocks)]
        return BlockStored(block_hashes=ends, parent_block_hash=head_parent, token_ids=tokens,
                           block_size=self.block_size, lora_id=ev.lora_id, medium=ev.medium,
                           lora_name=ev.lora_name, extra_keys=None, group_idx=ev.group_idx,
                           cache_salt=ev.cache_salt)

    def _remove(self, ev: BlockRemoved, counters: Any) -> BlockRemoved | None:
        m = self.m
        try:
            hashes = _page_hashes(ev.block_hashes)
        except KVEventsDecodeError:
            counters.num_malformed_events += 1
            return None
        pop = self.where.pop
        runs = [pop(h, None) for h in hashes]
        ends: list[int] = []
        k, n = 0, len(hashes)
        while k < n:
            run = runs[k]
            if run is None:  # unknown here: the index counts it
                ends.append(hashes[k])
                k += 1
                continue
            i = run.hashes.index(hashes[k])
            # A node's pages come in chain order, a stretch of one run: compared and sliced at C speed.
            length = min(n - k, len(run.hashes) - i)
            while length > 1 and not (hashes[k:k + length] == run.hashes[i:i + length]
                                      and runs[k:k + length].count(run) == length):
                length //= 2  # a stretch's prefix is one too: halve until one matches
            first_end = i + (m - 1 - (run.offset + i) % m)  # the first router block end at or after page i
            ends += run.hashes[first_end:i + length:m]
            k += length
        if not ends:
            return None
        return BlockRemoved(block_hashes=ends, medium=ev.medium, group_idx=ev.group_idx)
