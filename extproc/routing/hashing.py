"""Chained block hashing (pure): of canonical prompt text (the approximate index), and of token ids at the
servers' block size (`hash_token_blocks`: the precise index fed by KV events, see the end of this docstring).

Text blocks (the vLLM prefix-cache scheme on characters):

``h_0 = xxh3_64(block_0, seed=seed)``, ``h_i = xxh3_64(block_i, seed=h_{i-1})`` where ``block_i`` is the UTF-8
encoding of characters ``[i*block_chars, (i+1)*block_chars)`` of the text.

Invariants (tested in tests/unit/routing/test_hashing.py):
- Prefix-stable: if text A is a prefix of text B, ``hash_blocks(A)`` is a prefix of ``hash_blocks(B)``; two texts
  share exactly the hashes of their common full leading blocks (a hash names the whole prefix up to its block).
- Only full blocks are hashed (a trailing partial block changes as the text grows, so it cannot be cached).
- Deterministic across processes, hosts and Python versions (xxh3 with explicit seeds; no ``hash()``).
- Seeded by model and tenant (`seed_for`): the same text under another model, adapter or tenant shares no hash.
- Bounded: at most ``max_blocks`` hashes; the text beyond ``max_blocks * block_chars`` characters is not read.

Token blocks (the router's own key for the servers' KV blocks; vLLM's own hash is seeded from ``os.urandom``
and published truncated, so the router never tries to reproduce it)::

    t_seed = xxh3_64(b"prefixroute/tokens/v1" 0x1f lora_name 0x1f cache_salt)     (`token_seed_for`)
    t_0    = xxh3_64(le_u32(tokens[0:bs]),          seed=t_seed)
    t_i    = xxh3_64(le_u32(tokens[i*bs:(i+1)*bs]), seed=t_{i-1})

with ``le_u32`` the little-endian uint32 bytes of the token ids and xxh3_64 the XXH3 64-bit hash of the xxHash
specification (github.com/Cyan4973/xxHash, doc/xxhash_spec.md). The same invariants hold: prefix-stable, full
blocks only, deterministic, bounded; the seed separates LoRA adapters (vLLM's ``lora_name`` extra key; the base
model is None) and ``cache_salt`` as vLLM's extra keys do. Golden vectors: tests/unit/routing/test_hashing.py.
"""

from __future__ import annotations

import numpy as np
import xxhash

from prefixroute.types import BlockHash

_xxh3 = xxhash.xxh3_64_intdigest
_TOKEN_SEED_DOMAIN = b"prefixroute/tokens/v1"
_SEED_DOMAIN = b"prefixroute/v1"  # bump when the canonical text or the hashing changes (invalidates nothing stored)


def seed_for(model: str | None, tenant: str | None) -> BlockHash:
    """The chain seed for one (model, tenant) pair. ``None`` and ``""`` mean the same (no model / no tenant)."""
    key = b"\x1f".join((_SEED_DOMAIN, (model or "").encode("utf-8", "surrogatepass"),
                        (tenant or "").encode("utf-8", "surrogatepass")))
    return BlockHash(_xxh3(key))


def hash_blocks(text: str, seed: BlockHash, block_chars: int, max_blocks: int) -> list[BlockHash]:
    """Chained xxh3-64 hashes of the full ``block_chars``-character blocks of `text`, at most `max_blocks`."""
    if block_chars < 1:
        raise ValueError("block_chars must be >= 1")
    n = min(len(text) // block_chars, max_blocks)
    if n <= 0:
        return []
    h = seed
    end = n * block_chars
    prefix = text[:end]  # never read (or copy) beyond the hashed part
    if prefix.isascii():
        # One encode, then byte slices: the same bytes as per-block encoding, fewer calls.
        # h := carries the chain from block to block.
        data = prefix.encode("ascii")
        return [h := _xxh3(data[i:i + block_chars], h) for i in range(0, end, block_chars)]
    # surrogatepass: a lone surrogate in the text must hash, not raise.
    return [h := _xxh3(prefix[i:i + block_chars].encode("utf-8", "surrogatepass"), h)
            for i in range(0, end, block_chars)]


def token_seed_for(lora_name: str | None, cache_salt: str | None) -> BlockHash:
    """The token-chain seed of a prompt's first block. ``None`` and ``""`` mean the same (base model / no salt)."""
    key = b"\x1f".join((_TOKEN_SEED_DOMAIN, (lora_name or "").encode("utf-8", "surrogatepass"),
                        (cache_salt or "").encode("utf-8", "surrogatepass")))
    return BlockHash(_xxh3(key))


def token_bytes(token_ids: "np.ndarray | list[int]") -> bytes:
    """Little-endian uint32 bytes of `token_ids` (what `hash_token_blocks` hashes)."""
    return np.asarray(token_ids, dtype="<u4").tobytes()


def hash_token_blocks(token_ids: "np.ndarray | list[int] | bytes", block_size: int, seed: BlockHash,
                      max_blocks: int | None = None) -> list[BlockHash]:
    """Chained hashes of the full `block_size`-token blocks of `token_ids` (ids, or their `token_bytes`), at
    most `max_blocks`; the first block chained from `seed` (`token_seed_for`, or the hash of the block before
    when extending a chain, as KV events' ``parent_block_hash`` does)."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    data = token_ids if isinstance(token_ids, bytes) else token_bytes(token_ids)
    n = len(data) // (4 * block_size)
    if max_blocks is not None:
        n = min(n, max_blocks)
    if n <= 0:
        return []
    step = 4 * block_size
    h = seed
    return [h := _xxh3(data[i:i + step], h) for i in range(0, n * step, step)]
