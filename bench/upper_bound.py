"""The workload's prefix-reuse upper bound: the hit ratio if every request met one infinite cache.

Replays the requests in order through a single, never-evicting set of block hashes, with the same
accounting as the simulated model servers (and vLLM): prompts are rendered with the servers' chat
template and tokenizer (`prefixroute.model_servers.tokenizer`), cut into 16-token blocks, chained-hashed;
a request's hit is its leading blocks already in the set, capped so at least one prompt token is
computed (vLLM recomputes the last token of a fully cached prompt); then all its full prompt blocks are
added. Generated tokens are not added: the workloads resend synthetic answers, not the servers' text.

No router can beat this figure on the same request sequence: any real fleet splits and evicts the cache.
Pure function of the workload; no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np
import xxhash

from prefixroute.bench.workloads import CHARS_PER_TOKEN, RequestSpec, Workload

CACHE_BLOCK_TOKENS = 16
"""vLLM's default KV block size; the simulated servers cache in blocks of the same size."""

_xxh3 = xxhash.xxh3_64_intdigest

try:  # The model servers' tokenizer and chat template, so the bound matches the servers' accounting.
    from prefixroute.model_servers.tokenizer import encode as _encode, render_chat as _render_chat
    TOKENIZER = "prefixroute.model_servers.tokenizer"
except ImportError:  # pragma: no cover - only when the model-server package is absent
    _encode = None
    _render_chat = None
    TOKENIZER = "approx-4-chars"


def prompt_token_ids(req: RequestSpec) -> np.ndarray:
    """The prompt token ids a simulated server would compute for `req` (template + tokenizer)."""
    if req.messages is not None:
        text = (_render_chat([dict(m) for m in req.messages]) if _render_chat is not None
                else "".join(m["role"] + ":" + m["content"] for m in req.messages))
    else:
        text = req.prompt or ""
    if _encode is not None:
        return _encode(text)
    raw = text.encode("utf-8")
    raw += b"\0" * (-len(raw) % CHARS_PER_TOKEN)
    return np.frombuffer(raw, dtype="<u4").astype(np.int64)


def chained_block_hashes(tokens: np.ndarray, block_tokens: int = CACHE_BLOCK_TOKENS) -> list[int]:
    """Chained xxh3-64 of each full block of token ids (a hash names the whole prefix up to its block)."""
    n = len(tokens) // block_tokens
    data = np.ascontiguousarray(tokens[: n * block_tokens], dtype="<i8").tobytes()
    step = block_tokens * 8
    out = []
    h = 0
    for start in range(0, n * step, step):
        h = _xxh3(data[start:start + step], h)
        out.append(h)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class UpperBound:
    """Totals of the infinite-cache replay; hit_ratio = cached prompt tokens / prompt tokens (0 if none)."""

    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    block_tokens: int
    tokenizer: str

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def replay_infinite_cache(token_lists: Iterable[np.ndarray],
                          block_tokens: int = CACHE_BLOCK_TOKENS) -> Iterator[tuple[int, int]]:
    """Yield (prompt_tokens, cached_tokens) per request through one never-evicting prefix cache."""
    seen: set[int] = set()
    for tokens in token_lists:
        hashes = chained_block_hashes(tokens, block_tokens)
        n = len(tokens)
        matched = 0
        for h in hashes:
            if h not in seen:
                break
            matched += 1
        # At least one token must be computed to produce logits: cap the hit at n - 1 tokens (in blocks).
        matched = min(matched, max(0, (n - 1) // block_tokens))
        seen.update(hashes)
        yield n, matched * block_tokens


def upper_bound(workload: Workload, block_tokens: int = CACHE_BLOCK_TOKENS) -> UpperBound:
    """The infinite-cache hit ratio of the workload's request sequence, in send order."""
    total = cached = 0
    for n, c in replay_infinite_cache((prompt_token_ids(r) for r in workload.requests), block_tokens):
        total += n
        cached += c
    return UpperBound(len(workload.requests), total, cached, block_tokens, TOKENIZER)
