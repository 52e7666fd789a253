"""The precise prefix index: which token blocks each endpoint really holds, built from its KV events.

vLLM publishes every block its prefix cache stores and evicts (`prefixroute.kv_events_wire`). The index keys those
blocks by the router's *own* chained hash of their token ids (`hashing.hash_token_blocks`, seeded by
`token_seed_for(lora_name, cache_salt)`), so a request tokenized and hashed by the router looks its blocks up
directly; vLLM's own hashes are seeded from ``os.urandom`` and published truncated, so they are only used to
follow the events (a per-endpoint map server hash -> router hash, which `BlockRemoved` needs).

Keying a `BlockStored` event (blocks ``b_0..b_{n-1}``, ``block_size`` tokens each, in chain order):
- ``parent_block_hash`` None: ``b_0`` starts a prompt; the chain starts at ``token_seed_for(lora, salt)``.
  ``lora`` is the event's ``lora_name`` (an event with only a ``lora_id``, from releases before ``lora_name``,
  gets a name no request uses, so it never matches the base model). ``salt`` comes from ``extra_keys[0]``:
  vLLM orders a block's extra keys as (multimodal keys..., lora name, cache_salt) and adds the salt to a
  prompt's first block only, so the salt is the last element when it is a string and something follows the
  lora name (or, without a lora name, when the tuple ends in a string).
- ``parent_block_hash`` set: the chain continues from the router hash the index recorded for that server hash
  on this endpoint. A parent the index does not know (evicted before we saw it, events lost, subscribed
  mid-stream) makes the blocks unkeyable: they are dropped and counted (``num_orphan_blocks``).
- Extra keys beyond (lora name, salt) (multimodal inputs, prompt embeddings) are folded into that block's router
  hash (``xxh3_64(msgpack(extras), seed=h)``), so such blocks and every block chained after them never match
  a text-only request, whose hash has no extras.

Invariants (tested in tests/unit/kv_events/test_kv_events_index.py against a brute-force model):
- For each endpoint, ``_s2r`` holds exactly the server hashes stored (and keyed) and not yet removed, with
  their reference counts in ``_refs`` when above 1; ``_held[r]`` is the number of those server hashes whose
  router hash is r (two server hashes may share a router hash: the simulated servers seed with the model name,
  the router does not), and r is held iff ``_held[r] > 0``.
- Duplicates are reference-counted: vLLM v1's block pool maps one hash to several physical blocks when two
  requests compute the same block concurrently (``cached_block_hash_to_block[hash]`` is a dict by block id), it
  emits `BlockStored` for each and `BlockRemoved` each time one of them is evicted. A hash stored k times is
  held until removed k times. A removal of a hash the index does not hold is ignored (counted).
- ``_heads[r]`` is the set of endpoints holding r as the first block of a prompt (parent None). A token chain
  starts from a seed, so a router hash is a first block in every prompt or in none: `match` needs the
  cross-endpoint lookup only for the request's first block.
- `match` is *not* prefix-closed: a server may still hold a block whose parent was evicted (vLLM frees a
  sequence's blocks tail first, yet a later request can re-store a parent's child), so it counts consecutive
  leading blocks one by one (C-level ``takewhile``, stops at the first miss), never by binary search.
- Only blocks on the GPU (medium None or "GPU"; `kv_events.GPU_MEDIA`), in KV-cache group 0 (or None), with
  content (not a placeholder: vLLM 0.33's offloading connector stores hashes without tokens) and of the
  configured ``block_size`` (the router's ``kv_block_tokens``) are indexed; others are skipped and counted
  (in that order of tests: a CPU placeholder is a skipped block, not a block-size mismatch), never mixed in.
- The salt of a prompt's first block: SGLang's ``cache_salt`` field when present, else vLLM's extra keys (above).

Server blocks k times the router's (vLLM 0.34 defaults to 64-token blocks, the router to 16): every event is
first rewritten in the router's block size (`split_events`, pure): a server block ``s`` of ``k x block_size``
tokens becomes k sub-blocks whose server hashes are ``sub_block_hashes(s, k)`` then ``s`` itself (so a
child's ``parent_block_hash`` names its parent's *last* sub-block, the one its chain continues from), its extra
keys on the first sub-block; a `BlockRemoved` of ``s`` removes all k. The endpoint's k is learned from its GPU
stores with tokens (a removal or placeholder carries no size) and is 1 until then. A server then holds whole
server blocks only, so a request sharing L tokens with a stored prompt is credited up to ``(k - 1) x block_size``
tokens more than the server will hit (48 of thousands, for vLLM 0.34's default): the price of matching at
the router's granularity, which is what lets one router hash requests once for a fleet of mixed block sizes. A
server block size that is neither a multiple of the router's nor a divisor of it stays a ``block_size_mismatch``.

Server pages a divisor of the router's block (SGLang's default page of 1 token): every event is first rewritten by
the endpoint's `merge.PageMerger`, which keeps each page's chain state so a branch may start at any page, and hands
on the router blocks the server holds whole (its module docstring). `num_blocks` then counts pages.

Mismatch detectors (cheap, read by the KV-events link to stop trusting an endpoint's events):
- `block_size_mismatch`: the latest GPU store's block size, when it is not a multiple of the router's (the
  router hashes ``kv_block_tokens``-token blocks: none of that publisher's blocks can ever match).
- `tokens_unverified`: the router tokenizes and hashes requests itself; if the server tokenizes differently
  (another tokenizer, chat template or BOS handling), no stored block ever equals a request's block. Every
  request routed to an endpoint (`note_routed`, one dict lookup) *verifies* the endpoint when its first block is
  held there (it was stored before) or becomes held there later (the server stored it: `_store` looks the head
  up among the endpoint's recently routed first blocks). An endpoint that stored blocks yet none of the last
  ``min_requests`` requests routed there (over at least ``min_age_s``) verified it is reported. Verification
  restarts with the endpoint's entries (`clear_endpoint`).

For a tier-aware index built on the same events: `router_hash_of` gives the router hash of a server
hash this endpoint holds on the GPU (a CPU/STORAGE event's ``parent_block_hash`` names its GPU ancestor), and the
subscriber passes every decoded batch, all media and placeholders included, to its ``on_batch`` hook.

Not thread-safe: use from one thread (the router's event loop), except `num_blocks_by_endpoint` and
`counters_by_endpoint`, readable from the metrics thread like `PrefixIndex.num_entries_by_endpoint`.
Memory: per held block one entry in each of two dicts (~200 bytes), i.e. ~100 MB for 500k blocks; a merged
endpoint also ~90-100 bytes per cached page (`merge`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from array import array
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice, takewhile
from typing import Any

import msgspec
import xxhash

from prefixroute.extproc.kv_events.merge import PageMerger
from prefixroute.extproc.routing.prefix_index import drop_holder
from prefixroute.extproc.routing.hashing import hash_token_blocks, token_bytes, token_seed_for
from prefixroute.types import BlockHash, EndpointId
from prefixroute.kv_events_wire import (GPU_MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch,
                                   KVEventsDecodeError, block_hash_int)

_xxh3 = xxhash.xxh3_64_intdigest
_MASK64 = (1 << 64) - 1
_GPU_MEDIA = GPU_MEDIA
_PENDING_FIRSTS = 256  # first blocks of requests routed to an unverified endpoint, kept to verify it by its stores
_extras_encoder = msgspec.msgpack.Encoder()


@dataclasses.dataclass
class IndexCounters:
    """Per-endpoint counts of what the index did with the endpoint's events (cumulative; cleared never), in the
    index's blocks: a server block split into k sub-blocks (module docstring) counts k."""

    num_stored_blocks: int = 0  # blocks keyed and held (duplicates included)
    num_removed_blocks: int = 0  # removals applied
    num_orphan_blocks: int = 0  # stored blocks dropped: their parent is unknown here
    num_unknown_removed_blocks: int = 0  # removals of hashes not held (orphans, before subscribing, lost)
    num_block_size_mismatch_blocks: int = 0  # stored blocks of another block size than configured
    num_skipped_blocks: int = 0  # stored blocks on another medium (CPU offload) or KV-cache group
    num_placeholder_blocks: int = 0  # GPU stores without content (no token ids / block size 0)
    num_malformed_events: int = 0  # token ids not len(block_hashes) x block_size, bad hashes
    num_all_cleared: int = 0  # AllBlocksCleared events applied
    num_clears: int = 0  # clear_endpoint calls (AllBlocksCleared included)


