"""Deterministic offline tokenizer and Llama-3-style chat template for the simulated model servers.

Tokenizer (`encode`): the text is split at Llama 3 special tokens (``<|begin_of_text|>``,
``<|start_header_id|>`` ...), which map to their real ids (128000+); every other segment is UTF-8
encoded, zero-padded to a multiple of 4 bytes, and each 4-byte chunk maps to one id in [0, 128000)
by a multiplicative hash. So a token is ~4 characters of ASCII text, ids are stable across runs
and machines, and:

    encode(a + b)[:len(encode(a)) - 1] == encode(a)[:-1]   when a ends inside a segment
    encode(a + b)[:len(encode(a))] == encode(a)           when len(a's last segment in bytes) % 4 == 0
                                                           or a ends with a special token

i.e. a text prefix tokenizes to a prefix of the tokens except the last partial chunk. The work is a
few numpy calls per segment; no Python loop per token.

Chat template (`render_chat`): Llama 3.1 layout::

    <|begin_of_text|>[<|start_header_id|>system<|end_header_id|>\\n\\n{system + tools}<|eot_id|>]
    <|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|> ...
    [<|start_header_id|>assistant<|end_header_id|>\\n\\n]      (add_generation_prompt)

Content may be a string, None, or an array of content parts (text parts joined; image/audio parts
render as a placeholder token). Assistant ``tool_calls`` render as JSON after the content; the
``tool`` role renders as ``ipython`` like Llama 3.1. Tools render (sorted-key JSON) into the system
block, so they are part of every turn's shared prefix. Turn N+1 of a conversation (turn N's messages
+ the assistant reply + a new user message) renders to turn N's prompt without the generation prompt
as a prefix. `ChatTemplateError` carries the offending ``param`` for a 400.

`SimTokenizer`: the same tokenizer and template as the router's `PromptTokenizer` (prefixroute.prompt_tokenizer),
registered under the name ``sim`` in the entry point group ``prefixroute.tokenizers`` (pyproject.toml), so the
router loads it by name (``--tokenizer sim``) without importing this package.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np
import orjson

from prefixroute.prompt_tokenizer import TokenizationError, TokenizerBase, special_token_pattern

VOCAB_SIZE = 128256
NUM_TEXT_TOKENS = 128000
SPECIAL_TOKENS: dict[str, int] = {
    "<|begin_of_text|>": 128000,
    "<|end_of_text|>": 128001,
    "<|start_header_id|>": 128006,
    "<|end_header_id|>": 128007,
    "<|eom_id|>": 128008,
    "<|eot_id|>": 128009,
    "<|python_tag|>": 128010,
    "<|image|>": 128256 - 1,
}
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
_MULT = np.uint32(2654435761)
_SHIFT = np.uint32(15)
_SCALE = np.uint32(125)
_SCALE_SHIFT = np.uint32(7)


def _encode_segment(text: str) -> np.ndarray:
    raw = text.encode("utf-8")
    pad = -len(raw) % 4
    if pad:
        raw += b"\0" * pad
    # all in uint32 (wrapping multiply): hash to [0, 2^17), then scale by 125/128 into [0, 128000)
    return (((np.frombuffer(raw, dtype="<u4") * _MULT) >> _SHIFT) * _SCALE) >> _SCALE_SHIFT


def encode(text: str) -> np.ndarray:
    """Token ids (uint32 numpy array) of `text`; deterministic; special tokens get their Llama 3 ids."""
    if "<|" not in text:
        return _encode_segment(text) if text else np.zeros(0, np.uint32)
    parts = []
    for seg in _SPECIAL_RE.split(text):
        if not seg:
            continue
        sid = SPECIAL_TOKENS.get(seg)
        if sid is not None:
            parts.append(np.array([sid], dtype=np.uint32))
        else:
            parts.append(_encode_segment(seg))
    if not parts:
        return np.zeros(0, np.uint32)
    return np.concatenate(parts)


# Output words: deterministic generated text, ~1 token each (short words, leading space).
OUTPUT_WORDS: tuple[str, ...] = tuple(
    " " + w for w in (
        "the of and to in is it for on as with was by at be this are or from an that which not have "
        "but all were when we there can more one has been if will its so who out up about than into "
        "them some may time only two new other these then do any like also use such way our most each "
        "what part made over even well back much how where just good very"
    ).split())


def output_word(seed: int, index: int) -> str:
    """Word number `index` of the deterministic reply to a request with `seed` (e.g. its prompt length)."""
    return OUTPUT_WORDS[(seed * 31 + index * 7) % len(OUTPUT_WORDS)]


def output_text(seed: int, num_tokens: int) -> str:
    return "".join(output_word(seed, i) for i in range(num_tokens))


class ChatTemplateError(ValueError):
    """A malformed `messages` / `tools` value; `param` names the field for the OpenAI error body."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


