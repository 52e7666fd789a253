"""Text-block hashes with repeated spans cached (routing/text_hash_cache.py): always `hash_blocks`'s hashes."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings as hsettings, strategies as st

from helpers.peers import POST
from prefixroute.extproc.routing.hashing import hash_blocks, seed_for
from prefixroute.extproc.routing.request import parse_request
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing.text_hash_cache import SPAN_BLOCKS, TextHashCache

SEED = seed_for("m", None)

# Texts built from a few shared heads, so that later texts repeat spans of earlier ones (hits) and part from
# them at every offset (the span where they part is hashed block by block).
_ALPHABETS = st.sampled_from(["ab", "abcdefgh ", "é ü", "a\ud800b", "日本語 "])


@st.composite
def _texts(draw):
    alphabet = draw(_ALPHABETS)
    heads = draw(st.lists(st.text(alphabet, min_size=0, max_size=900), min_size=1, max_size=3))
    out = []
    for _ in range(draw(st.integers(1, 6))):
        head = draw(st.sampled_from(heads))
        out.append(head * draw(st.integers(1, 4)) + draw(st.text(alphabet, max_size=200)))
    return out


@hsettings(max_examples=150, deadline=None)
@given(texts=_texts(), block_chars=st.sampled_from([1, 3, 8, 64]), max_blocks=st.sampled_from([1, 17, 64, 256]),
       max_entries=st.sampled_from([1, 2, 1000]), seeds=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=2))
def test_cached_hashes_equal_uncached_ones(texts, block_chars, max_blocks, max_entries, seeds):
    cache = TextHashCache(block_chars, max_blocks, max_entries)
    for seed in seeds:
        for text in texts + texts:  # each text twice: the second time from the cache where it holds it
            assert cache.hash_blocks(text, seed) == hash_blocks(text, seed, block_chars, max_blocks)
    assert len(cache) <= max_entries


@pytest.mark.parametrize("text", ["x" * 64 * 40, ("é" * 7 + "a") * 8 * 40])
def test_a_repeated_prompt_is_served_from_its_spans(text):
    cache = TextHashCache(64, 256, 100)
    first = cache.hash_blocks(text, SEED)
    assert (cache.num_span_hits, cache.num_span_misses) == (0, 40 // SPAN_BLOCKS)
    assert cache.hash_blocks(text + "tail" * 100, SEED)[:len(first)] == first
    assert cache.num_span_hits == 40 // SPAN_BLOCKS
    # Another seed (model, tenant) shares no span.
    cache.hash_blocks(text, seed_for("other", None))
    assert cache.num_span_hits == 40 // SPAN_BLOCKS


def test_least_recently_used_spans_go_first():
    cache = TextHashCache(4, 1 << 20, 2)
    a, b, c = ("a" * 4 * SPAN_BLOCKS), ("b" * 4 * SPAN_BLOCKS), ("c" * 4 * SPAN_BLOCKS)
    for t in (a, b, a, c):  # a used again after b: b is the oldest when c comes
        cache.hash_blocks(t, SEED)
    hits = cache.num_span_hits
    cache.hash_blocks(a, SEED)
    assert cache.num_span_hits == hits + 1
    cache.hash_blocks(b, SEED)
    assert cache.num_span_hits == hits + 1  # evicted: a miss


def test_invalid_sizes_are_refused():
    for args in ((0, 1, 1), (1, 0, 1), (1, 1, 0)):
        with pytest.raises(ValueError):
            TextHashCache(*args)


def test_parse_request_gives_the_same_request_with_the_cache():
    settings = RoutingSettings()
    cache = TextHashCache.from_settings(settings)
    system = "You are the assistant of tenant 7. " * 300
    for turn in range(3):
        body = orjson.dumps({"model": "m", "messages": [{"role": "system", "content": system},
                                                         {"role": "user", "content": f"question {turn} " * 30}]})
        assert parse_request(*POST, {}, body, settings, text_cache=cache) == parse_request(*POST, {}, body, settings)
    assert cache.num_span_hits > 0


def test_the_caches_lookups_are_on_metrics():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from prefixroute.extproc.routing.text_hash_cache import PromptHashCachesCollector
    from prefixroute.extproc.routing.tokens import PromptHasher

    settings = RoutingSettings(tokenizer="sim")
    cache, hasher = TextHashCache.from_settings(settings), PromptHasher.from_settings(settings)
    registry = CollectorRegistry()
    registry.register(PromptHashCachesCollector(cache, hasher))
    for question in ("hi", "hello"):  # the second: the role pieces from the cache, the new question tokenized
        body = orjson.dumps({"model": "m", "messages": [{"role": "system", "content": "Be brief. " * 400},
                                                         {"role": "user", "content": question}]})
        parse_request(*POST, {}, body, settings, hasher, None, cache)
    cache.hash_blocks("x" * 64 * 32, SEED)
    cache.hash_blocks("x" * 64 * 32, SEED)

    def samples():
        text = generate_latest(registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    got = samples()
    lookups = "prefixroute_prompt_hash_cache_lookups_total"
    assert got[(lookups, (("cache", "text_spans"), ("result", "miss")))] == 2
    assert got[(lookups, (("cache", "text_spans"), ("result", "hit")))] == 2
    assert got[(lookups, (("cache", "token_pieces"), ("result", "hit")))] >= 1
    assert got[(lookups, (("cache", "token_pieces"), ("result", "miss")))] >= 1
    assert got[("prefixroute_prompt_hash_cache_entries", (("cache", "text_spans"),))] == 2