class _Endpoint:
    __slots__ = ("s2r", "refs", "held", "heads", "block_size_seen", "split", "merger", "counters", "verified",
                 "pending", "num_routed_unverified", "first_routed_s")

    def __init__(self) -> None:
        self.s2r: dict[int, BlockHash] = {}  # server hash -> router hash
        self.refs: dict[int, int] = {}  # server hash -> reference count, only when > 1
        self.held: dict[BlockHash, int] = {}  # router hash -> number of server hashes mapped to it
        self.heads: set[BlockHash] = set()  # held router hashes that start a prompt (mirror of _heads)
        self.block_size_seen: int | None = None  # the server's, before `split_events`
        self.split = 1  # router blocks per server block (module docstring: server blocks k times the router's)
        self.merger: PageMerger | None = None  # server pages smaller than the router's block (module docstring)
        self.counters = IndexCounters()
        self.verified = False  # a request's block was found stored here (module docstring: tokens_unverified)
        self.pending: dict[BlockHash, None] = {}  # first blocks of requests routed here while unverified
        self.num_routed_unverified = 0
        self.first_routed_s: float | None = None


def _split_extra_keys(keys: Any, lora_name: str | None, first_of_prompt: bool) -> tuple[str | None, list]:
    """(cache_salt, extras to fold) of one block's extra keys (module docstring: vLLM's order)."""
    if not keys:
        return None, []
    keys = list(keys) if isinstance(keys, (list, tuple)) else [keys]
    after_lora = 0
    if lora_name is not None and lora_name in keys:
        after_lora = len(keys) - keys[::-1].index(lora_name)  # just past the last occurrence
    salt = None
    if first_of_prompt and len(keys) > after_lora and isinstance(keys[-1], str):
        salt = keys.pop()
    extras = [k for k in keys if not (lora_name is not None and k == lora_name)]
    return salt, extras


