"""The prefix index: which endpoints are believed to hold which block hashes (approximate, router-side).

The router cannot see the endpoints' KV caches; it records what it sent where. Each endpoint has an LRU of
block hashes whose capacity follows that endpoint's KV capacity, so the index forgets roughly when the
endpoint's cache would evict.

Layout: one LRU (``OrderedDict``, least recent first) per endpoint, plus ``head block -> endpoints`` for the
first block of each recorded prompt (the only block `match` needs to look up across endpoints). No
per-block owner sets: `record` and eviction then run as C-level bulk operations, so recording 256 new
blocks costs about what recording 16 does in a per-block Python loop.

Invariants:
- `_heads` and the LRUs agree: ``ep in _heads[h]`` iff h is in ep's LRU flagged as a head (value True).
  An endpoint's LRU never exceeds its capacity.
- `record` touches a request's blocks from last to first, so a prefix's head blocks are the most recently
  used and evicted last (like vLLM, which frees a sequence's tail blocks first): eviction shortens remembered
  prefixes from their tail instead of breaking them at the head, which would make every later block unmatched.
- `match` counts *consecutive leading* blocks only: block hashes are chained, so a hit after a miss means
  nothing for KV reuse.
- Prefix closure: the blocks an endpoint holds are closed under "is a leading block of". A chained hash
  names its whole prefix, so every request that contains a block also contains its ancestors and `record`
  touches those later (more recent); eviction takes the least recent first, hence never an ancestor before
  its descendants. `match` relies on it to binary-search (exact up to 64-bit hash collisions). It also
  relies on hashes being chained from a seed: a block's hash is a head (position 0) in every prompt or in none.

Not thread-safe: use from one thread (the router's event loop), except `num_entries_by_endpoint`. Memory
grows with (block, endpoint) entries, bounded by each endpoint's capacity (docs/benchmarks.md: Inter-token latency, decision time, prefix index memory).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container, Iterable, Sequence
from itertools import repeat, starmap
from operator import itemgetter

from prefixroute.types import BlockHash, EndpointId

_is_head = itemgetter(1)  # (block hash, is_head) -> is_head


def num_leading_held(block_hashes: Sequence[BlockHash], held: Container[BlockHash]) -> int:
    """How many leading blocks of `block_hashes` (a chain) `held` holds, when `held` is closed under prefixes
    (every block it holds comes with all the blocks before it in its chain: the module docstring's prefix
    closure). Then the held blocks are a prefix of the chain, found by binary search: O(log n) lookups, the
    whole-prompt case (the common affinity case) in two."""
    n = len(block_hashes)
    if not n or block_hashes[0] not in held:
        return 0
    if block_hashes[-1] in held:
        return n
    lo, hi = 1, n - 1  # holds block lo-1; the answer is the largest count in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if block_hashes[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


def drop_holder(holders_of: dict[BlockHash, set[EndpointId]], endpoint: EndpointId,
                heads: Iterable[BlockHash]) -> None:
    """Remove `endpoint` from the holder set of each of `heads` in `holders_of`, deleting sets that empty (the
    head-block lookup of `PrefixIndex` and of the KV-events index)."""
    for h in heads:
        holders = holders_of.get(h)
        if holders is not None:
            holders.discard(endpoint)
            if not holders:
                del holders_of[h]


class PrefixIndex:
    """Per-endpoint LRUs of block hashes (capacity in router blocks) + the head-block lookup."""

    __slots__ = ("_heads", "_lru", "_capacity", "default_capacity_blocks")

    def __init__(self, default_capacity_blocks: int = 31250) -> None:
        if default_capacity_blocks < 1:
            raise ValueError("default_capacity_blocks must be >= 1")
        self.default_capacity_blocks = default_capacity_blocks
        self._heads: dict[BlockHash, set[EndpointId]] = {}
        self._lru: dict[EndpointId, OrderedDict[BlockHash, bool]] = {}  # value True = head block
        self._capacity: dict[EndpointId, int] = {}

    # --- queries -------------------------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[EndpointId, int]:
        """Endpoints holding at least the first block -> number of consecutive leading blocks they hold.

        Empty dict = prefix seen nowhere (one dict lookup). Does not change recency (a lookup is not a use;
        `record` after the pick is). Cost O(holders of the first block x log(blocks)): by the prefix-closure
        invariant (module docstring) the blocks an endpoint holds form a prefix of the chain, so each
        endpoint's count is found by binary search instead of walking up to max_blocks blocks.
        """
        if not block_hashes:
            return {}
        first = self._heads.get(block_hashes[0])
        if not first:
            return {}
        lru = self._lru
        return {ep: num_leading_held(block_hashes, lru[ep]) for ep in first}

    def capacity(self, endpoint: EndpointId) -> int:
        """The LRU capacity (blocks) of `endpoint`: set by `set_capacity`, else the default."""
        return self._capacity.get(endpoint, self.default_capacity_blocks)

    def num_entries(self, endpoint: EndpointId | None = None) -> int:
        """Number of (block, endpoint) entries, for one endpoint or all."""
        if endpoint is not None:
            lru = self._lru.get(endpoint)
            return len(lru) if lru else 0
        return sum(len(lru) for lru in self._lru.values())

    def num_entries_by_endpoint(self) -> dict[EndpointId, int]:
        """Entries (block hashes held) per endpoint that holds any. O(endpoints), never O(entries).

        The one method safe to call from another thread (the Prometheus scrape thread) while the event loop
        updates the index: ``list(dict.items())`` and ``len()`` of each LRU are single C calls under the GIL,
        so the answer is a consistent-enough reading without a lock on the request path."""
        return {ep: len(lru) for ep, lru in list(self._lru.items()) if lru}

    # --- updates -------------------------------------------------------------------------------------------
    def record(self, block_hashes: Sequence[BlockHash], endpoint: EndpointId) -> None:
        """Remember that `endpoint` now holds `block_hashes` (after a pick); they become its most recent,
        the first block most recent of all."""
        if not block_hashes:
            return
        lru = self._lru.get(endpoint)
        if lru is None:
            lru = self._lru[endpoint] = OrderedDict()
        head = block_hashes[0]
        tail = block_hashes[:0:-1]  # blocks n-1 .. 1: least recent first
        # C-level loops: deque(maxlen=0) consumes the map without a Python frame per block.
        if block_hashes[-1] in lru:  # all held (prefix closure): the affinity case, refresh in place
            deque(map(lru.move_to_end, tail), maxlen=0)
            lru.move_to_end(head)
        else:  # some new: remove what is held, then append all in order
            deque(map(lru.pop, tail, repeat(None)), maxlen=0)
            lru.pop(head, None)
            lru.update(dict.fromkeys(tail, False))
            lru[head] = True
        holders = self._heads.get(head)
        if holders is None:
            self._heads[head] = {endpoint}
        else:
            holders.add(endpoint)
        self._evict(endpoint, lru, self.capacity(endpoint))

    def set_capacity(self, endpoint: EndpointId, num_blocks: int) -> None:
        """Set `endpoint`'s LRU capacity in router blocks (evicts its least recent entries if now over)."""
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self._capacity[endpoint] = num_blocks
        lru = self._lru.get(endpoint)
        if lru:
            self._evict(endpoint, lru, num_blocks)

    def remove_endpoint(self, endpoint: EndpointId) -> None:
        """Forget everything `endpoint` holds, and its capacity (an endpoint that leaves takes its entries)."""
        self._capacity.pop(endpoint, None)
        self.clear_endpoint(endpoint)

    def clear_endpoint(self, endpoint: EndpointId) -> None:
        """Forget everything `endpoint` holds, keeping its capacity (its KV cache was emptied: a restart)."""
        lru = self._lru.pop(endpoint, None)
        if lru:
            self._drop_heads(endpoint, [h for h, is_head in lru.items() if is_head])

    def _evict(self, endpoint: EndpointId, lru: OrderedDict[BlockHash, bool], capacity: int) -> None:
        excess = len(lru) - capacity
        if excess > 0:
            evicted = starmap(lru.popitem, repeat((False,), excess))  # least recent first, C-level
            self._drop_heads(endpoint, [h for h, _ in filter(_is_head, evicted)])

    def _drop_heads(self, endpoint: EndpointId, heads: Iterable[BlockHash]) -> None:
        drop_holder(self._heads, endpoint, heads)
