"""Request understanding: an OpenAI-style HTTP request -> `InferenceRequest` (pure; no I/O).

`parse_request` checks the envelope (size, path, method, encoding, JSON), the body's fields as vLLM refuses
them (request_fields.py), renders the prompt to a *canonical text* within the parse budgets
(request_prompt.py) and hashes it in blocks (hashing.py). Rendering, not hashing the raw JSON, gives the two
properties routing needs:

- Hashes do not depend on JSON key order, whitespace or escapes (orjson parses; we render values).
- Prefix property: turn N+1 of a chat (turn N's messages + more) renders to a text that starts with turn N's
  text, so a growing conversation keeps its affinity. Completion prompts that extend a prompt likewise.

Token mode (`parse_request(..., tokenizer=PromptHasher)`, ``--tokenizer sim`` or a tokenizer folder): the
prompt is also tokenized exactly as the server does (routing/tokenizers.py) and `block_hashes` are then the
chained hashes of its ``kv_block_tokens``-token blocks, seeded by ``token_seed_for(lora_name, cache_salt)``:
``lora_name`` is the request's model when the caller names it an adapter (`adapters`), ``cache_salt`` the
body's ``cache_salt`` (vLLM's field; a non-string is ignored). The header tenant and ``prompt_cache_key`` do
not salt token hashes: those must name the blocks the server actually caches, which only ``cache_salt``
separates. `num_prompt_tokens` is then the exact prompt length in tokens. A prompt the tokenizer cannot
handle (a template that raises, an image part) falls back to text mode for that request
(`num_prompt_tokens` None), never to an error: validation and its 400s are the same in both modes.

Work is bounded: rendering stops after ``max_blocks * block_chars`` characters, so beyond JSON parsing a 1 MB
prompt costs about what a 16 KB one does. All messages are still type-checked, so whether a request is
accepted never depends on its length.

Errors (all `OpenAIError`, the only exception `parse_request` raises):
413 body over ``max_body_bytes`` (any path); 405 a method other than POST on a completion path; 415 a
``content-encoding`` other than ``identity`` on a completion path (the body would be parsed as compressed
bytes); 400 body not JSON / not an object / a field missing, of the wrong type or out of range, with
``param`` naming it (``messages[2].content``, ``top_logprobs``). A value echoed in a message is clipped
(`clip`), so a 1 MB model name never becomes a 1 MB error.
Which sampling fields are checked, and how: request_fields.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Container, Mapping
from typing import Any

import orjson

from prefixroute import responses_prompt
from prefixroute.openai_errors import OpenAIError
from prefixroute.extproc.routing.hashing import hash_blocks, seed_for
from prefixroute.extproc.routing.request_errors import MAX_ECHO_CHARS, bad_request, clip
from prefixroute.extproc.routing.request_fields import MAX_LOGPROBS, check_fields
from prefixroute.extproc.routing.request_prompt import (MAX_TOKEN_ID, CanonicalText, render_chat, render_completion,
                                                        render_tools, responses_chat_body)
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing.text_hash_cache import TextHashCache
from prefixroute.extproc.routing.tokens import PromptHasher
from prefixroute.types import BlockHash, RequestKind

__all__ = ["CHAT_PATH", "COMPLETION_PATH", "KNOWN_PATHS", "MAX_ECHO_CHARS", "MAX_KEY_CHARS", "MAX_LOGPROBS",
           "MAX_MODEL_CHARS", "MAX_RESPONSE_ID_CHARS", "MAX_SESSION_KEY_CHARS", "MAX_TOKEN_ID", "REQUEST_ID_HEADER",
           "InferenceRequest", "bounded_key", "canonical_text", "clip", "next_request_key", "parse_request"]

CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATH = "/v1/completions"
KNOWN_PATHS: dict[str, RequestKind] = {CHAT_PATH: "chat", COMPLETION_PATH: "completion",
                                       responses_prompt.RESPONSES_PATH: "responses"}
REQUEST_ID_HEADER = "x-request-id"
MAX_KEY_CHARS = 256
"""Longest client-supplied identifier the router keeps as written: the tenant (header value and
``prompt_cache_key``, each), the session key and the request id. A longer one is kept as its first
``MAX_KEY_CHARS - 33`` characters, ``~`` and a 128-bit BLAKE2b digest of the whole value (`bounded_key`):
still distinct per value, never longer. An identifier is short (a UUID is 36 characters), and the router's
tables hold one per conversation or request, so a 7 MiB ``prompt_cache_key`` must not become a 7 MiB key."""
MAX_SESSION_KEY_CHARS = MAX_KEY_CHARS
"""Kept for callers of the former name (session keys follow `MAX_KEY_CHARS`)."""
MAX_MODEL_CHARS = 1024
"""Longest ``model`` accepted (400 beyond): Hugging Face repository ids are at most 96 characters and local
model paths a few hundred; no server serves a longer name, and the router keeps the name with each request."""
MAX_RESPONSE_ID_CHARS = 256
"""Longest Responses API id looked up: vLLM's ids are ``resp_`` and 32 hex digits; a longer id is answered
with vLLM's own 404 at once (no server holds it), without asking every endpoint for it."""