def _fold(h: int, extras: list) -> BlockHash:
    try:
        data = _extras_encoder.encode(extras)
    except (TypeError, msgspec.EncodeError):
        data = repr(extras).encode("utf-8", "surrogatepass")
    return BlockHash(_xxh3(data, h))


class KVEventIndex:
    """Per-endpoint blocks keyed by the router's token-block hashes, fed by `apply_batch` (module docstring)."""

    __slots__ = ("block_size", "_eps", "_heads")

    def __init__(self, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self._eps: dict[EndpointId, _Endpoint] = {}
        self._heads: dict[BlockHash, set[EndpointId]] = {}

    # --- queries -------------------------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[EndpointId, int]:
        """Endpoints holding the first block -> number of consecutive leading blocks they hold (same contract
        as `PrefixIndex.match`; empty dict = held nowhere). Cost O(holders of the first block x matched
        blocks), each block one C-level dict lookup."""
        if not block_hashes:
            return {}
        first = self._heads.get(block_hashes[0])
        if not first:
            return {}
        eps = self._eps
        n = len(block_hashes)
        out = {}
        for ep in first:
            has = eps[ep].held.__contains__
            # The whole prompt held (the affinity case) is one C-level pass that stops at a miss; otherwise
            # count up to the first miss.
            out[ep] = n if has(block_hashes[-1]) and all(map(has, block_hashes)) else len(
                list(takewhile(has, block_hashes)))
        return out

    def holds(self, endpoint: EndpointId, block_hash: BlockHash) -> bool:
        """Whether `endpoint` holds the block with router hash `block_hash`."""
        st = self._eps.get(endpoint)
        return st is not None and block_hash in st.held

    def num_blocks(self, endpoint: EndpointId) -> int:
        """Distinct server block hashes `endpoint` is known to hold (what its prefix cache reports, less the
        blocks the index could not key)."""
        st = self._eps.get(endpoint)
        return _num_server_blocks(st) if st else 0

    def num_blocks_by_endpoint(self) -> dict[EndpointId, int]:
        """`num_blocks` per endpoint that holds any. Safe from another thread (single C calls under the GIL)."""
        return {ep: n for ep, st in list(self._eps.items()) if (n := _num_server_blocks(st))}

    def counters(self, endpoint: EndpointId) -> IndexCounters:
        """A copy of `endpoint`'s counters (zeros for an endpoint never seen)."""
        st = self._eps.get(endpoint)
        return dataclasses.replace(st.counters) if st else IndexCounters()

    def counters_by_endpoint(self) -> dict[EndpointId, IndexCounters]:
        """Copies of every known endpoint's counters. Safe from another thread (a reading may be mid-update)."""
        return {ep: dataclasses.replace(st.counters) for ep, st in list(self._eps.items())}

    def num_all_cleared(self, endpoint: EndpointId) -> int:
        """AllBlocksCleared events applied to `endpoint` so far."""
        st = self._eps.get(endpoint)
        return st.counters.num_all_cleared if st else 0

    def block_size_seen(self, endpoint: EndpointId) -> int | None:
        """The block size of `endpoint`'s latest GPU `BlockStored` event with tokens, as the server published it
        (None before any)."""
        st = self._eps.get(endpoint)
        return st.block_size_seen if st else None

    def endpoints(self) -> list[EndpointId]:
        return list(self._eps)

    def server_hashes(self, endpoint: EndpointId) -> set[int]:
        """The server block hashes (`block_hash_int`) `endpoint` holds on the GPU, as far as its events said
        (a copy; O(blocks))."""
        st = self._eps.get(endpoint)
        if st is None:
            return set()
        merger = st.merger
        if merger is not None:
            return set(merger.where)
        held = set(st.s2r)
        if st.split > 1:  # less the sub-blocks `split_events` named
            held.difference_update(h for s in list(held) for h in sub_block_hashes(s, st.split))
        return held

    def router_hash_of(self, endpoint: EndpointId, server_hash: Any) -> BlockHash | None:
        """The router hash of a server block hash `endpoint` holds on the GPU (int or bytes, as published);
        None when it does not hold it."""
        st = self._eps.get(endpoint)
        if st is None:
            return None
        try:
            return st.s2r.get(block_hash_int(server_hash))
        except KVEventsDecodeError:
            return None

    # --- eviction order (placement, routing/scheduling/placement.py) ---------------------------------------------------
    def touch(self, endpoint: EndpointId, block_hashes: Sequence[BlockHash]) -> None:
        """A request with `block_hashes` was routed to `endpoint`: the blocks it holds of them become its most
        recently used, the first block last (vLLM frees a request's blocks tail first). KV events carry no
        hits, so the router's picks are what keeps this mirror of the server's LRU in order. O(len)."""
        st = self._eps.get(endpoint)
        if st is None or not st.held:
            return
        held = st.held
        pop = held.pop
        for r in reversed(block_hashes):
            k = pop(r, None)
            if k is not None:
                held[r] = k

    def lru_oldest(self, endpoint: EndpointId, num_blocks: int) -> list[BlockHash]:
        """The `num_blocks` router hashes `endpoint` holds that it would evict first (least recently stored or
        touched first), as far as events and picks tell: the victims of a request that needs that many more
        blocks of a full cache. O(num_blocks)."""
        st = self._eps.get(endpoint)
        if st is None or num_blocks <= 0:
            return []
        return list(islice(st.held, num_blocks))

    def num_held_blocks(self, endpoint: EndpointId) -> int:
        """Distinct router hashes `endpoint` holds on the GPU."""
        st = self._eps.get(endpoint)
        return len(st.held) if st else 0

    # --- mismatch detectors (module docstring) -------------------------------------------------------------
    def block_size_mismatch(self, endpoint: EndpointId) -> int | None:
        """The block size of `endpoint`'s latest GPU store when it is neither a multiple of `block_size` up to
        `MAX_SPLIT` times it (split) nor a divisor of it (merged: module docstring), else None."""
        st = self._eps.get(endpoint)
        seen = None if st is None else st.block_size_seen
        bs = self.block_size
        if seen is None or (seen % bs == 0 and seen // bs <= MAX_SPLIT) or bs % seen == 0:
            return None
        return seen

    def split_of(self, endpoint: EndpointId) -> int:
        """Router blocks per server block at `endpoint` (1 until a GPU store of a multiple size is seen; 1 for a
        server whose pages are merged)."""
        st = self._eps.get(endpoint)
        return st.split if st else 1

    def note_routed(self, endpoint: EndpointId, first_block: BlockHash, now_s: float | None = None) -> None:
        """A request whose first token block hashes to `first_block` was routed to `endpoint` (call once per
        routed request; O(1), returns at once for a verified endpoint). `now_s`: time.monotonic() (read here
        when None, once per unverified period)."""
        st = self._eps.get(endpoint)
        if st is None or st.verified:
            return
        if first_block in st.held:
            st.verified = True
            st.pending = {}
            return
        pending = st.pending
        pending[first_block] = None
        if len(pending) > _PENDING_FIRSTS:
            del pending[next(iter(pending))]
        st.num_routed_unverified += 1
        if st.first_routed_s is None:
            st.first_routed_s = time.monotonic() if now_s is None else now_s

    def tokens_unverified(self, endpoint: EndpointId, now_s: float, *, min_requests: int = 16,
                          min_age_s: float = 10.0) -> int:
        """How many requests were routed to `endpoint` without any of them finding its blocks stored there,
        when the endpoint holds blocks, at least `min_requests` were routed and the first at least `min_age_s`
        ago (time for the server to compute and publish them); else 0."""
        st = self._eps.get(endpoint)
        if st is None or st.verified or not st.s2r or st.num_routed_unverified < min_requests:
            return 0
        if st.first_routed_s is None or now_s - st.first_routed_s < min_age_s:
            return 0
        return st.num_routed_unverified

    def is_verified(self, endpoint: EndpointId) -> bool:
        st = self._eps.get(endpoint)
        return st is not None and st.verified

    # --- updates -------------------------------------------------------------------------------------------
    def apply_batch(self, endpoint: EndpointId, batch: EventBatch) -> None:
        """Apply every event of `batch` to `endpoint`, in order."""
        for _ in self.apply_events(endpoint, batch.events):
            pass

    def apply_events(self, endpoint: EndpointId, events: Iterable[Any],
                     chunk_blocks: int = 256) -> Iterator[int]:
        """Apply `events` in order, yielding the number of blocks applied since the last yield, at most
        `chunk_blocks` each time (an AllBlocksCleared counts as the blocks it drops), so a caller on the event
        loop can let other work run in between. A `BlockStored` or `BlockRemoved` of more blocks is applied in
        pieces (exactly equivalent: each stored piece's parent is the last block of the piece before). Server
        blocks a multiple of `block_size` are split first (`split_events`), pages a divisor of it merged
        (`merge.PageMerger`)."""
        st = self._endpoint(endpoint)
        events = self._split(st, events)
        if st.merger is not None:
            return self._apply_merged(endpoint, st, events, chunk_blocks)
        return self._apply(endpoint, st, events, chunk_blocks)

    def _apply_merged(self, endpoint: EndpointId, st: _Endpoint, events: list[Any],
                      chunk_blocks: int) -> Iterator[int]:
        """`_apply` for an endpoint whose pages are merged: merged and applied a group at a time (a page store of
        more than ``chunk_blocks`` router blocks cut into pieces, each its own group), so a long prompt's
        thousands of pages never hold the caller's event loop for the whole merge. Exactly equivalent: the merge
        depends on the events' order only, and a piece's parent is the page before it."""
        merger = st.merger
        assert merger is not None
        group: list[Any] = []
        max_pages = chunk_blocks * merger.m
        for ev in events:
            if type(ev) is BlockStored and len(ev.block_hashes) > max_pages \
                    and len(ev.token_ids) == len(ev.block_hashes) * ev.block_size:
                if group:
                    yield from self._apply(endpoint, st, merger.merge(group, st.counters), chunk_blocks)
                    group = []
                for piece in _pieces(ev, max_pages, ev.block_size):
                    yield from self._apply(endpoint, st, merger.merge([piece], st.counters), chunk_blocks)
            else:
                group.append(ev)
        if group:
            yield from self._apply(endpoint, st, merger.merge(group, st.counters), chunk_blocks)

    def _split(self, st: _Endpoint, events: Iterable[Any]) -> list[Any]:
        """`events` in this index's block size (`split_events`), learning the endpoint's server block size from
        its GPU stores with tokens first; for pages smaller than a router block, `events` as they are, the
        endpoint's `merge.PageMerger` set (`_apply_merged` merges them)."""
        events = events if isinstance(events, list) else list(events)
        bs = self.block_size
        for ev in events:
            if type(ev) is BlockStored and ev.medium in _GPU_MEDIA and ev.group_idx in (None, 0) \
                    and ev.block_size > 0 and len(ev.token_ids):
                st.block_size_seen = ev.block_size
                if ev.block_size % bs == 0 and ev.block_size // bs <= MAX_SPLIT:
                    st.split = ev.block_size // bs
        seen = st.block_size_seen
        if seen is not None and seen < bs and bs % seen == 0:
            if st.merger is None or st.merger.page_size != seen:
                st.merger = PageMerger(bs, seen)  # a new page size: a restarted server, whose cache is empty
            return events  # merged as they are applied (`_apply_merged`)
        st.merger = None
        return events if st.split == 1 and seen in (None, bs) else split_events(events, bs, st.split)

    def _apply(self, endpoint: EndpointId, st: _Endpoint, events: list[Any], chunk_blocks: int) -> Iterator[int]:
        pending = 0
        for ev in events:
            t = type(ev)
            if t is BlockStored:
                n = len(ev.block_hashes)
                if n > chunk_blocks and n * self.block_size == len(ev.token_ids):
                    units = [(self._store, p, len(p.block_hashes)) for p in _pieces(ev, chunk_blocks, self.block_size)]
                else:
                    units = [(self._store, ev, n)]
            elif t is BlockRemoved:
                hashes = ev.block_hashes
                if ev.medium not in _GPU_MEDIA or ev.group_idx not in (None, 0):
                    continue
                units = [(self._remove, hashes[i:i + chunk_blocks], min(chunk_blocks, len(hashes) - i))
                         for i in range(0, len(hashes), chunk_blocks)]
            elif t is AllBlocksCleared:
                st.counters.num_all_cleared += 1
                units = [(None, None, min(chunk_blocks, len(st.s2r)))]
            else:
                st.counters.num_malformed_events += 1
                continue
            for fn, arg, cost in units:
                if pending and pending + cost > chunk_blocks:
                    yield pending
                    pending = 0
                if fn is None:
                    self.clear_endpoint(endpoint)
                else:
                    fn(endpoint, st, arg)
                pending += cost
        if pending:
            yield pending

    def clear_endpoint(self, endpoint: EndpointId) -> None:
        """Forget every block `endpoint` holds (its cache was emptied, or the index can no longer be trusted
        for it: lost events, a publisher restart). Keeps its counters."""
        st = self._eps.get(endpoint)
        if st is None:
            return
        st.counters.num_clears += 1
        if st.merger is not None:
            st.merger.clear()
        self._drop_heads(endpoint, st.heads)
        # Fresh dicts rather than .clear(): a reader on another thread iterating the old ones stays valid.
        st.s2r, st.refs, st.held, st.heads = {}, {}, {}, set()
        st.verified, st.pending, st.num_routed_unverified, st.first_routed_s = False, {}, 0, None

    def remove_endpoint(self, endpoint: EndpointId) -> None:
        """Forget `endpoint` entirely (it left the pool): its blocks and its counters."""
        st = self._eps.pop(endpoint, None)
        if st is not None:
            self._drop_heads(endpoint, st.heads)

    # --- internals -----------------------------------------------------------------------------------------
    def _endpoint(self, endpoint: EndpointId) -> _Endpoint:
        st = self._eps.get(endpoint)
        if st is None:
            st = self._eps[endpoint] = _Endpoint()
        return st

    def _drop_heads(self, endpoint: EndpointId, heads: Iterable[BlockHash]) -> None:
        drop_holder(self._heads, endpoint, heads)

    def _store(self, endpoint: EndpointId, st: _Endpoint, ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        if n == 0 or not self._storable(st, ev, n):
            return
        c = st.counters
        try:
            server = _server_hashes(ev.block_hashes)
            parent = None if ev.parent_block_hash is None else block_hash_int(ev.parent_block_hash)
        except KVEventsDecodeError:
            c.num_malformed_events += 1
            return
        routed = self._routed_hashes(st, ev, n, parent)
        if routed is None:
            return
        s2r, held, refs = st.s2r, st.held, st.refs
        # Tail first: ``held``'s order is the endpoint's eviction order (`lru_oldest`), and vLLM frees a
        # request's blocks tail first, so a chain's last block is the first of it to go.
        for s, r in zip(reversed(server), reversed(routed)):
            if s in s2r:  # a duplicate block (module docstring): one more reference, the first key stays
                refs[s] = refs.get(s, 1) + 1
            else:
                s2r[s] = r
                held[r] = held.get(r, 0) + 1
        c.num_stored_blocks += n
        if parent is None:
            r0 = routed[0]
            if not st.verified and r0 in st.pending:  # a request routed here had this first block
                st.verified = True
                st.pending = {}
            if r0 in held:
                st.heads.add(r0)
                holders = self._heads.get(r0)
                if holders is None:
                    self._heads[r0] = {endpoint}
                else:
                    holders.add(endpoint)

    def _storable(self, st: _Endpoint, ev: BlockStored, n: int) -> bool:
        """Whether the `n` blocks of `ev` are GPU blocks of this index's block size with their tokens; the ones
        that are not are counted by why."""
        c = st.counters
        if ev.medium not in _GPU_MEDIA or ev.group_idx not in (None, 0):
            c.num_skipped_blocks += n
            return False
        if ev.block_size <= 0 or len(ev.token_ids) == 0:  # (token ids may be a numpy array in-process)
            c.num_placeholder_blocks += n
            return False
        if ev.block_size != self.block_size:
            c.num_block_size_mismatch_blocks += n
            return False
        if len(ev.token_ids) != n * ev.block_size:
            c.num_malformed_events += 1
            return False
        return True

    def _routed_hashes(self, st: _Endpoint, ev: BlockStored, n: int, parent: int | None) -> list[BlockHash] | None:
        """The router's token-block hashes of the `n` stored blocks: chained from the parent's routed hash, or
        from the seed of the event's adapter and salt for a first block, extra keys (multimodal) folded in.
        None (counted) when the parent is unknown or a token id is out of range."""
        c = st.counters
        lora = ev.lora_name
        if lora is None and ev.lora_id is not None:
            lora = f"\x00lora_id={ev.lora_id}"  # a name no request carries: never the base model's blocks
        extra = ev.extra_keys
        salt = None
        folds: dict[int, list] = {}
        if extra:
            for i, keys in enumerate(extra[:n]):
                if keys:
                    s, rest = _split_extra_keys(keys, ev.lora_name, parent is None and i == 0)
                    if i == 0 and parent is None:
                        salt = s
                    if rest:
                        folds[i] = rest
        if parent is None:
            if ev.cache_salt is not None:  # SGLang names the salt (vLLM puts it in extra_keys)
                salt = ev.cache_salt
            seed = token_seed_for(lora, salt)
        else:
            seed = st.s2r.get(parent)
            if seed is None:
                c.num_orphan_blocks += n
                return None
        try:
            data = _token_bytes(ev.token_ids)
        except (OverflowError, ValueError, TypeError):  # a token id outside uint32
            c.num_malformed_events += 1
            return None
        if not folds:
            return hash_token_blocks(data, ev.block_size, seed)
        routed = []  # rare (multimodal): block by block, folding where a block has extras
        h = seed
        step = 4 * ev.block_size
        for i in range(n):
            h = _xxh3(data[i * step:(i + 1) * step], h)
            if i in folds:
                h = _fold(h, folds[i])
            routed.append(BlockHash(h))
        return routed

    def _remove(self, endpoint: EndpointId, st: _Endpoint, hashes: Sequence[Any]) -> None:
        c = st.counters
        try:
            server = _server_hashes(hashes)
        except KVEventsDecodeError:
            c.num_malformed_events += 1
            return
        s2r, held, refs, heads = st.s2r, st.held, st.refs, st.heads
        pop = s2r.pop
        unknown = 0
        for s in server:
            r = pop(s, None)
            if r is None:
                unknown += 1
                continue
            if refs:  # duplicates are rare: one truthiness test on the common path
                k = refs.get(s)
                if k is not None:
                    s2r[s] = r  # still held by another copy
                    if k > 2:
                        refs[s] = k - 1
                    else:
                        del refs[s]
                    continue
            k = held[r]
            if k > 1:
                held[r] = k - 1
                continue
            del held[r]
            if r in heads:
                heads.discard(r)
                holders = self._heads.get(r)
                if holders is not None:
                    holders.discard(endpoint)
                    if not holders:
                        del self._heads[r]
        c.num_unknown_removed_blocks += unknown
        c.num_removed_blocks += len(server) - unknown


def _num_server_blocks(st: _Endpoint) -> int:
    """The server blocks `st` holds, in the server's own units (pages when merged; sub-blocks counted once)."""
    merger = st.merger
    return merger.num_pages if merger is not None else len(st.s2r) // st.split


def _server_hashes(hashes: Sequence[Any]) -> Sequence[int]:
    """`hashes` as non-negative ints (`block_hash_int`); the common case, unsigned msgpack ints, as they are
    (C-level checks, no per-hash Python call)."""
    if hashes and type(hashes[0]) is int:  # noqa: E721
        try:
            if min(hashes) >= 0 and max(hashes) <= _MASK64:
                return hashes
        except TypeError:  # a mix of ints and bytes
            pass
    return list(map(block_hash_int, hashes))


if sys.byteorder == "little":
    def _token_bytes(token_ids: list[int]) -> bytes:
        """`hashing.token_bytes` (little-endian uint32), from a list ~5x faster than through numpy."""
        try:
            return array("I", token_ids).tobytes()
        except OverflowError:  # an id outside uint32: raises the same error as `hashing.token_bytes`
            return token_bytes(token_ids)
else:  # pragma: no cover - big-endian hosts
    _token_bytes = token_bytes


def _pieces(ev: BlockStored, size: int, block_size: int) -> Iterator[BlockStored]:
    """`ev` as consecutive `BlockStored` events of at most `size` blocks, each chained to the one before."""
    n = len(ev.block_hashes)
    parent = ev.parent_block_hash
    for i in range(0, n, size):
        hashes = ev.block_hashes[i:i + size]
        extra = ev.extra_keys[i:i + size] if ev.extra_keys else ev.extra_keys
        yield BlockStored(block_hashes=hashes, parent_block_hash=parent,
                          token_ids=ev.token_ids[i * block_size:(i + size) * block_size], block_size=ev.block_size,
                          lora_id=ev.lora_id, medium=ev.medium, lora_name=ev.lora_name, extra_keys=extra,
                          group_idx=ev.group_idx, kv_cache_spec_kind=ev.kv_cache_spec_kind,
                          kv_cache_spec_sliding_window=ev.kv_cache_spec_sliding_window, cache_salt=ev.cache_salt)
        parent = hashes[-1]


MAX_SPLIT = 1024
"""Most router blocks one server block is split into (a 16,384-token block at the default 16; vLLM's largest
attention block sizes are a few hundred tokens). A larger ratio is left unsplit, a ``block_size_mismatch``: a
publisher cannot make one hash cost the index thousands of entries."""
_SUB_SEEDS = tuple(range(0x5B5B_0001, 0x5B5B_0001 + MAX_SPLIT))


def sub_block_hashes(server_hash: int, k: int) -> list[int]:
    """The server hashes `split_events` gives the first ``k - 1`` router-sized sub-blocks of the server block
    `server_hash` (a non-negative int; the last sub-block keeps `server_hash`): ``xxh3_64(hash, seed)`` with a
    seed per position, so distinct from every real hash but with probability ~2**-64 per pair. Pure."""
    data = server_hash.to_bytes(8, "little")
    return [_xxh3(data, _SUB_SEEDS[j]) for j in range(k - 1)]


def _split_hashes(hashes: Sequence[Any], k: int) -> list[int]:
    out: list[int] = []
    for s in _server_hashes(hashes):
        out += sub_block_hashes(s, k)
        out.append(s)
    return out


def split_events(events: Sequence[Any], block_size: int, k: int) -> list[Any]:
    """`events` rewritten in `block_size`-token blocks (module docstring: server blocks k times the router's).
    A GPU or CPU `BlockStored` with tokens is split by its own size when that is a multiple of `block_size`
    (left as it is otherwise: a mismatch the index counts); a placeholder (no tokens, no size) and every
    `BlockRemoved` by the endpoint's `k`. Hashes that do not decode leave the event as it is (the index counts
    it malformed). Pure; returns a new list, the events themselves untouched."""
    out: list[Any] = []
    for ev in events:
        t = type(ev)
        try:
            if t is BlockStored:
                if ev.block_size > 0 and len(ev.token_ids):
                    m = ev.block_size // block_size if ev.block_size % block_size == 0 else 1
                    if 1 < m <= MAX_SPLIT:
                        extra = None
                        if ev.extra_keys:
                            extra = []
                            for keys in ev.extra_keys:
                                extra.append(keys)
                                extra += [None] * (m - 1)
                        ev = msgspec.structs.replace(ev, block_hashes=_split_hashes(ev.block_hashes, m),
                                                     block_size=block_size, extra_keys=extra)
                elif k > 1:
                    ev = msgspec.structs.replace(ev, block_hashes=_split_hashes(ev.block_hashes, k))
            elif t is BlockRemoved and k > 1:
                ev = msgspec.structs.replace(ev, block_hashes=_split_hashes(ev.block_hashes, k))
        except KVEventsDecodeError:
            pass
        out.append(ev)
    return out
