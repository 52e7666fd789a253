"""Request understanding: an OpenAI-style HTTP request -> `InferenceRequest` (pure; no I/O).

The prompt is rendered to a *canonical text* and hashed in blocks (hashing.py). Rendering, not hashing the raw
JSON, gives the two properties routing needs:

- Hashes do not depend on JSON key order, whitespace or escapes (orjson parses; we render values).
- Prefix property: turn N+1 of a chat (turn N's messages + more) renders to a text that starts with turn N's
  text, so a growing conversation keeps its affinity. Completion prompts that extend a prompt likewise.

Canonical text (chat)::

    <|tools|>{tools as sorted-key compact JSON}\n        (only if "tools" is non-empty; templates render them first)
    <|ROLE|>[name=NAME\n]CONTENT[<|tool_calls|>JSON][<|tool_call_id|>ID]\n      (per message, in order)

where CONTENT is the string, or the concatenation of content parts: text parts as their text, ``image_url``
as ``<|image:HASH|>`` (xxh3 of the URL: a stable placeholder, distinct per image like the image tokens a real
server caches), other part types as ``<|TYPE:HASH|>`` of their canonical JSON. Completions: the string
prompt, or ``<|ids|>`` + ``"id,"`` per token id; for a list of prompts the first one routes the request.

Work is bounded: rendering stops after ``max_blocks * block_chars`` characters, so beyond JSON parsing a 1 MB
prompt costs about what a 16 KB one does. All messages are still type-checked, so whether a request is
accepted never depends on its length.

Errors (all `OpenAIError`, the only exception `parse_request` raises):
413 body over ``max_body_bytes`` (any path); 405 a method other than POST on a completion path; 400 body not
JSON / not an object / a field missing or of the wrong type, with ``param`` naming it (``messages[2].content``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import orjson
import xxhash

from prefixroute.openai_errors import OpenAIError
from prefixroute.extproc.routing.hashing import hash_blocks, seed_for
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing.types import BlockHash, RequestKind

CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATH = "/v1/completions"
KNOWN_PATHS: dict[str, RequestKind] = {CHAT_PATH: "chat", COMPLETION_PATH: "completion"}
REQUEST_ID_HEADER = "x-request-id"

_xxh3_hex = xxhash.xxh3_64_hexdigest


@dataclasses.dataclass(slots=True)
class InferenceRequest:
    """What the router needs to know about one request.

    `block_hashes` is empty for kind "other" and for prompts shorter than one block. `tenant` names the tenant
    (header value, ``prompt_cache_key``, or both joined by U+001F), None without one. Both salt the hashes,
    kept apart: header tenant "a" and ``prompt_cache_key`` "a" share no hash.
    `num_prompt_chars` counts the characters of prompt content (text, not JSON), including any beyond the
    hashed prefix.
    """

    kind: RequestKind
    path: str
    model: str | None = None
    tenant: str | None = None
    stream: bool = False
    block_hashes: list[BlockHash] = dataclasses.field(default_factory=list)
    num_prompt_chars: int = 0
    request_id: str | None = None


def _bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


class _Canon:
    """Accumulates canonical text up to `limit` characters; beyond it only counts characters."""

    __slots__ = ("parts", "size", "limit", "num_chars")

    def __init__(self, limit: int) -> None:
        self.parts: list[str] = []
        self.size = 0
        self.limit = limit
        self.num_chars = 0  # prompt content characters, all of them

    @property
    def full(self) -> bool:
        return self.size >= self.limit

    def add(self, s: str) -> None:
        room = self.limit - self.size
        if room <= 0:
            return
        if len(s) > room:
            s = s[:room]
        self.parts.append(s)
        self.size += len(s)

    def text(self) -> str:
        return "".join(self.parts)


def _canonical_json(value: Any, param: str) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError as exc:  # orjson.JSONEncodeError: nesting deeper than orjson serialises
        raise _bad(f"'{param}' cannot be serialised: {exc}", param) from None


def _render_content(content: Any, canon: _Canon, param: str) -> None:
    if isinstance(content, str):
        canon.num_chars += len(content)
        canon.add(content)
        return
    if content is None:
        return
    if not isinstance(content, list):
        raise _bad(f"'{param}' must be a string, a list of content parts or null", param)
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _bad(f"'{p}' must be an object", p)
        ptype = part.get("type")
        if not isinstance(ptype, str):
            raise _bad(f"'{p}.type' must be a string", f"{p}.type")
        if ptype == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"'{p}.text' must be a string", f"{p}.text")
            canon.num_chars += len(text)
            canon.add(text)
        elif ptype == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise _bad(f"'{p}.image_url.url' must be a string", f"{p}.image_url")
            if not canon.full:
                canon.add(f"<|image:{_xxh3_hex(url.encode('utf-8', 'surrogatepass'))}|>")
        elif not canon.full:
            canon.add(f"<|{ptype}:{_xxh3_hex(_canonical_json(part, p).encode('utf-8', 'surrogatepass'))}|>")


def _render_chat(body: dict[str, Any], canon: _Canon) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("'tools' must be a list", "tools")
        if tools:
            canon.add("<|tools|>")
            canon.add(_canonical_json(tools, "tools"))
            canon.add("\n")
    messages = body.get("messages")
    if messages is None:
        raise _bad("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    for i, msg in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad(f"'{param}' must be an object", param)
        role = msg.get("role")
        if not isinstance(role, str):
            raise _bad(f"'{param}.role' must be a string", f"{param}.role")
        name = msg.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad(f"'{param}.name' must be a string", f"{param}.name")
        tool_calls = msg.get("tool_calls")
        if tool_calls is not None and not isinstance(tool_calls, list):
            raise _bad(f"'{param}.tool_calls' must be a list", f"{param}.tool_calls")
        tool_call_id = msg.get("tool_call_id")
        if tool_call_id is not None and not isinstance(tool_call_id, str):
            raise _bad(f"'{param}.tool_call_id' must be a string", f"{param}.tool_call_id")
        canon.add(f"<|{role}|>")
        if name:
            canon.add(f"name={name}\n")
        _render_content(msg.get("content"), canon, f"{param}.content")
        if tool_calls and not canon.full:
            canon.add("<|tool_calls|>")
            canon.add(_canonical_json(tool_calls, f"{param}.tool_calls"))
        if tool_call_id is not None:
            canon.add(f"<|tool_call_id|>{tool_call_id}")
        canon.add("\n")


def _is_token_ids(value: list[Any]) -> bool:
    return all(type(t) is int for t in value)  # noqa: E721 - bool is an int subclass and is not a token id


def _render_completion(body: dict[str, Any], canon: _Canon) -> None:
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("'prompt' is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        canon.num_chars += len(prompt)
        canon.add(prompt)
        return
    if not isinstance(prompt, list) or not prompt:
        raise _bad("'prompt' must be a string, a list of strings, a list of token ids or a list of lists of "
                   "token ids, and not empty", "prompt")
    first = prompt[0]
    if isinstance(first, str):
        if not all(isinstance(p, str) for p in prompt):
            raise _bad("'prompt' mixes strings with other types", "prompt")
        canon.num_chars += len(first)
        canon.add(first)
        return
    if type(first) is int:  # noqa: E721
        ids = prompt
    elif isinstance(first, list):
        if not all(isinstance(p, list) and p and _is_token_ids(p) for p in prompt):
            raise _bad("'prompt' must be a list of non-empty lists of integer token ids", "prompt")
        ids = first
    else:
        raise _bad("'prompt' must be a string, a list of strings or token ids", "prompt")
    if not _is_token_ids(ids):
        raise _bad("'prompt' token ids must all be integers", "prompt")
    canon.num_chars += len(ids)
    canon.add("<|ids|>")
    # Each id renders to >= 2 characters ("7,"), so limit // 2 ids fill the hashed prefix; the trailing comma
    # keeps the prefix property (ids [1, 2] must not render as a prefix of [1, 23]).
    canon.add(",".join(map(str, ids[: canon.limit // 2])) + ",")


def parse_request(method: str, path: str, headers: Mapping[str, str], body: bytes,
                  settings: RoutingSettings) -> InferenceRequest:
    """Understand one request. `headers` keys must be lower case (HTTP/2 and Envoy's ext_proc give them so).

    Raises only `OpenAIError` (413, 405, 400; see module docstring). Paths other than the two completion APIs
    (query string ignored) give kind "other" with no hashes; their body is not parsed.
    """
    if len(body) > settings.max_body_bytes:
        raise OpenAIError(413, f"request body of {len(body)} bytes exceeds the limit of "
                               f"{settings.max_body_bytes} bytes")
    path = path.split("?", 1)[0]
    request_id = headers.get(REQUEST_ID_HEADER)
    kind = KNOWN_PATHS.get(path)
    if kind is None:
        return InferenceRequest(kind="other", path=path, request_id=request_id)
    if method.upper() != "POST":
        raise OpenAIError(405, f"method {method} is not allowed on {path}; use POST")
    if not body:
        raise _bad("request body is empty; expected a JSON object")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _bad("request body must be a JSON object")

    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    cache_key = data.get("prompt_cache_key")
    if cache_key is not None and not isinstance(cache_key, str):
        raise _bad("'prompt_cache_key' must be a string", "prompt_cache_key")
    header_tenant = headers.get(settings.tenant_header) if settings.tenant_header else None
    if header_tenant and cache_key:
        tenant: str | None = f"{header_tenant}\x1f{cache_key}"
    else:
        tenant = header_tenant or cache_key or None
    # The salt keeps the two sources apart: prompt_cache_key "a" (client-chosen) must not land in the routing
    # state of header tenant "a" (set by a trusted ingress); the length prefix makes the pair unambiguous.
    salt = f"{len(header_tenant or '')}:{header_tenant or ''}|{cache_key or ''}" if tenant else None

    canon = _Canon(settings.max_prompt_chars)
    if kind == "chat":
        _render_chat(data, canon)
    else:
        _render_completion(data, canon)
    hashes = hash_blocks(canon.text(), seed_for(model, salt), settings.block_chars, settings.max_blocks)
    return InferenceRequest(kind=kind, path=path, model=model, tenant=tenant, stream=bool(stream),
                            block_hashes=hashes, num_prompt_chars=canon.num_chars, request_id=request_id)


def canonical_text(body: Mapping[str, Any], kind: RequestKind, limit_chars: int) -> str:
    """The canonical prompt text of a parsed body (for tests and debugging; `parse_request` uses the same)."""
    canon = _Canon(limit_chars)
    if kind == "chat":
        _render_chat(dict(body), canon)
    elif kind == "completion":
        _render_completion(dict(body), canon)
    return canon.text()