def bounded_key(value: str, limit: int = MAX_KEY_CHARS) -> str:
    """`value` when it has at most `limit` characters, else its first ``limit - 33`` characters, ``~`` and
    the hex BLAKE2b-128 digest of all of it (exactly `limit` characters). Deterministic across processes
    (replicas agree on it); a value is hashed once, at parse time, never kept raw."""
    if len(value) <= limit:
        return value
    digest = hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return f"{value[:limit - 33]}~{digest}"


@dataclasses.dataclass(slots=True)
class InferenceRequest:
    """What the router needs to know about one request.

    `block_hashes` is empty for kind "other" and for prompts shorter than one block. `tenant` names the tenant
    (header value, ``prompt_cache_key``, or both joined by U+001F), None without one. Both salt the hashes,
    kept apart: header tenant "a" and ``prompt_cache_key`` "a" share no hash.
    `num_prompt_chars` counts the characters of prompt content (text, not JSON), including any beyond the
    hashed prefix.
    `num_prompt_tokens` is None in text mode (no tokenizer, or the tokenizer failed on this prompt): then
    `block_hashes` are text-block hashes. An int means token mode: `block_hashes` are token-block hashes
    (routing/tokens.py) and the prompt has exactly that many tokens. The two kinds of hash never mix.
    """

    kind: RequestKind
    path: str
    model: str | None = None
    tenant: str | None = None
    stream: bool = False
    block_hashes: list[BlockHash] = dataclasses.field(default_factory=list)
    num_prompt_chars: int = 0
    num_prompt_tokens: int | None = None  # exact prompt tokens when the router tokenizes (token blocks), else None
    request_id: str | None = None
    # Conversation state. `session_key`: the chat session this request continues (RoutingSettings.
    # session_key names its source), None without one. `response_ref`: the Responses API response this
    # request needs (the body's previous_response_id, or the {id} of GET /v1/responses/{id}...): only the
    # endpoint that produced it holds it, so such a request is pinned there, never rerouted.
    session_key: str | None = None
    response_ref: str | None = None
    # A pinned Responses follow-up: prompt tokens its endpoint is known to hold (the previous request's prompt,
    # from its usage), which its own hashes cannot show; None otherwise. Set by the service, read by predictions.
    known_prefix_tokens: int | None = None
    # Unique per request in this process (never reused, unlike id()): what the policy's tables key a pick by,
    # so they need not keep the request (its block hashes) alive while a late report may still come.
    key: int = dataclasses.field(default_factory=lambda: next(_REQUEST_KEYS), compare=False, repr=False)


_REQUEST_KEYS = itertools.count(1)


def next_request_key() -> int:
    """A fresh `InferenceRequest.key` (for a request parsed in another process)."""
    return next(_REQUEST_KEYS)


