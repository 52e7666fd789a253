"""Paged KV cache with vLLM's automatic-prefix-caching semantics (pure logic, no I/O, not thread-safe).

Block hashing (engine side: over token ids, not to be confused with the router's text hashes):

    root = root_hash(extra_keys)                     # xxh3-64 of model/adapter name and cache_salt
    h_0  = hash_block(root, tokens[0:bs])
    h_i  = hash_block(h_{i-1}, tokens[i*bs:(i+1)*bs])
    hash_block(parent, block) = parent * P + mix(sum_j block[j] * R_j)   (mod 2^64)

`hash_block` is the pure chained function; `hash_blocks` computes the whole chain for a prompt at once
with numpy (the recurrence unrolls to ``P^i * cumsum(c_j * P^-j)``, P odd so invertible mod 2^64) and
equals folding `hash_block` (property-tested). Extra keys enter through the root, so they change every
block's hash. Only full blocks are hashed.

Cache invariants (`KVCache`):
- a block is *held* while its ref count > 0 (a running request uses it); held blocks are never evicted;
- a block with ref count 0 is *free*; free blocks sit in an LRU queue (freed blocks at the tail, a
  request's blocks freed tail-first like vLLM so its last blocks are evicted first); allocation takes
  the never-used blocks first, then evicts from the head of the queue, dropping the evicted block's hash;
- `cached` maps a block hash to the one block holding it; a hit on a free cached block takes it out of
  the free queue (ref 0 -> 1).

KV events (`enable_events`, off by default): the cache records, in order, a `BlockRemoved` for the hashes each
eviction drops (consecutive evictions share one event), the `BlockStored` events the engine records for the
blocks it registers (`record_stored`), and `AllBlocksCleared` on a reset. Applied in order to an empty set they
give exactly the keys of `cached` (property-tested): a hash already cached is not stored again (first holder
wins), so it gets no second event, and a hash is removed only when it leaves `cached`.
"""

from __future__ import annotations

import collections
from typing import NewType, Sequence

import numpy as np
import xxhash

from prefixroute.kv_events_wire import MEDIUM_GPU, AllBlocksCleared, BlockRemoved

BlockHash = NewType("BlockHash", int)
"""Engine-side chained hash of one full block of token ids (see module docstring)."""

_MASK = (1 << 64) - 1
_P = 0x100000001B3 * 2 + 1  # odd multiplier: invertible mod 2^64
_P_INV = pow(_P, -1, 1 << 64)
_R = np.random.Generator(np.random.PCG64(20261130)).integers(1, 1 << 63, size=4096, dtype=np.uint64) | np.uint64(1)
_pow_cache: dict[str, np.ndarray] = {}


def root_hash(extra_keys: Sequence[str | None] = ()) -> BlockHash:
    """Parent hash of a prompt's first block: xxh3-64 of the extra keys (model/adapter, cache_salt)."""
    return BlockHash(xxhash.xxh3_64_intdigest("\x1f".join("" if k is None else k for k in extra_keys).encode()))


def _mix(x: np.ndarray) -> np.ndarray:
    # xorshift-multiply finaliser: spreads the linear content sum over all 64 bits (few numpy passes:
    # this runs on the per-request path)
    x = x ^ (x >> np.uint64(29))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    return x ^ (x >> np.uint64(32))


def _content(blocks: np.ndarray) -> np.ndarray:
    """Mixed content hash of each row of a (num_blocks, block_size) uint64 array."""
    with np.errstate(over="ignore"):
        return _mix(blocks @ _R[: blocks.shape[1]])


def hash_block(parent: int, token_ids: Sequence[int]) -> BlockHash:
    """The pure chained block hash: f(parent hash, this block's token ids)."""
    c = int(_content(np.asarray(token_ids, dtype=np.uint64).reshape(1, -1))[0])
    return BlockHash((parent * _P + c) & _MASK)


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    p = _pow_cache.get("p")
    if p is None or len(p) < n + 1:
        size = max(n + 1, 8192)
        p = np.empty(size, np.uint64)
        q = np.empty(size, np.uint64)
        a, b = 1, 1
        for i in range(size):
            p[i], q[i] = a, b
            a = a * _P & _MASK
            b = b * _P_INV & _MASK
        _pow_cache["p"], _pow_cache["q"] = p, q
    return _pow_cache["p"], _pow_cache["q"]


