"""Text-block hashes with the work of text seen before cached (`TextHashCache`): text mode's counterpart of
token mode's `tokens.PromptHasher`.

`hashing.hash_blocks` makes one xxh3 call per 64-character block: ~190 calls for a 12 KB prompt, about half of
parsing a chat request in text mode (~50 of ~110 us warm on this host, 2-3x that after an idle gap), and the
same calls again for every request that repeats a system prompt or a conversation's earlier turns.

The cache cuts the text into *spans* of `SPAN_BLOCKS` blocks (1 KiB of text at the default 64-character
blocks). A span's block hashes depend only on the chain state before it (the hash of the block before, or the
seed) and its characters, so they are stored under one key, the xxh3-64 of the span's UTF-8 bytes seeded with
that chain state. A prompt whose leading spans were seen before costs one xxh3 call and one lookup per span;
the spans after the first unseen one are hashed block by block (and cached), and so is the trailing part
shorter than a span (it changes as a conversation grows, so caching it would only churn the cache).

Contract: ``cache.hash_blocks(text, seed)`` equals ``hashing.hash_blocks(text, seed, block_chars, max_blocks)``
for every text and seed, cached or not (tests/unit/routing/test_text_hash_cache.py, hypothesis). A key is 64
bits: two different (state, span) pairs sharing one would return the other's hashes, with odds of ~2^-64 per
pair; the prefix index already names each block by a 64-bit hash, so the cache adds no weaker link.

Bounded: at most `max_entries` spans (least recently used first out), each ~`memory.TEXT_SPAN_ENTRY_BYTES`.
Event-loop code: one caller at a time; a concurrent caller can only turn a hit into a miss (each cache
operation is one dict call, and an entry evicted between its lookup and its refresh is tolerated).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import xxhash

from prefixroute.extproc.routing.hashing import hash_blocks as _hash_blocks
from prefixroute.extproc.routing.memory import TEXT_SPAN_ENTRY_BYTES, plan
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.types import BlockHash

if TYPE_CHECKING:
    from prefixroute.extproc.routing.tokens import PromptHasher

_xxh3 = xxhash.xxh3_64_intdigest

SPAN_BLOCKS = 16
"""Blocks per cached span. 16 x 64 characters = 1 KiB: a lookup replaces 16 hash calls, and a prompt shares
cached spans with another up to the last whole span of their common prefix (the blocks of the span where
they part are hashed one by one, up to 15 calls more than for a prompt seen whole)."""


class TextHashCache:
    """`hashing.hash_blocks` for one block size and cap, with spans seen before cached (module docstring)."""

    __slots__ = ("block_chars", "max_blocks", "max_entries", "_spans", "num_span_hits", "num_span_misses")

    def __init__(self, block_chars: int, max_blocks: int, max_entries: int) -> None:
        if block_chars < 1 or max_blocks < 1 or max_entries < 1:
            raise ValueError("block_chars, max_blocks and max_entries must be >= 1")
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self.max_entries = max_entries
        # span key -> the span's SPAN_BLOCKS block hashes, oldest use first
        self._spans: OrderedDict[int, tuple[BlockHash, ...]] = OrderedDict()
        self.num_span_hits = 0
        self.num_span_misses = 0

    @classmethod
    def from_settings(cls, settings: RoutingSettings) -> "TextHashCache":
        """The cache of `RoutingSettings` (``block_chars``, ``max_blocks``): as many spans as its part of
        ``memory_budget_mb`` holds (routing/memory.py ``text_hash_cache_bytes``: at most
        ``tokenizer_cache_entries``)."""
        entries = max(1, plan(settings).text_hash_cache_bytes // TEXT_SPAN_ENTRY_BYTES)
        return cls(settings.block_chars, settings.max_blocks, entries)

    def __len__(self) -> int:
        return len(self._spans)

    def hash_blocks(self, text: str, seed: BlockHash) -> list[BlockHash]:
        """Chained xxh3-64 hashes of the full blocks of `text` from `seed`, at most ``max_blocks``: exactly
        `hashing.hash_blocks`'s."""
        bc = self.block_chars
        n = min(len(text) // bc, self.max_blocks)
        num_spans = n // SPAN_BLOCKS
        if num_spans == 0:
            return _hash_blocks(text, seed, bc, self.max_blocks)
        end = n * bc
        prefix = text[:end]  # never read (or copy) beyond the hashed part
        span_chars = SPAN_BLOCKS * bc
        span_end = num_spans * span_chars
        # One encode, then byte slices, for ASCII text (the keys' bytes); otherwise each span is encoded
        # (surrogatepass: a lone surrogate must hash, not raise, as in hash_blocks).
        data = prefix.encode("ascii") if prefix.isascii() else None
        get = self._spans.get
        out: list[BlockHash] = []
        h = seed
        for i in range(0, span_end, span_chars):
            text_span = prefix[i:i + span_chars]
            span = data[i:i + span_chars] if data is not None else text_span.encode("utf-8", "surrogatepass")
            key = _xxh3(span, h)
            hashes = get(key)
            if hashes is None:
                hashes = tuple(_hash_blocks(text_span, h, bc, SPAN_BLOCKS))
                self._store(key, hashes)
            else:
                self._touch(key)
            h = hashes[-1]
            out.extend(hashes)
        if span_end < end:
            out.extend(_hash_blocks(prefix[span_end:], h, bc, n - num_spans * SPAN_BLOCKS))
        return out

    def _store(self, key: int, hashes: tuple[BlockHash, ...]) -> None:
        self.num_span_misses += 1
        spans = self._spans
        spans[key] = hashes
        if len(spans) > self.max_entries:
            try:
                spans.popitem(last=False)
            except KeyError:  # emptied by a concurrent caller
                pass

    def _touch(self, key: int) -> None:
        self.num_span_hits += 1
        try:
            self._spans.move_to_end(key)
        except KeyError:  # evicted by a concurrent caller since its lookup: it is recomputed next time
            pass


class PromptHashCachesCollector:
    """prometheus_client collector of the prompt-hashing caches (register it on the router's registry): the text
    spans' (`TextHashCache`) and, in token mode, the tokenizer's pieces (`tokens.PromptHasher`). Read by the
    metrics thread: plain integers, a torn read costs at most one count."""

    def __init__(self, text_cache: TextHashCache, hasher: PromptHasher | None = None) -> None:
        self.text_cache = text_cache
        self.hasher = hasher

    def describe(self) -> list:
        return []

    def collect(self):  # noqa: ANN201
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        lookups = CounterMetricFamily("prefixroute_prompt_hash_cache_lookups", "Lookups in the prompt-hashing "
                                      "caches by result: text_spans (1 KiB spans of prompt text whose block hashes "
                                      "are kept), token_pieces (token mode: prompt pieces whose token ids are "
                                      "kept). A miss hashes (or tokenizes) the text.", labels=["cache", "result"])
        t = self.text_cache
        lookups.add_metric(["text_spans", "hit"], t.num_span_hits)
        lookups.add_metric(["text_spans", "miss"], t.num_span_misses)
        if self.hasher is not None:
            lookups.add_metric(["token_pieces", "hit"], self.hasher.num_piece_hits)
            lookups.add_metric(["token_pieces", "miss"], self.hasher.num_piece_misses)
        yield lookups
        entries = GaugeMetricFamily("prefixroute_prompt_hash_cache_entries", "Text spans the text hash cache holds "
                                    "(at most --tokenizer-cache-entries).", labels=["cache"])
        entries.add_metric(["text_spans"], len(t))
        yield entries
