"""`prefixroute.kv_events_wire.BatchDecoder`: every wire form, detected per batch; tolerance of what later releases
add; never an exception but `KVEventsDecodeError`. (The releases' own bytes: test_golden_payloads.py.)"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.kv_events_wire import (AllBlocksCleared, BatchDecoder, BlockRemoved, BlockStored, EventBatch,
                                   KVEventsDecodeError, block_hash_int, encode_batch)

enc = msgspec.msgpack.encode
STORED = BlockStored([1, 2], None, list(range(8)), 4, None, "GPU", None)


@pytest.mark.parametrize("form", ["mixed", "array", "map"])
def test_each_form_round_trips_and_is_named(form):
    b = EventBatch(1.5, [STORED, BlockRemoved([3], "GPU"), AllBlocksCleared()], 2)
    d = BatchDecoder()
    assert d.decode(encode_batch(b, form=form)) == b and d.form == form


def test_the_form_is_detected_per_batch_not_per_stream():
    d = BatchDecoder()
    for form in ("array", "mixed", "map", "mixed", "array"):
        assert d.decode(encode_batch(EventBatch(1.0, [STORED]), form=form)).events == [STORED]
        assert d.form == form


@pytest.mark.parametrize("payload, want", [
    # vLLM 0.9: [ts, events] without a rank; BlockStored of 5 fields, BlockRemoved of 1
    (enc([1.0, [["BlockStored", [5], None, [1, 2], 2, None], ["BlockRemoved", [5]]]]),
     EventBatch(1.0, [BlockStored([5], None, [1, 2], 2), BlockRemoved([5])])),
    # a future array release's trailing fields are ignored, not read as other fields
    (enc([1.0, [["BlockStored", [5], None, [1, 2], 2, None, "GPU", None, None, 0, None, None, "x", "y"]], 0]),
     EventBatch(1.0, [BlockStored([5], None, [1, 2], 2, None, "GPU", None, None, 0)], 0)),
    # unknown map keys are ignored; SGLang omits medium (None) and names the salt
    (enc([1.0, [{"type": "BlockStored", "block_hashes": [-7], "parent_block_hash": None, "token_ids": [1, 2],
                 "block_size": 2, "lora_id": None, "cache_salt": "t", "future_field": {"a": 1}}], 0]),
     EventBatch(1.0, [BlockStored([-7], None, [1, 2], 2, cache_salt="t")], 0)),
    # vLLM 0.33's placeholder (offloading connector): empty token ids, block size 0, bytes hash
    (enc([1.0, [{"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None,
                 "token_ids": [], "block_size": 0, "lora_id": None, "medium": "CPU", "lora_name": None,
                 "group_idx": 0}], 0]),
     EventBatch(1.0, [BlockStored([b"\x01" * 32], None, [], 0, None, "CPU", None, None, 0)], 0)),
    # an event type no release defines is skipped; the rest of its batch applies
    (enc([1.0, [{"type": "BlockPinned", "block_hashes": [1]}, {"type": "AllBlocksCleared"}], 0]),
     EventBatch(1.0, [AllBlocksCleared()], 0)),
    (enc([1.0, [["BlockPinned", [1]], ["AllBlocksCleared"]], 0]), EventBatch(1.0, [AllBlocksCleared()], 0)),
    # SGLang's EAGLE bigram pages: token ids as pairs decode (the index counts them malformed, not the batch)
    (enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                 "token_ids": [[1, 2], [2, 3]], "block_size": 2, "lora_id": None}], None]),
     EventBatch(1.0, [BlockStored([1], None, [[1, 2], [2, 3]], 2)])),
])
def test_release_variants_decode(payload, want):
    d = BatchDecoder()
    assert d.decode(payload) == want


def test_unknown_event_types_are_counted():
    d = BatchDecoder()
    d.decode(enc([1.0, [{"type": "BlockPinned"}, {"type": "BlockPinned"}], 0]))
    assert d.num_unknown_events == 2


@pytest.mark.parametrize("payload, message", [
    (b"", "empty payload"),
    (b"\xc1", "not a msgpack array or map"),
    (enc("a string"), "not a msgpack array or map"),
    (enc({"version": 2, "batch": {}}), "missing required field `ts`"),
    (enc([1.0, [{"type": "BlockStored", "block_hashes": "not a list"}]]), "BlockStored: Expected `array`"),
    (enc([1.0, [["BlockRemoved", 5]]]), "BlockRemoved: Expected `array`"),
    (enc([1.0, [42]]), "neither a tagged map nor a tagged array"),
    (enc([1.0, "events"]), "Expected `array`"),
])
def test_what_does_not_decode_raises_the_decode_error_with_a_message(payload, message):
    with pytest.raises(KVEventsDecodeError) as ei:
        BatchDecoder().decode(payload)
    assert message in str(ei.value)


@given(st.binary(max_size=64))
@settings(max_examples=300, deadline=None)
def test_arbitrary_bytes_raise_only_the_decode_error(data):
    try:
        BatchDecoder().decode(data)
    except KVEventsDecodeError:
        pass


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(allow_nan=False),
                 st.text(max_size=12), st.binary(max_size=12),
                 st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "block_hashes"]))
_value = st.recursive(_leaf, lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(
    st.one_of(st.sampled_from(["type", "block_hashes", "token_ids", "block_size", "ts", "events"]),
              st.text(max_size=6)), inner, max_size=5)), max_leaves=25)


@given(st.one_of(_value, st.tuples(st.floats(allow_nan=False), st.lists(_value, max_size=4)).map(list),
                 st.fixed_dictionaries({"ts": st.floats(allow_nan=False), "events": st.lists(_value, max_size=4)})))
@settings(max_examples=400, deadline=None)
def test_any_msgpack_structure_decodes_or_raises_only_the_decode_error(obj):
    """Batches of the right outline holding anything (maps with a list as "type", events of wrong types ...)."""
    try:
        BatchDecoder().decode(msgspec.msgpack.encode(obj))
    except KVEventsDecodeError:
        pass


_hash = st.one_of(st.integers(0, (1 << 64) - 1), st.integers(-(1 << 63), -1), st.binary(min_size=8, max_size=32))
_opt_str = st.one_of(st.none(), st.text(max_size=8))
_stored = st.builds(
    lambda hashes, parent, bs, lora_id, medium, lora_name, group: BlockStored(
        hashes, parent, list(range(bs * len(hashes))), bs, lora_id, medium, lora_name, None, group),
    st.lists(_hash, min_size=1, max_size=4), st.one_of(st.none(), _hash), st.integers(0, 8),
    st.one_of(st.none(), st.integers(0, 100)), _opt_str, _opt_str, st.one_of(st.none(), st.integers(0, 3)))
_event = st.one_of(_stored, st.builds(lambda h, m: BlockRemoved(h, m), st.lists(_hash, max_size=4), _opt_str),
                   st.just(AllBlocksCleared()))


@given(st.lists(_event, max_size=6), st.one_of(st.none(), st.integers(0, 7)), st.sampled_from(["mixed", "array", "map"]))
@settings(max_examples=200, deadline=None)
def test_any_batch_round_trips_every_form(events, rank, form):
    b = EventBatch(2.5, events, rank)
    assert BatchDecoder().decode(encode_batch(b, form=form)) == b


@pytest.mark.parametrize("a, b", [
    (-1, (1 << 64) - 1),  # a signed int64 (SGLang, vLLM 0.9) and its unsigned twin
    (b"\x00" * 24 + (5).to_bytes(8, "big"), 5),  # vLLM's bytes hash and maybe_convert_block_hash of it
])
def test_block_hash_int_makes_one_hash_of_each_representation(a, b):
    assert block_hash_int(a) == block_hash_int(b)


def test_placeholder_property():
    assert BlockStored([1], None, [], 0).is_placeholder and BlockStored([1], None, [1], 0).is_placeholder
    assert not STORED.is_placeholder
