"""Chained block hashing (routing/hashing.py)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings as hsettings, strategies as st

from prefixroute.extproc.routing.hashing import hash_blocks, hash_token_blocks, seed_for, token_bytes, token_seed_for

SEED = seed_for("m", None)


@pytest.mark.parametrize("length,block_chars,max_blocks,expected", [
    (0, 64, 256, 0), (63, 64, 256, 0), (64, 64, 256, 1), (127, 64, 256, 1), (128, 64, 256, 2),
    (64 * 300, 64, 256, 256), (10, 1, 4, 4), (10, 3, 100, 3),
])
def test_only_full_blocks_and_at_most_max_blocks(length, block_chars, max_blocks, expected):
    assert len(hash_blocks("a" * length, SEED, block_chars, max_blocks)) == expected


def test_chain_definition():
    text = "abcd" * 40  # 160 chars
    h0 = xxhash.xxh3_64_intdigest(text[:64].encode(), SEED)
    h1 = xxhash.xxh3_64_intdigest(text[64:128].encode(), h0)
    assert hash_blocks(text, SEED, 64, 256) == [h0, h1]


def test_non_ascii_blocks_are_characters_not_bytes():
    text = "é" * 64 + "ü" * 64
    assert hash_blocks(text, SEED, 64, 256) == [
        xxhash.xxh3_64_intdigest(("é" * 64).encode(), SEED),
        xxhash.xxh3_64_intdigest(("ü" * 64).encode(), xxhash.xxh3_64_intdigest(("é" * 64).encode(), SEED))]


def test_lone_surrogates_hash_instead_of_raising():
    assert len(hash_blocks("\ud800" * 64, SEED, 64, 256)) == 1


@pytest.mark.parametrize("a,b", [
    (("m", None), ("m", "")),
])
def test_seed_none_and_empty_are_the_same(a, b):
    assert seed_for(*a) == seed_for(*b)


@pytest.mark.parametrize("a,b", [
    (("m", None), ("n", None)), (("m", "t"), ("m", None)), (("m", "t"), ("m", "u")), ((None, "m"), ("m", None)),
    (("m\x1ft", None), ("m", "t")),
])
def test_seeds_differ(a, b):
    assert seed_for(*a) != seed_for(*b)


@hsettings(max_examples=200, deadline=None)
@given(a=st.text(max_size=600), b=st.text(max_size=600), block_chars=st.integers(1, 80))
def test_prefix_stable(a, b, block_chars):
    ha = hash_blocks(a, SEED, block_chars, 1000)
    hab = hash_blocks(a + b, SEED, block_chars, 1000)
    assert hab[: len(ha)] == ha


@hsettings(max_examples=200, deadline=None)
@given(a=st.text(min_size=1, max_size=400), b=st.text(min_size=1, max_size=400))
def test_shared_hashes_are_exactly_the_common_full_blocks(a, b):
    bc = 8
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    ha, hb = hash_blocks(a, SEED, bc, 1000), hash_blocks(b, SEED, bc, 1000)
    shared = 0
    while shared < min(len(ha), len(hb)) and ha[shared] == hb[shared]:
        shared += 1
    assert shared == min(common // bc, len(ha), len(hb))


@hsettings(max_examples=100, deadline=None)
@given(text=st.text(min_size=64, max_size=400))
def test_different_seeds_share_nothing(text):
    assert not set(hash_blocks(text, seed_for("m", "a"), 16, 100)) & set(hash_blocks(text, seed_for("m", "b"), 16, 100))


# --- token blocks (hash_token_blocks, token_seed_for) ---------------------------------------------------------
# The algorithm (hashing.py docstring): XXH3-64 of the xxHash specification (github.com/Cyan4973/xxHash,
# doc/xxhash_spec.md), chained through its seed over little-endian uint32 token ids. The reference below uses
# the `xxhash` package's streaming XXH3 object and `struct` (not the code under test's one-shot digest and
# numpy); the literals pin the values so that a change of algorithm, byte order or seed domain fails loudly
# (every router replica and every stored index must agree on them).

def _reference_token_chain(ids, block_size, seed, max_blocks=None):
    out, h = [], seed
    n = len(ids) // block_size if max_blocks is None else min(len(ids) // block_size, max_blocks)
    for i in range(n):
        x = xxhash.xxh3_64(seed=h)
        x.update(struct.pack(f"<{block_size}I", *ids[i * block_size:(i + 1) * block_size]))
        h = x.intdigest()
        out.append(h)
    return out


def _reference_token_seed(lora_name, cache_salt):
    x = xxhash.xxh3_64()
    x.update(b"prefixroute/tokens/v1\x1f" + (lora_name or "").encode() + b"\x1f" + (cache_salt or "").encode())
    return x.intdigest()


@pytest.mark.parametrize("lora_name,cache_salt,golden", [
    (None, None, 10166146091378642582),
    ("lora-a", None, 3019365461987045263),
    (None, "salt", 8461002192669757086),
])
def test_token_seed_golden(lora_name, cache_salt, golden):
    assert token_seed_for(lora_name, cache_salt) == golden == _reference_token_seed(lora_name, cache_salt)


@pytest.mark.parametrize("ids,block_size,lora_name,cache_salt,max_blocks,golden", [
    (list(range(40)), 16, None, None, None, [8986029858358135549, 8017549612330370728]),
    ([128000, 2**31 - 1, 0, 7] * 8, 4, "lora-a", "salt", 3,
     [14687300116455860498, 8610324923894337568, 752617323829439327]),
])
def test_token_blocks_golden(ids, block_size, lora_name, cache_salt, max_blocks, golden):
    seed = token_seed_for(lora_name, cache_salt)
    assert hash_token_blocks(ids, block_size, seed, max_blocks) == golden
    assert _reference_token_chain(ids, block_size, seed, max_blocks) == golden
    # ids, uint32 array and their bytes hash alike
    assert hash_token_blocks(np.asarray(ids, np.uint32), block_size, seed, max_blocks) == golden
    assert hash_token_blocks(token_bytes(ids), block_size, seed, max_blocks) == golden


@hsettings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=200), block_size=st.integers(1, 17))
def test_token_blocks_match_the_reference(ids, block_size):
    seed = token_seed_for(None, None)
    assert hash_token_blocks(ids, block_size, seed) == _reference_token_chain(ids, block_size, seed)
