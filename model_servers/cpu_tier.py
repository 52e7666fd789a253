"""Host-memory (CPU) KV tier of one simulated engine: vLLM's native KV offloading in miniature (pure logic, no
I/O, not thread-safe: the engine that owns it calls it).

vLLM 0.33 turns it on with ``--kv-offloading-size GiB`` (the host buffer, summed over TP ranks) and
``--kv-offloading-backend native``; ``vllm/v1/kv_offload`` keeps offloaded blocks in pinned host memory under
their own LRU, and ``distributed/kv_transfer/kv_connector/v1/offloading/events.py`` publishes KV events for
them with ``medium: "CPU"``. This tier follows it, with one simplification said here: a block is written to
host memory when the GPU evicts it (vLLM stores blocks as soon as they are computed, on a side stream; what
matters to a router -- which hashes are host-resident, and the removal when the host LRU drops one -- is the
same, and the host copy of a block the GPU still holds is never read).

Contract:
- `offload(hashes)`: the GPU evicted these block hashes; each is stored (a hash already here is only touched:
  it moves to the LRU tail); past `num_blocks`, the least recently used hashes are removed.
- `num_leading(hashes)`: how many leading hashes are here (the prefix a request can load); they are touched.
- `load_time_s(num_blocks)`: host-to-device transfer time of that many blocks at `load_bytes_per_s`.
- Events (`take_events`, after `enable_events`): what vLLM 0.33's offloading tracker publishes when it has no
  token snapshot of a block (the form of the golden payloads in tests/data/kv_events/vllm-0.33.0): one
  placeholder `BlockStored` per stored block (that hash only, ``token_ids`` empty, ``block_size`` 0, ``medium``
  "CPU", ``group_idx`` 0), and per batch of removals one `BlockRemoved` (``medium`` "CPU", ``group_idx`` 0).
  Applied in order to an empty set they give exactly the hashes held here.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from prefixroute.kv_events_wire import BlockRemoved, BlockStored

MEDIUM_CPU = "CPU"
"""vLLM's ``medium`` of its CPU offloading tier (``vllm.v1.kv_offload`` ``MEDIUM_CPU``)."""



def num_cpu_blocks(size_gib: float | None, kv_bytes_per_token: int, block_size: int) -> int:
    """Blocks a ``--kv-offloading-size size_gib`` host buffer holds (0 when None). vLLM's size is the total over
    TP ranks and each rank stores its 1/TP shard of every block, so the count is the same at any TP degree."""
    if not size_gib:
        return 0
    if size_gib < 0:
        raise ValueError(f"--kv-offloading-size must be >= 0 GiB; got {size_gib}")
    return int(size_gib * (1 << 30) // (kv_bytes_per_token * block_size))


class CPUTier:
    """LRU set of offloaded block hashes with vLLM's CPU-medium KV events (module docstring)."""

    __slots__ = ("num_blocks", "load_s_per_block", "bytes_per_block", "lru", "events", "_removed",
                 "num_stored_blocks", "num_loaded_blocks", "num_removed_blocks")

    def __init__(self, num_blocks: int, load_s_per_block: float, bytes_per_block: int = 0) -> None:
        """`num_blocks` > 0 blocks of host memory; `load_s_per_block` the host-to-device time of one block;
        `bytes_per_block` what one block moves per TP rank (for the byte counters)."""
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.load_s_per_block = load_s_per_block
        self.bytes_per_block = bytes_per_block
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.events: list | None = None
        self._removed: list[int] = []
        self.num_stored_blocks = 0  # cumulative: blocks written GPU -> CPU
        self.num_loaded_blocks = 0  # cumulative: blocks read CPU -> GPU
        self.num_removed_blocks = 0  # cumulative: blocks the host LRU dropped

    def enable_events(self) -> None:
        if self.events is None:
            self.events = []

    def __len__(self) -> int:
        return len(self.lru)

    def __contains__(self, h: int) -> bool:
        return h in self.lru

    @property
    def usage_ratio(self) -> float:
        """Blocks held / capacity, 0-1."""
        return len(self.lru) / self.num_blocks

    def offload(self, hashes: Sequence[int]) -> None:
        """The GPU evicted `hashes` (in eviction order): store each (or touch it), then trim to capacity."""
        if not hashes:
            return
        lru, events = self.lru, self.events
        move = lru.move_to_end
        for h in hashes:
            if h in lru:
                move(h)
                continue
            lru[h] = None
            self.num_stored_blocks += 1
            if events is not None:
                if self._removed:
                    self._flush_removed()
                # vLLM 0.33's placeholder store (events.py `_placeholder_stored`): the hash only
                events.append(BlockStored([h], None, [], 0, None, MEDIUM_CPU, None, None, 0))
        over = len(lru) - self.num_blocks
        if over > 0:
            pop = lru.popitem
            removed = [pop(last=False)[0] for _ in range(over)]
            self.num_removed_blocks += over
            if events is not None:
                self._removed.extend(removed)

    def num_leading(self, hashes: Sequence[int]) -> int:
        """How many of the leading `hashes` are held (a request's loadable prefix); those are touched."""
        lru = self.lru
        n = 0
        for h in hashes:
            if h not in lru:
                break
            lru.move_to_end(h)
            n += 1
        return n

    def load_time_s(self, num_blocks: int) -> float:
        return num_blocks * self.load_s_per_block

    def clear(self) -> None:
        """Drop every block (a prefix-cache reset drops the offloaded copies too); their removal is published."""
        if self.events is not None and self.lru:
            self._removed.extend(self.lru)
        self.num_removed_blocks += len(self.lru)
        self.lru.clear()

    def _flush_removed(self) -> None:
        self.events.append(BlockRemoved(self._removed, MEDIUM_CPU, 0))  # type: ignore[union-attr]
        self._removed = []

    def take_events(self) -> list:
        """The events since the last call, in order (empty when not recording)."""
        if self.events is None:
            return []
        if self._removed:
            self._flush_removed()
        out, self.events = self.events, []
        return out
