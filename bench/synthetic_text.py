"""Deterministic synthetic text for benchmark prompts: `block_text` gives the text of one block of N tokens.

The simulated model servers count about 4 characters per token, so a block of N tokens is synthesised as exactly
``N * CHARS_PER_TOKEN`` characters of pseudo-words drawn from a RNG seeded by (workload seed, namespace, block
id). Blocks are cached per key (generation is the expensive part of a trace replay: the Mooncake sample has ~44k
distinct 512-token blocks). Two requests share a text prefix exactly when they share leading block ids; distinct
ids never share a leading 16-token (64-char) block because each block starts with a unique tag.
"""

from __future__ import annotations

import functools
import random

from prefixroute.bench.workload_spec import CHARS_PER_TOKEN


# A fixed vocabulary of short lowercase words: text looks like prose to a tokenizer and stays ~4
# chars/token. Built once from a fixed seed so it never depends on the caller's RNG.
def _make_vocab(size: int = 512) -> tuple[str, ...]:
    rng = random.Random("prefixroute-bench-vocab")
    return tuple("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
                 for _ in range(size))


_VOCAB: tuple[str, ...] = _make_vocab()


@functools.lru_cache(maxsize=65536)
def block_text(seed: int, namespace: str, block_id: int | str, num_tokens: int) -> str:
    """Deterministic text of exactly ``num_tokens * CHARS_PER_TOKEN`` characters for one block.

    Same (seed, namespace, block_id, num_tokens) -> same text, in any process. Starts with a tag unique
    to (namespace, block_id), so two different blocks never share their first 64 characters.
    A partial block of n tokens is the first n*4 characters of the full block with the same id (so a
    prefix of a block stays a prefix), see `partial_block_text`.
    """
    n = num_tokens * CHARS_PER_TOKEN
    if n <= 0:
        return ""
    rng = random.Random(f"{seed}:{namespace}:{block_id}")
    parts = [f"{namespace}{block_id}"]
    size = len(parts[0])
    # ~5.5 chars per word incl. the space: draw a little more than needed in one call.
    while size < n:
        words = rng.choices(_VOCAB, k=n // 4 + 8)
        parts.extend(words)
        size += sum(len(w) + 1 for w in words)
    return " ".join(parts)[:n - 1] + "\n" if n > 1 else "\n"


def partial_block_text(seed: int, namespace: str, block_id: int | str, num_tokens: int, full_tokens: int) -> str:
    """The first `num_tokens` tokens of the `full_tokens`-token block (a prefix of the full block)."""
    if num_tokens >= full_tokens:
        return block_text(seed, namespace, block_id, full_tokens)
    return block_text(seed, namespace, block_id, full_tokens)[: num_tokens * CHARS_PER_TOKEN]
