"""Prompt tokenization as the servers do it, and token-block hashes of prompts with a prefix cache (pure).

The precise prefix index (fed by the servers' KV events) is keyed by chained hashes of token-id blocks
(hashing.py `hash_token_blocks`), so the router must compute the very token ids the server computes for a
request's prompt (vLLM's ``prompt_token_ids``): the chat template applied to the messages, then the tokenizer.

`PromptTokenizer` (the protocol) and its two implementations:

- `SimTokenizer`: the simulated servers' own code (model_servers/tokenizer.py `render_chat` + `encode`, the
  path model_servers/protocol.py `prompt_ids_of` takes): no BOS is added beyond what the template renders, for
  chat and completions alike; token-id prompts pass through.
- `HFTokenizer(folder)`: a local Hugging Face tokenizer folder, as vLLM loads it: ``tokenizer.json`` through
  the `tokenizers` library, the chat template from ``chat_template.jinja`` or ``tokenizer_config.json``
  (``chat_template``: a string, or the list of ``{"name", "template"}``: "tool_use" when the request has tools
  and the folder has one, else "default"), rendered with jinja2 in an immutable sandbox configured as
  transformers' ``apply_chat_template`` does (trim_blocks, lstrip_blocks, loopcontrols, a ``{% generation %}``
  tag, a ``tojson`` filter that does not escape HTML, the globals ``raise_exception`` and ``strftime_now``,
  the special tokens ``bos_token``, ``eos_token``, ... as variables). Special tokens are added as vLLM adds
  them: chat prompts with ``add_special_tokens=False`` (the template writes the BOS), completions with
  ``True`` (the tokenizer's post-processor adds it), either overridable by the body's ``add_special_tokens``.
  Messages reach the template as vLLM's "string" content format gives them (text parts joined by a newline)
  or, when the template loops over ``message['content']``, as the list of parts (vLLM's "openai" format);
  assistant ``tool_calls[].function.arguments`` JSON strings are parsed into objects as vLLM does.

`load_tokenizer(spec)`: ``"sim"`` or a folder path; `TokenizerLoadError` says what is missing.

Speed (`PromptHasher`). The rendered prompt is split at the tokenizer's special (added) tokens. HF
tokenizers split added tokens out before normalization and pre-tokenization, so tokenizing each piece on its
own and concatenating is exactly the whole-prompt encoding; the simulated tokenizer splits the same way.
Every piece (a message body, a role name, a system prompt) is cached by the xxh3 of its text (LRU of
``tokenizer_cache_entries``), and so is the *hash-chain state* after each piece, keyed by the streaming xxh3
of the whole prompt text up to that piece (plus the seed and block size): (tokens so far, block hashes of the
full blocks so far, the trailing partial block's tokens). A prompt whose leading pieces were seen before
costs one render, one split, one streaming hash and lookups; only the new pieces are tokenized and hashed.

Exactness is checked when a tokenizer loads (`PromptTokenizer.segment_exact`): a probe conversation is
encoded whole and piecewise, and tokenizers whose pre-tokenizer treats the first piece specially
(sentencepiece-style ``Metaspace`` with ``prepend_scheme: "first"``) are excluded. Where piecewise encoding is
not exact, the whole prompt is one piece: still correct, cached only for exact repeats of the whole text.
Limitation: a prompt without special tokens (a plain completion string) is one piece, so two such prompts
sharing only a leading part of it share no cached work (their hashes still share the common blocks).

Memory (issue 27): both caches are bounded in bytes as well as entries (``tokenizer_cache_entries``, and a
quarter of ``memory_budget_mb``, routing/memory.py, split between them): each entry is charged what it holds
(token ids; a state's own block hashes and tail), and a state names its parent by key, not by reference, so
an evicted state is really freed (a state whose ancestors were evicted is a miss). A piece too large for an
eighth of its cache is never cached. So prompts of any size and number cost the caches at most their budget.

Not thread-safe by design, but guarded by a lock so a second thread only waits (the router calls it from
one event loop).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import re
import threading
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import xxhash

from prefixroute.extproc.routing.hashing import hash_token_blocks, token_bytes, token_seed_for
from prefixroute.types import BlockHash

_EMPTY = np.zeros(0, dtype=np.uint32)
_xxh3 = xxhash.xxh3_64_intdigest


class TokenizationError(ValueError):
    """The prompt cannot be tokenized as the server would (a template that raises, a malformed message, a
    content part the template cannot render). The router then routes the request by its text."""


class TokenizerLoadError(ValueError):
    """`load_tokenizer` could not load the given spec (missing folder or file, unreadable JSON)."""


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


class PromptTokenizer(Protocol):
    """How one server family computes a prompt's token ids. Implementations: `SimTokenizer`, `HFTokenizer`.

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