_ROLE_NAMES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
               "tool": "ipython", "ipython": "ipython", "function": "ipython"}


def _content_text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
                continue
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ChatTemplateError("each content part must be an object with a string 'type'",
                                        f"{param}[{j}]")
            kind = part["type"]
            if kind in ("text", "input_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise ChatTemplateError("a text content part needs a string 'text'", f"{param}[{j}].text")
                out.append(text)
            elif kind in ("image_url", "input_image", "image", "audio_url", "input_audio", "video_url"):
                out.append("<|image|>")
            else:
                raise ChatTemplateError(f"unknown content part type {kind!r:.100}", f"{param}[{j}].type")
        return "".join(out)
    raise ChatTemplateError("content must be a string, an array of content parts, or null", param)


def _json(v: Any) -> str:
    return orjson.dumps(v, option=orjson.OPT_SORT_KEYS).decode()


def render_chat(messages: Sequence[Any], *, tools: Sequence[Any] | None = None,
                add_generation_prompt: bool = True) -> str:
    """Render OpenAI chat `messages` (and optional `tools`) to a Llama-3-style prompt string.

    Raises ChatTemplateError for malformed input. Pure and deterministic.
    """
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty array", "messages")
    out = ["<|begin_of_text|>"]
    system_text: str | None = None
    start = 0
    first = messages[0]
    if isinstance(first, dict) and first.get("role") in ("system", "developer"):
        system_text = _content_text(first.get("content"), "messages[0].content")
        start = 1
    if tools:
        if not isinstance(tools, list):
            raise ChatTemplateError("tools must be an array", "tools")
        lines = ["Environment: ipython", "You have access to the following functions:"]
        for j, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise ChatTemplateError("each tool must be an object", f"tools[{j}]")
            lines.append(_json(tool.get("function", tool)))
        tools_text = "\n".join(lines)
        system_text = tools_text if system_text is None else tools_text + "\n\n" + system_text
    if system_text is not None:
        out.append(f"<|start_header_id|>system<|end_header_id|>\n\n{system_text}<|eot_id|>")
    for i in range(start, len(messages)):
        m = messages[i]
        if not isinstance(m, dict):
            raise ChatTemplateError("each message must be an object", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLE_NAMES:
            raise ChatTemplateError(f"unknown or missing role {role!r:.100}", f"messages[{i}].role")
        text = _content_text(m.get("content"), f"messages[{i}].content")
        tool_calls = m.get("tool_calls")
        if tool_calls:
            if not isinstance(tool_calls, list):
                raise ChatTemplateError("tool_calls must be an array", f"messages[{i}].tool_calls")
            calls = []
            for j, call in enumerate(tool_calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ChatTemplateError("a tool call needs function.name", f"messages[{i}].tool_calls[{j}]")
                calls.append(_json({"name": fn["name"], "parameters": fn.get("arguments")}))
            text = text + "<|python_tag|>" + ";".join(calls)
        out.append(f"<|start_header_id|>{_ROLE_NAMES[role]}<|end_header_id|>\n\n{text}<|eot_id|>")
    if add_generation_prompt:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


class SimTokenizer(TokenizerBase):
    """The simulated model servers' tokenizer and Llama-3-style chat template (`encode`, `render_chat`) as a
    `PromptTokenizer`, applied as model_servers/protocol.py `prompt_ids_of` applies them: no special tokens are
    ever added by encoding. Registered as ``sim`` (module docstring)."""

    name = "sim"

    def __init__(self) -> None:
        self._special_ids = dict(SPECIAL_TOKENS)
        self._split_re = special_token_pattern(list(SPECIAL_TOKENS))

    def render_chat(self, body: Mapping[str, Any]) -> tuple[str, bool]:
        try:
            text = render_chat(body.get("messages"), tools=body.get("tools"),
                               add_generation_prompt=body.get("add_generation_prompt", True) is not False)
        except (ChatTemplateError, TypeError, AttributeError) as exc:
            raise TokenizationError(f"chat template: {exc}") from None
        return text, False

    def completion_prompt(self, body: Mapping[str, Any]) -> tuple[str | np.ndarray, bool]:
        prompt, _ = super().completion_prompt(body)
        return prompt, False  # the simulated server never adds special tokens

    def encode(self, text: str, add_special_tokens: bool) -> np.ndarray:
        return encode(text).astype(np.uint32, copy=False)

    def encode_piece(self, text: str) -> np.ndarray:
        return encode(text).astype(np.uint32, copy=False)
