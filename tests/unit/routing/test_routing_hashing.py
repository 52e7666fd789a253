"""Chained block hashing (routing/hashing.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import xxhash
from hypothesis import given, settings as hsettings, strategies as st

from prefixroute.extproc.routing.hashing import hash_blocks, seed_for

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


def test_deterministic_across_processes():
    code = ("from prefixroute.extproc.routing.hashing import hash_blocks, seed_for;"
            "print(hash_blocks('x' * 200 + 'é' * 70, seed_for('llama', 'acme'), 64, 256))")
    out = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={"PYTHONHASHSEED": str(i)}).stdout for i in (1, 2)}
    assert out == {str(hash_blocks("x" * 200 + "é" * 70, seed_for("llama", "acme"), 64, 256)) + "\n"}


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