def parse_request(method: str, path: str, headers: Mapping[str, str], body: bytes,
                  settings: RoutingSettings, tokenizer: PromptHasher | None = None,
                  adapters: Container[str] | None = None,
                  text_cache: TextHashCache | None = None) -> InferenceRequest:
    """Understand one request. `headers` keys must be lower case (HTTP/2 and Envoy's ext_proc give them so).

    `tokenizer` (built once: ``PromptHasher.from_settings(settings)``) selects token mode (module docstring);
    None keeps text mode. `adapters`: the model names that are LoRA adapters (a set, or any container such as
    a live view of the pool's served adapters); a request for one is hashed with ``lora_name`` = its model, as
    vLLM keys its blocks. None: every model is a base model. `text_cache` (built once:
    ``TextHashCache.from_settings(settings)``): text blocks with the spans seen before cached, the same hashes
    as without it.

    Raises only `OpenAIError` (413, 405, 400; see module docstring). Paths other than the two completion APIs
    (query string ignored) give kind "other" with no hashes; their body is not parsed.
    """
    if len(body) > settings.max_body_bytes:
        raise OpenAIError(413, f"request body of {len(body)} bytes exceeds the limit of "
                               f"{settings.max_body_bytes} bytes")
    path = path.split("?", 1)[0]
    request_id = headers.get(REQUEST_ID_HEADER)
    if request_id is not None:
        request_id = bounded_key(request_id)
    kind = KNOWN_PATHS.get(path)
    if kind is None:
        ref = responses_prompt.path_response_id(path)
        if ref is not None:
            _check_response_id(ref)
        return InferenceRequest(kind="other", path=path, request_id=request_id, response_ref=ref)
    data = _json_body(method, path, headers, body)
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    if model is not None and len(model) > MAX_MODEL_CHARS:
        raise bad_request(f"'model' has {len(model)} characters; model names are at most {MAX_MODEL_CHARS}",
                          "model")
    check_fields(data, kind)
    stream = data.get("stream")
    tenant, salt = _tenant(settings, headers, data)
    session_key = _session_key(settings, headers, data)
    canon = CanonicalText(settings.max_prompt_chars, settings)
    chat_body, response_ref = _render_prompt(data, kind, canon)
    # A follow-up's prompt continues with a stored chain the router cannot see: its token rendering (the
    # template would close the conversation after the instructions) is not a prefix of the real prompt, so it
    # is hashed by text, whose full blocks of the visible head are exactly the real prompt's.
    if tokenizer is not None and response_ref is None:
        blocks = _token_blocks(tokenizer, data if chat_body is None else chat_body, kind, model, adapters,
                               data.get("cache_salt"))
        if blocks is not None:
            return InferenceRequest(kind=kind, path=path, model=model, tenant=tenant, stream=bool(stream),
                                    block_hashes=blocks.block_hashes, num_prompt_chars=canon.num_chars,
                                    request_id=request_id, num_prompt_tokens=blocks.num_prompt_tokens,
                                    session_key=session_key)
    if text_cache is not None:
        hashes = text_cache.hash_blocks(canon.text(), seed_for(model, salt))
    else:
        hashes = hash_blocks(canon.text(), seed_for(model, salt), settings.block_chars, settings.max_blocks)
    return InferenceRequest(kind=kind, path=path, model=model, tenant=tenant, stream=bool(stream),
                            block_hashes=hashes, num_prompt_chars=canon.num_chars, request_id=request_id,
                            session_key=session_key, response_ref=response_ref)


def _json_body(method: str, path: str, headers: Mapping[str, str], body: bytes) -> dict[str, Any]:
    """The JSON object of a request to a completion path: 405 for a method other than POST, 415 for a
    compressed body, 400 for a body that is empty, not JSON or not an object."""
    if method.upper() != "POST":
        raise OpenAIError(405, f"method {clip(method)} is not allowed on {clip(path)}; use POST")
    encoding = headers.get("content-encoding")
    if encoding and encoding.strip().lower() != "identity":
        # The body would reach JSON parsing compressed (and fail as "not valid UTF-8"): say what is wrong.
        raise OpenAIError(415, f"unsupported content-encoding {clip(encoding)!r}: send the request body "
                               "uncompressed (identity)")
    if not body:
        raise bad_request("request body is empty; expected a JSON object")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {clip(str(exc))}") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    return data