def hash_blocks(token_ids: np.ndarray, block_size: int, root: int) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (a 1-D integer array), vectorised."""
    nb = len(token_ids) // block_size
    if nb == 0:
        return []
    blocks = np.asarray(token_ids[: nb * block_size], dtype=np.uint64).reshape(nb, block_size)
    c = _content(blocks)
    p, q = _powers(nb)
    with np.errstate(over="ignore"):
        # h_i = P^(i+1) root + sum_{j<=i} c_j P^(i-j) = P^i * (P root + cumsum(c_j P^-j))
        acc = np.cumsum(c * q[:nb], dtype=np.uint64) + np.uint64(root * _P & _MASK)
        h = p[:nb] * acc
    return h.tolist()


class KVCache:
    """Block pool + prefix cache of one engine. See the module docstring for invariants.

    Implementation (why it looks unusual): a request takes and releases hundreds of blocks, so per-block
    Python work is avoided. Ref counts live in a numpy array. The LRU queue of free blocks is lazy: each
    `release` appends one *run* (the newly freed blocks, tail-first, stamped with increasing ticks); a
    block taken again (ref > 0) or freed again later (newer tick) leaves a stale entry that eviction skips.
    Eviction walks runs oldest-first, so free blocks are evicted least recently freed first, exactly as an
    ordered queue would. Runs are compacted when stale entries pile up.
    """

    COMPACT_SLACK = 1024  # stale run entries tolerated beyond 2 x num_blocks before compacting

    __slots__ = ("num_blocks", "block_size", "ref", "block_hash", "cached", "next_unused", "num_held",
                 "num_evictions", "_tick", "_free_tick", "_runs", "_run_entries", "_empty", "events", "_removed",
                 "evicted")

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}
        self.next_unused = 0  # blocks [next_unused, num_blocks) were never used: free and empty
        self.num_held = 0
        self.num_evictions = 0
        self._tick = 0
        self._free_tick = np.zeros(num_blocks, dtype=np.int64)
        self._runs: collections.deque[list] = collections.deque()  # [block ids, ticks, next position]
        self._run_entries = 0
        self._empty: list[int] = []  # free blocks holding no hash: reused first (they hold nothing)
        self.events: list | None = None  # KV events recorded since the last take_events (None: not recording)
        self._removed: list[int] | None = None  # evicted hashes not yet in an event (batched into one)
        self.evicted: list[int] | None = None  # evicted hashes for a lower tier to take (None: no lower tier)

    # -- KV events ----------------------------------------------------------------------------------
    def enable_events(self) -> None:
        """Record KV events from now on (see the module docstring); `take_events` hands them over."""
        if self.events is None:
            self.events = []
            self._removed = []

    def has_events(self) -> bool:
        return bool(self.events or self._removed)

    def record_stored(self, event: object) -> None:
        """Append a `BlockStored` (built by the engine, which knows the request's tokens and extra keys), after
        the removals that happened before it."""
        if self._removed:
            self._flush_removed()
        self.events.append(event)  # type: ignore[union-attr]

    def _flush_removed(self) -> None:
        self.events.append(BlockRemoved(self._removed, MEDIUM_GPU))  # type: ignore[union-attr]
        self._removed = []

    def take_events(self) -> list:
        """The events recorded since the last call, in order (empty when not recording)."""
        if self.events is None:
            return []
        if self._removed:
            self._flush_removed()
        out, self.events = self.events, []
        return out

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash, like vLLM's ``BlockPool.reset_prefix_cache``: only when no block is held
        (returns False and changes nothing otherwise); records `AllBlocksCleared` (published with the engine's
        next step: engine.py)."""
        if self.num_held:
            return False
        self.cached = {}
        self.block_hash = [None] * self.num_blocks
        self.next_unused = 0  # every block is free and empty again
        self._empty = []
        self._runs.clear()
        self._run_entries = 0
        if self.events is not None:
            if self._removed:
                self._flush_removed()
            self.events.append(AllBlocksCleared())
        return True

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.num_held

    @property
    def usage_ratio(self) -> float:
        """Held blocks / all blocks (vLLM's kv_cache_usage_perc), 0-1."""
        return self.num_held / self.num_blocks

    def _chain(self, hashes: Sequence[int]) -> list:
        got = list(map(self.cached.get, hashes))  # C-level lookups; cut at the first miss
        try:
            return got[: got.index(None)]
        except ValueError:
            return got

    def num_cached_prefix_blocks(self, hashes: Sequence[int]) -> int:
        """Length of the longest chain of leading hashes present in the cache (no side effects)."""
        return len(self._chain(hashes))

    def take_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Hold the blocks of the longest cached leading chain of `hashes`; returns their block ids."""
        ids = self._chain(hashes)
        if not ids:
            return []
        arr = np.array(ids, dtype=np.int64)
        r = self.ref[arr]
        self.num_held += int(np.count_nonzero(r == 0))  # their free-queue entries become stale
        self.ref[arr] = r + 1  # a chain never repeats a block
        return ids

    def _evict(self, n: int) -> list[int]:
        """Take `n` free blocks from the LRU runs (caller checked they exist), dropping their hashes."""
        out: list[int] = []
        runs, ref, ftick = self._runs, self.ref, self._free_tick
        block_hash, cached = self.block_hash, self.cached
        removed, evicted = self._removed, self.evicted
        while len(out) < n:
            run = runs[0]
            ids, ticks, pos = run
            want = n - len(out)
            # scan a bounded window: a compacted run can hold ~all blocks, and most entries are valid
            end = min(len(ids), pos + max(64, 2 * want))
            seg = ids[pos:end]
            valid = np.flatnonzero((ref[seg] == 0) & (ftick[seg] == ticks[pos:end]))
            if len(valid) > want:
                take = valid[:want]
                run[2] = pos + int(take[-1]) + 1
            else:
                take = valid
                run[2] = end
                if end == len(ids):
                    runs.popleft()
                    self._run_entries -= len(ids)
            for b in seg[take].tolist():
                h = block_hash[b]
                if h is not None:
                    if cached.get(h) == b:
                        del cached[h]
                        if removed is not None:
                            removed.append(h)
                        if evicted is not None:
                            evicted.append(h)
                    block_hash[b] = None
                    self.num_evictions += 1
                out.append(b)
        return out

    def allocate(self, n: int) -> list[int] | None:
        """Hold `n` empty blocks (empty/never-used first, then LRU eviction); None (no change) if too few free."""
        if n > self.num_blocks - self.num_held:
            return None
        out: list[int] = []
        empty = self._empty
        while empty and len(out) < n:
            b = empty.pop()
            if self.ref[b] == 0 and self.block_hash[b] is None:
                out.append(b)
        k = n - len(out)
        if k:
            take = min(k, self.num_blocks - self.next_unused)
            out.extend(range(self.next_unused, self.next_unused + take))
            self.next_unused += take
            if k > take:
                out.extend(self._evict(k - take))
        if n == 1:
            self.ref[out[0]] = 1
        else:
            self.ref[out] = 1
        self.num_held += n
        return out

    def register_many(self, blocks: Sequence[int], hashes: Sequence[int]) -> int:
        """`register` for pairs of (block, hash); the loop stays in one frame (per-request path). Returns how
        many were stored (the others were cached already)."""
        cached, block_hash = self.cached, self.block_hash
        n = len(cached)
        for b, h in zip(blocks, hashes):
            if h not in cached:
                cached[h] = b
                block_hash[b] = h
        return len(cached) - n

    def register(self, block: int, h: int) -> None:
        """Record that held `block` holds full block hash `h` (first holder wins, like vLLM)."""
        if h not in self.cached:
            self.cached[h] = block
            self.block_hash[block] = h

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block (pass a request's blocks; freed tail-first)."""
        if not blocks:
            return
        arr = np.array(blocks[::-1], dtype=np.int64)
        r = self.ref[arr] - 1
        self.ref[arr] = r
        zero = arr[r == 0]
        nz = len(zero)
        if not nz:
            return
        self.num_held -= nz
        block_hash = self.block_hash
        if block_hash[int(zero[0])] is None:
            # a request's unhashed blocks (generated tokens, partial prompt block) come first (tail-first
            # order); an unhashed block further in (a duplicate of a block cached elsewhere) just joins the
            # LRU run, which is harmless
            empty = self._empty
            k = 0
            for b in zero.tolist():
                if block_hash[b] is not None:
                    break
                empty.append(b)
                k += 1
            if k == nz:
                return
            zero = zero[k:]
            nz -= k
        ticks = np.arange(self._tick, self._tick + nz, dtype=np.int64)
        self._tick += nz
        self._free_tick[zero] = ticks
        self._runs.append([zero, ticks, 0])
        self._run_entries += nz
        if self._run_entries > 2 * self.num_blocks + self.COMPACT_SLACK:
            self._compact()

    def _compact(self) -> None:
        """Drop stale run entries (keeps the LRU order); amortised O(1) per released block."""
        ids = np.concatenate([r[0][r[2]:] for r in self._runs])
        ticks = np.concatenate([r[1][r[2]:] for r in self._runs])
        keep = (self.ref[ids] == 0) & (self._free_tick[ids] == ticks)
        self._runs.clear()
        ids, ticks = ids[keep], ticks[keep]
        self._runs.append([ids, ticks, 0])
        self._run_entries = len(ids)
