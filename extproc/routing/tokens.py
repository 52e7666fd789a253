"""Token-block hashes of request prompts, with a prefix cache (`PromptHasher`; pure).

The precise prefix index (fed by the servers' KV events) is keyed by chained hashes of token-id blocks
(hashing.py `hash_token_blocks`) of the very token ids the server computes for a request's prompt. A
`PromptTokenizer` (prefixroute.prompt_tokenizer; loaded by routing/tokenizers.py `load_tokenizer`: ``"sim"``,
another registered name, or a Hugging Face folder) computes them; this module hashes them, caching the work.

Speed. The rendered prompt is split at the tokenizer's special (added) tokens, and tokenizing each piece on its
own and concatenating is exactly the whole-prompt encoding (the tokenizer's `segment_exact`, checked when it
loads: routing/tokenizers.py). Every piece (a message body, a role name, a system prompt) is cached by the xxh3
of its text (LRU of ``tokenizer_cache_entries``), and so is the *hash-chain state* after each piece, keyed by
the streaming xxh3 of the whole prompt text up to that piece (plus the seed and block size): (tokens so far,
block hashes of the full blocks so far, the trailing partial block's tokens). A prompt whose leading pieces
were seen before costs one render, one split, one streaming hash and lookups; only the new pieces are
tokenized and hashed. Limitation: a prompt without special tokens (a plain completion string) is one piece, so
two such prompts sharing only a leading part of it share no cached work (their hashes still share the common
blocks).

Memory: both caches are bounded in bytes as well as entries (``tokenizer_cache_entries``, and a
quarter of ``memory_budget_mb``, routing/memory.py, split between them): each entry is charged what it holds
(token ids; a state's own block hashes and tail), and a state names its parent by key, not by reference, so
an evicted state is really freed (a state whose ancestors were evicted is a miss). A piece too large for an
eighth of its cache is never cached. So prompts of any size and number cost the caches at most their budget.

Not thread-safe by design, but guarded by a lock so a second thread only waits (the router calls it from
one event loop).

The tokenizer names are importable from here too (`TokenizationError`, `TokenizerLoadError`, `load_tokenizer`,
`PromptTokenizer`), for the callers that build a hasher.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import xxhash

from prefixroute.extproc.routing.hashing import hash_token_blocks, token_bytes, token_seed_for
from prefixroute.extproc.routing.tokenizers import load_tokenizer
from prefixroute.prompt_tokenizer import EMPTY_IDS, PromptTokenizer, TokenizationError, TokenizerLoadError
from prefixroute.types import BlockHash

__all__ = ["PromptHasher", "PromptTokenizer", "TokenBlocks", "TokenizationError", "TokenizerLoadError",
           "load_tokenizer"]

_xxh3 = xxhash.xxh3_64_intdigest


# --- token blocks with a prefix cache ---------------------------------------------------------------------------

@dataclasses.dataclass(slots=True, frozen=True)
class TokenBlocks:
    """A prompt's token-block hashes (`hash_token_blocks` chained from ``token_seed_for(lora_name, cache_salt)``,
    at most max_blocks) and its exact number of prompt tokens (all of them, also beyond the hashed blocks)."""

    block_hashes: list[BlockHash]
    num_prompt_tokens: int


class _State:
    """Hash-chain state after a prefix of pieces: it names the state before it by its chain key (`parent`; None
    after the first piece), so storing one costs only the blocks this piece completed, and evicting one frees it."""

    __slots__ = ("parent", "hashes", "num_blocks", "num_tokens", "tail", "last")

    def __init__(self, parent: int | None, hashes: list[BlockHash], num_blocks: int, num_tokens: int,
                 tail: np.ndarray, last: BlockHash) -> None:
        self.parent = parent
        self.hashes = hashes  # blocks completed by this piece
        self.num_blocks = num_blocks
        self.num_tokens = num_tokens
        self.tail = tail  # tokens of the trailing partial block (empty once max_blocks are hashed)
        self.last = last  # hash of the last full block (the seed before the first)

    def nbytes(self) -> int:
        """What the state holds (its hash list, tail and itself), for the cache's byte bound."""
        return 200 + 48 * len(self.hashes) + self.tail.nbytes


_ENTRY_BYTES = 330  # per cached value: its OrderedDict and size entries, the int key and size (measured)