def _tenant(settings: RoutingSettings, headers: Mapping[str, str],
            data: dict[str, Any]) -> tuple[str | None, str | None]:
    """(the request's tenant, the salt of its text hashes): the header tenant and ``prompt_cache_key``, each
    bounded (`MAX_KEY_CHARS`: kept with the request by sessions, the policy's tables, telemetry), joined by
    U+001F when both are set; (None, None) without either."""
    cache_key = data.get("prompt_cache_key")
    if cache_key:
        cache_key = bounded_key(cache_key)
    header_tenant = headers.get(settings.tenant_header) if settings.tenant_header else None
    if header_tenant:
        header_tenant = bounded_key(header_tenant)
    if header_tenant and cache_key:
        tenant: str | None = f"{header_tenant}\x1f{cache_key}"
    else:
        tenant = header_tenant or cache_key or None
    # The salt keeps the two sources apart: prompt_cache_key "a" (client-chosen) must not land in the routing
    # state of header tenant "a" (set by a trusted ingress); the length prefix makes the pair unambiguous.
    salt = f"{len(header_tenant or '')}:{header_tenant or ''}|{cache_key or ''}" if tenant else None
    return tenant, salt


def _render_prompt(data: dict[str, Any], kind: RequestKind,
                   canon: CanonicalText) -> tuple[dict[str, Any] | None, str | None]:
    """Render the prompt of a body of `kind` into `canon` (validating it): (the chat body that token mode
    tokenizes, None for a completion; the Responses API response it continues, None otherwise)."""
    if kind == "chat":
        render_chat(data, canon)
        return data, None
    if kind == "responses":
        inp = data.get("input")
        if isinstance(inp, list):
            canon.count_messages(len(inp), "input")
        chat_body, response_ref = responses_chat_body(data)
        if response_ref is not None:
            _check_response_id(response_ref)
        if chat_body["messages"]:
            render_chat(chat_body, canon)
        else:  # input [] without instructions: nothing to hash (vLLM renders an empty conversation)
            render_tools(chat_body.get("tools"), canon)
        return chat_body, response_ref
    render_completion(data, canon)
    return None, None


def _session_key(settings: RoutingSettings, headers: Mapping[str, str], data: dict[str, Any]) -> str | None:
    """The session key named by ``settings.session_key`` (None when absent or empty), clipped to
    `MAX_SESSION_KEY_CHARS`. Body fields were type-checked already (``user``, ``prompt_cache_key``: strings)."""
    source = settings.session_key
    if source == "header":
        key = headers.get(settings.session_header) if settings.session_header else None
    elif source == "user" or source == "prompt_cache_key":
        key = data.get(source)
    else:
        return None
    if not key or not isinstance(key, str):
        return None
    return bounded_key(key)


def _check_response_id(response_id: str) -> None:
    """vLLM's 400 for an id without its prefix; its 404 for one longer than `MAX_RESPONSE_ID_CHARS` (no server
    issues such ids, so no lookup is spent on it and the id is never stored)."""
    if not response_id.startswith(responses_prompt.RESPONSE_ID_PREFIX):
        raise responses_prompt.invalid_id(response_id)
    if len(response_id) > MAX_RESPONSE_ID_CHARS:
        raise responses_prompt.not_found(response_id)


def _token_blocks(tokenizer: PromptHasher, data: dict[str, Any], kind: RequestKind, model: str | None,
                  adapters: Container[str] | None, salt: Any):
    """Token blocks of a validated body (for kind "responses": its chat body), or None when the tokenizer
    cannot handle it (text-mode fallback). `salt`: the request body's ``cache_salt`` (a Responses request's
    ``prompt_cache_key`` is not one: vLLM ignores that field)."""
    lora_name = model if model is not None and adapters is not None and model in adapters else None
    cache_salt = salt if isinstance(salt, str) else None
    try:
        if kind == "chat" or kind == "responses":
            return tokenizer.chat_blocks(data, lora_name=lora_name, cache_salt=cache_salt)
        return tokenizer.completion_blocks(data, lora_name=lora_name, cache_salt=cache_salt)
    except Exception:  # noqa: BLE001 - TokenizationError, or any failure of a template: route by text, never 500
        return None


def canonical_text(body: Mapping[str, Any], kind: RequestKind, limit_chars: int) -> str:
    """The canonical prompt text of a parsed body (for tests and debugging; `parse_request` uses the same)."""
    canon = CanonicalText(limit_chars)
    if kind == "chat":
        render_chat(dict(body), canon)
    elif kind == "responses":
        chat_body, _ = responses_chat_body(dict(body))
        if chat_body["messages"]:
            render_chat(chat_body, canon)
        else:
            render_tools(chat_body.get("tools"), canon)
    elif kind == "completion":
        render_completion(dict(body), canon)
    return canon.text()
