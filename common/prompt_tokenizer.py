"""The contract of a prompt tokenizer: how one server family turns a request's prompt into token ids (pure).

Shared by the router, which hashes prompts by token blocks (extproc/routing/tokens.py `PromptHasher`) and loads
tokenizers by name (extproc/routing/tokenizers.py `load_tokenizer`), and by whoever provides a tokenizer: the
simulated servers (model_servers/tokenizer.py `SimTokenizer`), a Hugging Face folder (extproc/routing/
tokenizers.py `HFTokenizer`) or a third party. It lives in the root package so a provider implements it without
importing the router, and the router loads a provider without importing it (the entry point group
``prefixroute.tokenizers``: extproc/routing/tokenizers.py).

`PromptTokenizer` is the protocol; `TokenizerBase` its shared parts (splitting at special tokens, the reference
whole-text and piecewise id paths, completion prompts), which an implementation subclasses and completes with
`render_chat`, `encode` and `encode_piece`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

EMPTY_IDS = np.zeros(0, dtype=np.uint32)
"""No token ids (read-only by convention: shared)."""


class TokenizationError(ValueError):
    """The prompt cannot be tokenized as the server would (a template that raises, a malformed message, a
    content part the template cannot render). The router then routes the request by its text."""


class TokenizerLoadError(ValueError):
    """`load_tokenizer` could not load the given spec (missing folder or file, unreadable JSON, an unknown or
    broken registered name)."""


def special_token_pattern(tokens: Sequence[str]) -> re.Pattern[str] | None:
    """A regex matching any of `tokens`, leftmost-longest (as HF tokenizers' added-token matcher), built as a
    trie so a scan costs about one test per character even with hundreds of tokens (Llama 3 has 256).
    None for no tokens."""
    trie: dict = {}
    for t in tokens:
        if not t:
            continue
        node = trie
        for ch in t:
            node = node.setdefault(ch, {})
        node[""] = True

    def emit(node: dict) -> str:
        alts = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch != ""]
        end = "" in node
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        # children first (longer match), then end here: leftmost-longest
        return f"(?:{body})?" if end else body

    if not trie:
        return None
    return re.compile("(" + emit(trie) + ")")


def as_prompt_ids(values: Any) -> np.ndarray:
    """A completion prompt of token ids as uint32 (ids are validated as int32 by request parsing)."""
    return np.asarray(values, dtype=np.uint32)


def add_special_tokens_of(body: Mapping[str, Any], default: bool) -> bool:
    """The body's ``add_special_tokens`` when it is a boolean (vLLM's override), else `default`."""
    v = body.get("add_special_tokens")
    return v if isinstance(v, bool) else default


class PromptTokenizer(Protocol):
    """How one server family computes a prompt's token ids. Implementations: `SimTokenizer`
    (model_servers/tokenizer.py), `HFTokenizer` (extproc/routing/tokenizers.py).

    The pieces contract (what `PromptHasher` relies on): for any text, ``encode(text, s)`` equals
    ``prefix_ids(s) + concat(encode_piece(p) or [id] for p in split(text)) + suffix_ids(s)`` when
    `segment_exact`; `split` returns text pieces (str, free of split tokens) and special-token ids (int) in order.
    """

    name: str
    """Identity of the tokenizer and template (part of every cache key)."""
    segment_exact: bool

    def render_chat(self, body: Mapping[str, Any]) -> tuple[str, bool]:
        """The chat prompt text exactly as the server renders it, and whether special tokens are added
        (the post-processor's BOS/EOS) when encoding it. Raises `TokenizationError`."""

    def completion_prompt(self, body: Mapping[str, Any]) -> tuple[str | np.ndarray, bool]:
        """The completion prompt (text, or token ids as uint32) and whether special tokens are added."""

    def split(self, text: str) -> list[str | int]: ...

    def encode_piece(self, text: str) -> np.ndarray: ...

    def encode_pieces(self, texts: list[str]) -> list[np.ndarray]: ...

    def encode(self, text: str, add_special_tokens: bool) -> np.ndarray: ...

    def prefix_ids(self, add_special_tokens: bool) -> np.ndarray: ...

    def suffix_ids(self, add_special_tokens: bool) -> np.ndarray: ...


class TokenizerBase:
    """Shared parts: splitting at special tokens, chat/completion ids from pieces (the reference path).
    A subclass sets `name`, `_split_re` and `_special_ids` and implements `render_chat`, `encode` and
    `encode_piece` (and `prefix_ids`/`suffix_ids` when encoding adds special tokens)."""

    name: str
    segment_exact: bool = True
    _split_re: re.Pattern[str] | None
    _special_ids: dict[str, int]

    def split(self, text: str) -> list[str | int]:
        if self._split_re is None or not self.segment_exact:
            return [text] if text else []
        out: list[str | int] = []
        specials = self._special_ids
        for i, piece in enumerate(self._split_re.split(text)):
            if i % 2:  # captured group: a special token
                out.append(specials[piece])
            elif piece:
                out.append(piece)
        return out

    def encode_pieces(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode_piece(t) for t in texts]

    def completion_prompt(self, body: Mapping[str, Any]) -> tuple[str | np.ndarray, bool]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a list of prompts: the first routes the request (as in text mode)
        add = add_special_tokens_of(body, True)
        if isinstance(prompt, str):
            return prompt, add
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return as_prompt_ids(prompt), add
        raise TokenizationError("'prompt' is neither a string nor token ids")

    def chat_ids(self, body: Mapping[str, Any]) -> np.ndarray:
        """Token ids of a chat body's prompt, as the server computes them (whole-text encode)."""
        text, add = self.render_chat(body)
        return self.encode(text, add)

    def completion_ids(self, body: Mapping[str, Any]) -> np.ndarray:
        """Token ids of a completion body's prompt (token ids pass through), as the server computes them."""
        prompt, add = self.completion_prompt(body)
        if isinstance(prompt, np.ndarray):
            return prompt  # vLLM takes prompt token ids as they are (no BOS added)
        return self.encode(prompt, add)

    def pieces_ids(self, text: str, add_special_tokens: bool) -> np.ndarray:
        """`encode` computed piecewise (the path the cache takes; equal to `encode` when segment_exact)."""
        parts = [self.prefix_ids(add_special_tokens)]
        for p in self.split(text):
            parts.append(np.array([p], np.uint32) if isinstance(p, int) else self.encode_piece(p))
        parts.append(self.suffix_ids(add_special_tokens))
        return np.concatenate(parts)

    # hooks
    def render_chat(self, body: Mapping[str, Any]) -> tuple[str, bool]:  # pragma: no cover - abstract
        raise NotImplementedError

    def encode(self, text: str, add_special_tokens: bool) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def encode_piece(self, text: str) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def prefix_ids(self, add_special_tokens: bool) -> np.ndarray:
        return EMPTY_IDS

    def suffix_ids(self, add_special_tokens: bool) -> np.ndarray:
        return EMPTY_IDS