class _Base:
    """Shared parts: splitting at special tokens, chat/completion ids from pieces (the reference path)."""

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
        add = _add_special(body, True)
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
        return _EMPTY

    def suffix_ids(self, add_special_tokens: bool) -> np.ndarray:
        return _EMPTY


def _add_special(body: Mapping[str, Any], default: bool) -> bool:
    v = body.get("add_special_tokens")
    return v if isinstance(v, bool) else default


class SimTokenizer(_Base):
    """The simulated model servers' tokenizer and Llama-3-style chat template (model_servers/tokenizer.py),
    as model_servers/protocol.py `prompt_ids_of` applies them: no special tokens are ever added by encoding."""

    name = "sim"

    def __init__(self) -> None:
        from prefixroute.model_servers import tokenizer as sim

        self._sim = sim
        self._special_ids = dict(sim.SPECIAL_TOKENS)
        self._split_re = special_token_pattern(list(sim.SPECIAL_TOKENS))

    def render_chat(self, body: Mapping[str, Any]) -> tuple[str, bool]:
        try:
            text = self._sim.render_chat(body.get("messages"), tools=body.get("tools"),
                                         add_generation_prompt=body.get("add_generation_prompt", True) is not False)
        except (self._sim.ChatTemplateError, TypeError, AttributeError) as exc:
            raise TokenizationError(f"chat template: {exc}") from None
        return text, False

    def completion_prompt(self, body: Mapping[str, Any]) -> tuple[str | np.ndarray, bool]:
        prompt, _ = super().completion_prompt(body)
        return prompt, False  # the simulated server never adds special tokens

    def encode(self, text: str, add_special_tokens: bool) -> np.ndarray:
        return self._sim.encode(text).astype(np.uint32, copy=False)

    def encode_piece(self, text: str) -> np.ndarray:
        return self._sim.encode(text).astype(np.uint32, copy=False)


# --- Hugging Face tokenizer folders ---------------------------------------------------------------------------

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]  # a serialised AddedToken
    return None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"cannot read {path}: {exc}") from None


