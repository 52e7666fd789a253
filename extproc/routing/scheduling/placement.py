"""Placement under cache pressure: where a request's *new* blocks go, priced by what they evict.

The servers evict by LRU whatever the router does; what the router controls is where each request's uncached
blocks are written, hence which blocks they push out. Two costs, one scorer each (`VictimScorer`,
`ReplicaScorer`, composed by `Placement`), added to the prefix policy's score (`scorers.TtftScorer`, seconds) of
a candidate endpoint before the tie rule, each behind its own setting so it can be measured alone:

- **Victim cost** (``placement_victims``: ``all`` / ``oneoff`` / ``off``; weight ``placement_victim_weight``):
  the request needs ``own`` more blocks on the endpoint; past its free blocks (``num_gpu_blocks`` scraped, less
  the blocks the events say it holds) the first victims are its least recently used blocks
  (`EvictionOrder.lru_oldest`: the KV-events index keeps each endpoint's blocks in eviction order, stores from
  its events, hits from the router's picks). Each victim is priced at its reuse value, the share of a re-prefill
  its eviction is expected to cost: ``min(f, REUSE_MAX_COUNT) / REUSE_UNIT`` of a block's prefill seconds, f = how
  many recent requests used the block (`FrequencySketch`, a count-min sketch with TinyLFU's aging). So a new prefix
  goes where it evicts blocks nobody came back for, unless the queue there costs more than that saves.
  ``oneoff`` applies it only to a request whose prefix the sketch has not seen (estimated frequency 0 before this
  request): one-off prefixes then churn through the endpoints' cold tails, and prefixes seen before are placed
  by load as without placement.
- **Replica cost** (``placement_replica_weight``, 0 = off): a candidate that holds fewer leading blocks than the
  best holder would duplicate the difference; each duplicated block costs its prefill seconds x the weight. The
  time model already moves a request only when that pays in TTFT; this raises the bar by the cache space a
  second copy takes (a replication threshold in the time model's own units).

Contract of `Placement.adjust`: given the scorer's sorted `Scored` list it returns a list of the same
candidates, each score raised by its placement cost (>= 0; the predicted TTFT and the rest unchanged), sorted
by score (stable). It reads the index and the sketch and changes nothing; `observe` (once per request, after
`adjust`) counts the request's blocks in the sketch; `on_pick` touches the primary's blocks in the eviction
order. Not thread-safe (the router's event loop). Cost per decision: one numpy pass over the request's blocks
(sketch) plus, per candidate that would evict, one pass over its victims.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.extproc.routing.scheduling.scorers import OWN_TOKENS, SCORE, STATE, Scored
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing.timemodel import TimeModel
from prefixroute.types import BlockHash, EndpointId

REUSE_UNIT = 4.0
"""A victim block used by this many recent requests is priced at one whole re-prefill, one used once at a
quarter of it (the value grows with the count: a hot prefix's eviction costs a re-prefill soon and again)."""
REUSE_MAX_COUNT = 64.0
"""Counts above this are cut: a block every request uses (a shared instruction) never reaches an LRU tail
anyway, and one stale count must not outweigh a whole endpoint's queue."""

_MULTIPLIERS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93],
                        dtype=np.uint64)


class EvictionOrder(Protocol):
    """What placement reads of an index: each endpoint's blocks in eviction order (`KVEventIndex`)."""

    def lru_oldest(self, endpoint: EndpointId, num_blocks: int) -> list[BlockHash]: ...

    def num_held_blocks(self, endpoint: EndpointId) -> int: ...

    def touch(self, endpoint: EndpointId, block_hashes: Sequence[BlockHash]) -> None: ...


class FrequencySketch:
    """Count-min sketch of block hashes (4 rows of `width` 32-bit counters), aged as TinyLFU does: after every
    `window_requests` requests every counter is halved, so a count is about the uses in the last one or two
    windows. `estimate` never under-counts a block within its window (collisions only add). Not thread-safe."""

    __slots__ = ("table", "width", "_shift", "window_requests", "num_requests")

    def __init__(self, width: int = 1 << 18, window_requests: int = 2048) -> None:
        if width < 2 or width & (width - 1):
            raise ValueError("width must be a power of two >= 2")
        self.width = width
        self._shift = np.uint64(64 - (width.bit_length() - 1))
        self.table = np.zeros((len(_MULTIPLIERS), width), dtype=np.uint32)
        self.window_requests = max(1, window_requests)
        self.num_requests = 0

    def _slots(self, hashes: Sequence[BlockHash]) -> np.ndarray:
        h = np.fromiter(hashes, dtype=np.uint64, count=len(hashes))
        return (h[None, :] * _MULTIPLIERS[:, None]) >> self._shift  # multiplicative hashing, one row each

    def add(self, hashes: Sequence[BlockHash]) -> None:
        """One request used `hashes` (distinct block hashes; a repeat within one call counts once)."""
        if len(hashes):
            slots = self._slots(hashes)
            for row in range(len(_MULTIPLIERS)):
                self.table[row, slots[row]] += 1
        self.num_requests += 1
        if self.num_requests >= self.window_requests:
            self.table >>= 1
            self.num_requests = 0

    def estimate(self, hashes: Sequence[BlockHash]) -> np.ndarray:
        """The estimated uses of each of `hashes` (float array, same order)."""
        if not len(hashes):
            return np.zeros(0)
        slots = self._slots(hashes)
        rows = [self.table[row, slots[row]] for row in range(len(_MULTIPLIERS))]
        return np.minimum.reduce(rows).astype(np.float64)


