"""The prefix index: which endpoints are believed to hold which block hashes (approximate, router-side).

The router cannot see the endpoints' KV caches; it records what it sent where. Each endpoint has an LRU of
block hashes whose capacity follows that endpoint's KV capacity, so the index forgets roughly when the
endpoint's cache would evict.

Invariants:
- ``block -> endpoints`` (`_owners`) and each endpoint's LRU always agree: a block is listed for an endpoint
  iff it is in that endpoint's LRU. An endpoint's LRU never exceeds its capacity.
- `record` touches a request's blocks from last to first, so a prefix's head blocks are the most recently
  used and evicted last (like vLLM, which frees a sequence's tail blocks first): eviction shortens remembered
  prefixes from their tail instead of breaking them at the head, which would make every later block unmatched.
- `match` counts *consecutive leading* blocks only: block hashes are chained, so a hit after a miss means
  nothing for KV reuse.

Not thread-safe: use from one thread (the router's event loop). Memory is about 200 bytes per (block,
endpoint) entry: 31,250 blocks x 256 endpoints ~ 1.6 GB at worst, ~25 MB for 4 endpoints.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from prefixroute.routing.types import BlockHash, EndpointId


class PrefixIndex:
    """Block hash -> endpoints, with a per-endpoint LRU (capacity in router blocks)."""

    __slots__ = ("_owners", "_lru", "_capacity", "default_capacity_blocks")

    def __init__(self, default_capacity_blocks: int = 31250) -> None:
        if default_capacity_blocks < 1:
            raise ValueError("default_capacity_blocks must be >= 1")
        self.default_capacity_blocks = default_capacity_blocks
        self._owners: dict[BlockHash, set[EndpointId]] = {}
        self._lru: dict[EndpointId, OrderedDict[BlockHash, None]] = {}
        self._capacity: dict[EndpointId, int] = {}

    # --- queries -------------------------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[EndpointId, int]:
        """Endpoints holding at least the first block -> number of consecutive leading blocks they hold.

        Stops as soon as no endpoint holds the next block, so a miss costs one dict lookup. Does not change
        recency (a lookup is not a use; `record` after the pick is). Empty dict = prefix seen nowhere.
        """
        if not block_hashes:
            return {}
        owners = self._owners
        first = owners.get(block_hashes[0])
        if not first:
            return {}
        result = dict.fromkeys(first, 1)
        alive = set(first)
        for i in range(1, len(block_hashes)):
            holders = owners.get(block_hashes[i])
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            n = i + 1
            for ep in alive:
                result[ep] = n
        return result

    def capacity(self, endpoint: EndpointId) -> int:
        """The LRU capacity (blocks) of `endpoint`: set by `set_capacity`, else the default."""
        return self._capacity.get(endpoint, self.default_capacity_blocks)

    def num_entries(self, endpoint: EndpointId | None = None) -> int:
        """Number of (block, endpoint) entries, for one endpoint or all."""
        if endpoint is not None:
            lru = self._lru.get(endpoint)
            return len(lru) if lru else 0
        return sum(len(lru) for lru in self._lru.values())

    @property
    def num_blocks(self) -> int:
        """Number of distinct block hashes held by any endpoint."""
        return len(self._owners)

    def endpoints(self) -> Iterable[EndpointId]:
        """Endpoints that hold at least one entry."""
        return [ep for ep, lru in self._lru.items() if lru]

    # --- updates -------------------------------------------------------------------------------------------
    def record(self, block_hashes: Sequence[BlockHash], endpoint: EndpointId) -> None:
        """Remember that `endpoint` now holds `block_hashes` (after a pick); they become its most recent."""
        if not block_hashes:
            return
        lru = self._lru.get(endpoint)
        if lru is None:
            lru = self._lru[endpoint] = OrderedDict()
        owners = self._owners
        move = lru.move_to_end
        for h in reversed(block_hashes):  # head blocks last = most recent (see module docstring)
            if h in lru:
                move(h)
            else:
                lru[h] = None
                holders = owners.get(h)
                if holders is None:
                    owners[h] = {endpoint}
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
        lru = self._lru.pop(endpoint, None)
        if not lru:
            return
        owners = self._owners
        for h in lru:
            holders = owners.get(h)
            if holders is not None:
                holders.discard(endpoint)
                if not holders:
                    del owners[h]

    def clear(self) -> None:
        self._owners.clear()
        self._lru.clear()

    def _evict(self, endpoint: EndpointId, lru: OrderedDict[BlockHash, None], capacity: int) -> None:
        owners = self._owners
        while len(lru) > capacity:
            h, _ = lru.popitem(last=False)
            holders = owners[h]
            holders.discard(endpoint)
            if not holders:
                del owners[h]