class _LRU:
    """Least recently used cache bounded by entries and by bytes (each `put` says what its value holds)."""

    __slots__ = ("data", "capacity", "max_bytes", "num_bytes", "_sizes")

    def __init__(self, capacity: int, max_bytes: int | None = None) -> None:
        self.data: collections.OrderedDict = collections.OrderedDict()
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._sizes: dict = {}

    def get(self, key):
        v = self.data.get(key)
        if v is not None:
            self.data.move_to_end(key)
        return v

    def put(self, key, value, nbytes: int = 0) -> None:
        nbytes += _ENTRY_BYTES
        if self.max_bytes is not None and nbytes > self.max_bytes // 8:
            return  # one value must not flush most of the cache: not cached
        old = self._sizes.pop(key, None)
        if old is not None:
            self.num_bytes -= old
        self.data[key] = value
        self.data.move_to_end(key)
        self._sizes[key] = nbytes
        self.num_bytes += nbytes
        while len(self.data) > self.capacity or (self.max_bytes is not None and self.num_bytes > self.max_bytes):
            k, _ = self.data.popitem(last=False)
            self.num_bytes -= self._sizes.pop(k)


class PromptHasher:
    """Token-block hashes of request prompts, caching the token ids of each piece and the hash-chain state after
    each prefix of pieces (module docstring). Build one per router from settings (`from_settings`).

    Results equal ``hash_token_blocks(tokenizer.chat_ids(body), block_size, seed, max_blocks)`` (and
    ``len(chat_ids)`` tokens) for every body, cached or not; tested."""

    def __init__(self, tokenizer: PromptTokenizer, *, block_size: int = 16, max_blocks: int | None = 256,
                 cache_entries: int = 8192, cache_bytes: int | None = None) -> None:
        """`cache_bytes`: what both caches may hold together (half each; None: entries alone bound them)."""
        if block_size < 1 or cache_entries < 1:
            raise ValueError("block_size and cache_entries must be >= 1")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_blocks = max_blocks
        half = cache_bytes // 2 if cache_bytes is not None else None
        self._pieces = _LRU(cache_entries, half)  # xxh3(piece text) -> token ids
        self._states = _LRU(cache_entries, half)  # chain key -> _State
        self._lock = threading.Lock()
        self._name_bytes = tokenizer.name.encode("utf-8", "surrogatepass")
        self.num_piece_hits = 0
        self.num_piece_misses = 0

    @classmethod
    def from_settings(cls, settings: Any) -> "PromptHasher | None":
        """The hasher of `RoutingSettings` (``tokenizer``, ``kv_block_tokens``, ``max_token_blocks``,
        ``tokenizer_cache_entries``); None when ``tokenizer`` is empty (text mode). Raises
        `TokenizerLoadError` for a spec that does not load."""
        if not settings.tokenizer:
            return None
        from prefixroute.extproc.routing.memory import plan

        return cls(load_tokenizer(settings.tokenizer), block_size=settings.kv_block_tokens,
                   max_blocks=settings.max_token_blocks, cache_entries=settings.tokenizer_cache_entries,
                   cache_bytes=plan(settings).tokenizer_cache_bytes)

    def chat_blocks(self, body: Mapping[str, Any], *, lora_name: str | None = None,
                    cache_salt: str | None = None) -> TokenBlocks:
        """Blocks of a chat body (messages, tools, template options). Raises `TokenizationError`."""
        text, add = self.tokenizer.render_chat(body)
        return self.text_blocks(text, add, lora_name=lora_name, cache_salt=cache_salt)

    def completion_blocks(self, body: Mapping[str, Any], *, lora_name: str | None = None,
                          cache_salt: str | None = None) -> TokenBlocks:
        """Blocks of a completion body (``prompt``: a string or token ids). Raises `TokenizationError`."""
        prompt, add = self.tokenizer.completion_prompt(body)
        if isinstance(prompt, np.ndarray):
            seed = token_seed_for(lora_name, cache_salt)
            return TokenBlocks(hash_token_blocks(prompt, self.block_size, seed, self.max_blocks), len(prompt))
        return self.text_blocks(prompt, add, lora_name=lora_name, cache_salt=cache_salt)

    def text_blocks(self, text: str, add_special_tokens: bool, *, lora_name: str | None = None,
                    cache_salt: str | None = None) -> TokenBlocks:
        """Blocks of an already rendered prompt text."""
        seed = token_seed_for(lora_name, cache_salt)
        tok = self.tokenizer
        pieces: list[str | int] = []
        prefix = tok.prefix_ids(add_special_tokens)
        pieces.extend(int(t) for t in prefix)
        pieces.extend(tok.split(text))
        suffix = tok.suffix_ids(add_special_tokens)
        pieces.extend(int(t) for t in suffix)
        with self._lock:
            return self._blocks(pieces, seed)

    def _blocks(self, pieces: list[str | int], seed: BlockHash) -> TokenBlocks:
        # Chain keys: the streaming xxh3 of (tokenizer, seed, block size, pieces so far); a special token is
        # 0xff + its id (0xff never occurs in UTF-8, so it cannot collide with text).
        stream = xxhash.xxh3_64(self._name_bytes + b"\x1f%d\x1f%d\x1f%d\x1f" % (seed, self.block_size,
                                                                                  self.max_blocks or 0))
        keys: list[int] = []
        encoded: list[bytes | None] = []
        for p in pieces:
            if isinstance(p, int):
                stream.update(b"\xff" + int(p).to_bytes(4, "little"))
                encoded.append(None)
            else:
                b = p.encode("utf-8", "surrogatepass")
                stream.update(b)
                encoded.append(b)
            keys.append(stream.intdigest())
        states = self._states
        start = len(pieces)
        state: _State | None = None
        hashes: list[BlockHash] | None = None
        while start > 0:
            state = states.get(keys[start - 1])
            if state is not None:
                hashes = self._chain(state)
                if hashes is None:  # an ancestor was evicted (the oldest go first, so usually for the shorter ones too)
                    state, start = None, 0
                break
            start -= 1
        if state is None or hashes is None:
            state, hashes = _State(None, [], 0, 0, EMPTY_IDS, seed), []
        if start < len(pieces):
            ids = self._piece_ids(pieces[start:], encoded[start:])
            for i, piece_ids in enumerate(ids, start):
                state = self._extend(state, piece_ids, keys[i - 1] if i else None)
                hashes.extend(state.hashes)
                states.put(keys[i], state, state.nbytes())
        return TokenBlocks(hashes, state.num_tokens)

    def _chain(self, state: _State) -> list[BlockHash] | None:
        """Every block hash up to `state`, from its ancestors in the cache (each touched: a chain in use stays
        cached as a whole); None when one was evicted."""
        chunks = []
        data = self._states.data
        s: _State | None = state
        while True:
            if s.hashes:  # type: ignore[union-attr]
                chunks.append(s.hashes)  # type: ignore[union-attr]
            parent = s.parent  # type: ignore[union-attr]
            if parent is None:
                break
            s = data.get(parent)
            if s is None:
                return None
            data.move_to_end(parent)
        out: list[BlockHash] = []
        for c in reversed(chunks):
            out.extend(c)
        return out

    def _piece_ids(self, pieces: list[str | int], encoded: list[bytes | None]) -> list[np.ndarray]:
        out: list[np.ndarray | None] = []
        missing: list[tuple[int, str, int]] = []
        cache = self._pieces
        for j, (p, b) in enumerate(zip(pieces, encoded)):
            if isinstance(p, int):
                out.append(np.array([p], np.uint32))
                continue
            k = _xxh3(b)
            ids = cache.get(k)
            if ids is None:
                missing.append((j, p, k))
                out.append(None)
            else:
                out.append(ids)
        self.num_piece_hits += sum(b is not None for b in encoded) - len(missing)
        self.num_piece_misses += len(missing)
        if missing:
            for (j, _, k), ids in zip(missing, self.tokenizer.encode_pieces([m[1] for m in missing])):
                ids.flags.writeable = False
                cache.put(k, ids, ids.nbytes + 112)
                out[j] = ids
        return out  # type: ignore[return-value]

    def _extend(self, state: _State, ids: np.ndarray, parent: int | None) -> _State:
        num_tokens = state.num_tokens + len(ids)
        if self.max_blocks is not None and state.num_blocks >= self.max_blocks:
            return _State(parent, [], state.num_blocks, num_tokens, EMPTY_IDS, state.last)
        bs = self.block_size
        data = np.concatenate((state.tail, ids)) if len(state.tail) else ids
        n_full = len(data) // bs
        room = None if self.max_blocks is None else self.max_blocks - state.num_blocks
        hashes = hash_token_blocks(token_bytes(data[:n_full * bs]), bs, state.last, room) if n_full else []
        num_blocks = state.num_blocks + len(hashes)
        if self.max_blocks is not None and num_blocks >= self.max_blocks:
            tail = EMPTY_IDS
        else:
            tail = data[n_full * bs:].copy()  # a few tokens; a view would pin the whole piece's array
        last = hashes[-1] if hashes else state.last
        return _State(parent, hashes, num_blocks, num_tokens, tail, last)