class VictimScorer:
    """``placement_victims``: the reuse value of what a candidate's new blocks evict there, in seconds (module
    docstring). Owns the frequency sketch (`observe` counts each request once, after scoring it)."""

    def __init__(self, settings: RoutingSettings) -> None:
        self.mode = settings.placement_victims
        self.weight = settings.placement_victim_weight
        self.sketch = FrequencySketch(window_requests=settings.placement_window_requests)
        self._cold_key_blocks = settings.cold_key_blocks
        self._kvb = float(settings.kv_block_tokens)

    def seen_before(self, request: InferenceRequest) -> float:
        """The sketch's count of the request's prefix before this request: its block halfway (past the first
        ``cold_key_blocks``, which a shared instruction may fill) -- the prompt's own tail is always new."""
        hashes = request.block_hashes
        if not hashes:
            return 0.0
        i = min(len(hashes) - 1, max(self._cold_key_blocks, len(hashes) // 2))
        return float(self.sketch.estimate([hashes[i]])[0])

    def costs(self, request: InferenceRequest, scored: Sequence[Scored], matches: Mapping[EndpointId, int],
              order: EvictionOrder | None, block_s: Sequence[float]) -> list[float] | None:
        """One cost (s, >= 0) per candidate of `scored`, or None when this request pays none."""
        if order is None or (self.mode == "oneoff" and self.seen_before(request) > 0):
            return None
        own_set = frozenset(request.block_hashes)
        out = []
        for x, bs in zip(scored, block_s):
            state = x[STATE]
            v = self._value(order, state.endpoint, state.num_gpu_blocks, x[OWN_TOKENS],
                            matches.get(state.endpoint, 0), own_set) if state.num_gpu_blocks else 0.0
            out.append(self.weight * bs * v)
        return out

    def _value(self, order: EvictionOrder, ep: EndpointId, num_gpu_blocks: int, own_tokens: float,
               matched: int, own_set: frozenset[BlockHash]) -> float:
        """The reuse value (in blocks' worth of re-prefill) of what `own_tokens` of new blocks evict on `ep`."""
        need = int(own_tokens // self._kvb)
        held = order.num_held_blocks(ep)
        k = held + need - num_gpu_blocks
        if k <= 0:
            return 0.0
        old = order.lru_oldest(ep, min(k + matched, held))
        if matched:  # the request's own blocks there are hits, taken out of the queue, not victims
            old = [h for h in old if h not in own_set]
        old = old[:k]
        if not old:
            return 0.0
        return float(np.minimum(self.sketch.estimate(old), REUSE_MAX_COUNT).sum()) / REUSE_UNIT

    def observe(self, request: InferenceRequest) -> None:
        """Count the request's blocks in the sketch (after scoring it, so its own prefix reads as before it)."""
        if request.block_hashes:
            self.sketch.add(request.block_hashes)


class ReplicaScorer:
    """``placement_replica_weight``: the blocks a candidate would duplicate of the best holder's prefix, in
    seconds of their prefill x the weight (module docstring)."""

    def __init__(self, settings: RoutingSettings) -> None:
        self.weight = settings.placement_replica_weight

    def costs(self, request: InferenceRequest, scored: Sequence[Scored], matches: Mapping[EndpointId, int],
              order: EvictionOrder | None, block_s: Sequence[float]) -> list[float] | None:
        if not matches:
            return None
        best = max(matches.values())
        get = matches.get
        return [self.weight * max(0, best - get(x[STATE].endpoint, 0)) * bs for x, bs in zip(scored, block_s)]


class Placement:
    """The placement scorers of the prefix policy, each on when its setting is (module docstring); built by
    `PrefixPolicy` when any is. Their costs add up."""

    def __init__(self, settings: RoutingSettings, model: TimeModel) -> None:
        self._model = model
        self._kvb = float(settings.kv_block_tokens)
        self.victims = VictimScorer(settings) if _victims_on(settings) else None
        self.scorers: list[VictimScorer | ReplicaScorer] = [
            *([self.victims] if self.victims is not None else []),
            *([ReplicaScorer(settings)] if settings.placement_replica_weight > 0 else [])]

    @staticmethod
    def enabled(settings: RoutingSettings) -> bool:
        return _victims_on(settings) or settings.placement_replica_weight > 0

    def adjust(self, request: InferenceRequest, scored: list[Scored], matches: Mapping[EndpointId, int],
               order: EvictionOrder | None) -> list[Scored]:
        """`scored` with each candidate's placement cost added to its score, re-sorted (module docstring)."""
        priced = self._model.priced
        block_s = [self._kvb / priced(x[STATE].endpoint)[0] for x in scored]
        total: list[float] | None = None
        for scorer in self.scorers:
            c = scorer.costs(request, scored, matches, order, block_s)
            if c is not None:
                total = c if total is None else [a + b for a, b in zip(total, c)]
        if total is None or not any(total):
            return scored
        out = [(x[SCORE] + c, *x[1:]) if c else x for x, c in zip(scored, total)]
        out.sort(key=lambda x: x[SCORE])
        return out

    def observe(self, request: InferenceRequest) -> None:
        """After `adjust`, once per request: the sketch counts it."""
        if self.victims is not None:
            self.victims.observe(request)

    @staticmethod
    def on_pick(request: InferenceRequest, endpoint: EndpointId, order: EvictionOrder | None) -> None:
        """The pick's blocks held at `endpoint` become its most recently used (`EvictionOrder.touch`)."""
        if order is not None and request.block_hashes:
            order.touch(endpoint, request.block_hashes)


def _victims_on(settings: RoutingSettings) -> bool:
    return settings.placement_victims != "off" and settings.placement_victim_weight > 0