def _compile_template(source: str):
    """A chat template compiled as transformers' ``_compile_jinja_template`` does (sandboxed)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        # transformers' AssistantTracker: {% generation %}...{% endgeneration %} marks assistant tokens; for
        # rendering it is transparent.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' override: Jinja's own tojson escapes HTML characters, which no template expects
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    template = env.from_string(source)
    return template, _loops_over_content(env, source)


def _loops_over_content(env, source: str) -> bool:
    """Whether the template iterates over ``message['content']`` (vLLM's "openai" content format detection)."""
    from jinja2 import nodes

    try:
        ast = env.parse(source)
    except Exception:  # noqa: BLE001 - compile succeeded; detection is a best effort
        return False
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        if isinstance(it, nodes.Filter):
            it = it.node
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content":
            return True
        if isinstance(it, nodes.Getattr) and it.attr == "content":
            return True
    return False


def _metaspace_first(node: Any) -> bool:
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") == "first":
            return True
        return any(_metaspace_first(v) for v in node.values())
    if isinstance(node, list):
        return any(_metaspace_first(v) for v in node)
    return False


class HFTokenizer(_Base):
    """A local Hugging Face tokenizer folder (``tokenizer.json`` + chat template), as vLLM tokenizes."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        folder = Path(path)
        if not folder.is_dir():
            raise TokenizerLoadError(f"tokenizer folder {str(folder)!r} does not exist (or is not a folder)")
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerLoadError(f"{str(tj)!r} is missing: the router reads fast-tokenizer files only "
                                     "(save one with transformers' tokenizer.save_pretrained)")
        try:
            self._tok = Tokenizer.from_file(str(tj))
        except Exception as exc:  # noqa: BLE001 - the library raises plain Exception on a malformed file
            raise TokenizerLoadError(f"cannot load {tj}: {exc}") from None
        raw = _read_json(tj)
        cfg_path = folder / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
        self.name = f"hf:{folder.resolve()}:{_xxh3(tj.read_bytes()):x}"

        templates: dict[str, str] = {}
        ct = cfg.get("chat_template")
        if isinstance(ct, str):
            templates["default"] = ct
        elif isinstance(ct, list):
            templates = {t["name"]: t["template"] for t in ct
                         if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():  # newer transformers save it beside the config, and prefer it
            templates["default"] = jinja_file.read_text(encoding="utf-8")
        elif not templates and (folder / "chat_template.json").is_file():
            ctj = _read_json(folder / "chat_template.json").get("chat_template")
            if isinstance(ctj, str):
                templates["default"] = ctj
        self._template_sources = templates
        self._templates: dict[str, Any] = {}
        self.name += f":{_xxh3(json.dumps(templates, sort_keys=True).encode()):x}"

        self._special_vars: dict[str, Any] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            text = _token_text(cfg.get(key))
            if text is not None:
                self._special_vars[key] = text
        extra = cfg.get("additional_special_tokens")
        if isinstance(extra, list):
            self._special_vars["additional_special_tokens"] = [t for t in map(_token_text, extra) if t]

        # Split at the added tokens HF matches on the raw text (normalized=False) without whitespace stripping;
        # the others are matched within each piece by the tokenizer itself.
        self._special_ids = {}
        for tid, tok in self._tok.get_added_tokens_decoder().items():
            if tok.lstrip or tok.rstrip or tok.single_word:
                continue
            if tok.normalized and self._tok.normalizer is not None:
                continue
            self._special_ids[tok.content] = tid
        self._split_re = special_token_pattern(list(self._special_ids))
        self._fast = _tiktoken_encoder(raw, self._tok, set(self._special_ids))
        self._affixes = {s: self._probe_affixes(s) for s in (False, True)}
        self.segment_exact = (not getattr(self._tok, "encode_special_tokens", False)
                              and not _metaspace_first(raw.get("pre_tokenizer"))
                              and not _metaspace_first(raw.get("normalizer"))
                              and all(a is not None for a in self._affixes.values()))
        if self.segment_exact:
            self.segment_exact = self._probe_exact()
        if not self.segment_exact and self._fast is not None:
            self._fast = None  # the probe failed with tiktoken pieces: try plain HF pieces
            self.segment_exact = self._probe_exact()

    @property
    def fast_path(self) -> bool:
        """Whether pieces are encoded by tiktoken (verified equal to the HF tokenizer at load)."""
        return self._fast is not None

    def _probe_affixes(self, add: bool) -> tuple[np.ndarray, np.ndarray] | None:
        """The post-processor's tokens before and after the text, or None if they cannot be told apart."""
        probe = "probe text 12"
        bare = self._tok.encode(probe, add_special_tokens=False).ids
        full = self._tok.encode(probe, add_special_tokens=add).ids
        n = len(bare)
        for i in range(len(full) - n + 1):
            if full[i:i + n] == bare:
                return np.array(full[:i], np.uint32), np.array(full[i + n:], np.uint32)
        return None

    def _probe_exact(self) -> bool:
        specials = list(self._special_ids)[:8]
        texts = ["Hello world", " leading space\n\n", "tabs\tand  spaces ", "x"]
        for sp in specials:
            texts.append(f"{sp}system{sp}\n\nYou are helpful.{sp} trailing")
            texts.append(f"word{sp}{sp} 123 {sp}\n")
        try:
            texts.append(self.render_chat({"messages": [
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there!\n"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Why?"}]})[0])
        except TokenizationError:
            pass
        for t in texts:
            for add in (False, True):
                if not np.array_equal(self.encode(t, add), self.pieces_ids(t, add)):
                    return False
        return True

    def _template(self, has_tools: bool):
        name = "tool_use" if has_tools and "tool_use" in self._template_sources else "default"
        if name not in self._template_sources:
            if len(self._template_sources) == 1:
                name = next(iter(self._template_sources))
            else:
                raise TokenizationError("the tokenizer folder has no chat template (tokenizer_config.json "
                                        "chat_template or chat_template.jinja)")
        compiled = self._templates.get(name)
        if compiled is None:
            try:
                compiled = self._templates[name] = _compile_template(self._template_sources[name])
            except Exception as exc:  # noqa: BLE001 - a template that does not compile: text-mode routing
                raise TokenizationError(f"chat template {name!r} does not compile: {exc}") from None
        return compiled

    def render_chat(self, body: Mapping[str, Any]) -> tuple[str, bool]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise TokenizationError("'messages' must be a non-empty list")
        tools = body.get("tools") or None
        template, openai_format = self._template(bool(tools))
        conversation = [_vllm_message(m, openai_format) for m in messages]
        add_generation_prompt = body.get("add_generation_prompt", True) is not False
        continue_final = body.get("continue_final_message") is True
        if continue_final:
            add_generation_prompt = False
        kwargs = body.get("chat_template_kwargs")
        kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
        variables = {**self._special_vars, **kwargs, "messages": conversation, "tools": tools,
                     "documents": body.get("documents"), "add_generation_prompt": add_generation_prompt}
        try:
            text = template.render(**variables)
        except Exception as exc:  # noqa: BLE001 - templates raise anything (raise_exception, TypeError, ...)
            raise TokenizationError(f"chat template: {exc}") from None
        if continue_final:
            text = _continue_final(text, conversation[-1])
        return text, _add_special(body, False)

    def encode(self, text: str, add_special_tokens: bool) -> np.ndarray:
        return np.array(self._tok.encode(text, add_special_tokens=add_special_tokens).ids, np.uint32)

    def encode_piece(self, text: str) -> np.ndarray:
        return self.encode_pieces([text])[0]

    def encode_pieces(self, texts: list[str]) -> list[np.ndarray]:
        fast = self._fast
        if fast is not None:
            enc, nfc = fast
            if nfc:
                texts = [t if t.isascii() else unicodedata.normalize("NFC", t) for t in texts]
            return [np.array(enc.encode_ordinary(t), np.uint32) for t in texts]
        # encode_batch_fast: no offsets (a third of the cost), and the batch runs in parallel in Rust
        return [np.array(e.ids, np.uint32) for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def prefix_ids(self, add_special_tokens: bool) -> np.ndarray:
        a = self._affixes[add_special_tokens]
        return a[0] if a is not None else _EMPTY

    def suffix_ids(self, add_special_tokens: bool) -> np.ndarray:
        a = self._affixes[add_special_tokens]
        return a[1] if a is not None else _EMPTY


_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode (ByteLevel's byte -> printable character map)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _tiktoken_encoder(raw: dict, tok: Any, split_tokens: set[str]):
    """A tiktoken encoder equal to this tokenizer on text without added tokens, or None.

    HF tokenizers spend most of an encode in their alignment-tracking pre-tokenizer (about 1.5 MB/s here, ~25 ms
    for 8k tokens); tiktoken runs the same byte-level BPE ~15x faster. Taken only for the family it models
    exactly: a BPE model (no dropout, no unknown token, no continuing-subword prefix) over a byte-level
    alphabet, pre-tokenized by one isolated regex split (Llama 3, Qwen 2/3, GPT-4-style) or GPT-2's ByteLevel
    regex, no normalizer (or NFC, applied here), every added token among the split tokens. Merge ranks must grow
    with the merge list (so merging by rank is merging by priority); the load-time probe (`_probe_exact`)
    compares it with HF's own encode and drops it on any difference. Without tiktoken installed: None.
    """
    try:
        import tiktoken
    except ImportError:
        return None
    model = raw.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix") or model.get("byte_fallback"):
        return None
    norm = raw.get("normalizer")
    nfc = False
    if norm is not None:
        if norm.get("type") != "NFC":
            return None
        nfc = True
    pre = raw.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    pattern = None
    if len(parts) == 2 and parts[0].get("type") == "Split" and parts[1].get("type") == "ByteLevel":
        split, bl = parts
        if split.get("behavior") != "Isolated" or split.get("invert") or bl.get("use_regex", True) \
                or bl.get("add_prefix_space"):
            return None
        pat = split.get("pattern") or {}
        pattern = pat.get("Regex") if "Regex" in pat else (re.escape(pat["String"]) if "String" in pat else None)
    elif len(parts) == 1 and parts[0].get("type") == "ByteLevel":
        if parts[0].get("add_prefix_space") or not parts[0].get("use_regex", True):
            return None
        pattern = _GPT2_PATTERN
    if pattern is None:
        return None
    if any(t.content not in split_tokens for t in tok.get_added_tokens_decoder().values()):
        return None
    vocab = model.get("vocab") or {}
    dec = _byte_decoder()
    try:
        ranks = {bytes(dec[ch] for ch in token): rank for token, rank in vocab.items()}
    except KeyError:  # a token outside the byte-level alphabet
        return None
    if len(ranks) != len(vocab):
        return None
    last = -1
    for merge in model.get("merges") or []:
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank = vocab.get(a + b)
        if rank is None or rank <= last:
            return None
        last = rank
    try:
        enc = tiktoken.Encoding("prefixroute-probe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    except Exception:  # noqa: BLE001 - a pattern its regex engine does not take
        return None
    return enc, nfc


def _vllm_message(m: Any, openai_format: bool) -> dict[str, Any]:
    """One OpenAI message as vLLM hands it to the template (its chat_utils parsing, text content only)."""
    if not isinstance(m, dict):
        raise TokenizationError("each message must be an object")
    out = dict(m)
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text") \
                    and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:  # images and audio: their placeholders are model-specific; route by text instead
                raise TokenizationError("non-text content parts are not tokenized by the router")
        out["content"] = [{"type": "text", "text": t} for t in texts] if openai_format else "\n".join(texts)
    elif openai_format:  # vLLM's "openai" format: a string is one text part, null none
        out["content"] = [] if content is None else [{"type": "text", "text": content}]
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        fixed = []
        for call in calls:
            if isinstance(call, dict) and isinstance(call.get("function"), dict) \
                    and isinstance(call["function"].get("arguments"), str):
                fn = dict(call["function"])
                try:  # vLLM: templates expect the arguments as an object, OpenAI sends a JSON string
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
                call = {**call, "function": fn}
            fixed.append(call)
        out["tool_calls"] = fixed
    return out


def _continue_final(text: str, last: dict[str, Any]) -> str:
    """transformers' continue_final_message: cut the rendered prompt right after the final message's content."""
    content = last.get("content")
    if isinstance(content, list):
        content = content[-1].get("text", "") if content and isinstance(content[-1], dict) else ""
    content = (content or "").strip()
    idx = text.rfind(content) if content else -1
    if idx < 0:
        raise TokenizationError("continue_final_message: the final message is not in the rendered prompt")
    return text[:idx + len(content)]


def load_tokenizer(spec: str) -> PromptTokenizer:
    """``"sim"`` -> `SimTokenizer`; anything else is a tokenizer folder -> `HFTokenizer` (raises
    `TokenizerLoadError` naming the missing folder or file)."""
    if spec == "sim":
        return SimTokenizer()
    if not spec:
        raise TokenizerLoadError("no tokenizer given: use 'sim' or a tokenizer folder path")
    return HFTokenizer(spec)


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
            state, hashes = _State(None, [], 0, 0, _EMPTY, seed), []
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
            return _State(parent, [], state.num_blocks, num_tokens, _EMPTY, state.last)
        bs = self.block_size
        data = np.concatenate((state.tail, ids)) if len(state.tail) else ids
        n_full = len(data) // bs
        room = None if self.max_blocks is None else self.max_blocks - state.num_blocks
        hashes = hash_token_blocks(token_bytes(data[:n_full * bs]), bs, state.last, room) if n_full else []
        num_blocks = state.num_blocks + len(hashes)
        if self.max_blocks is not None and num_blocks >= self.max_blocks:
            tail = _EMPTY
        else:
            tail = data[n_full * bs:].copy()  # a few tokens; a view would pin the whole piece's array
        last = hashes[-1] if hashes else state.last
        return _State(parent, hashes, num_blocks, num_tokens, tail, last)
