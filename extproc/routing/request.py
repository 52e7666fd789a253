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

Token mode (`parse_request(..., tokenizer=PromptHasher)`, ``--tokenizer sim`` or a tokenizer folder): the
prompt is also tokenized exactly as the server does (routing/tokens.py) and `block_hashes` are then the
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

Sampling fields checked (`_FIELD_RULES`; absent or null = unchecked, other fields pass through untouched).
Where vLLM and OpenAI differ, vLLM's range wins (the endpoint is vLLM: the router must not refuse what it
would serve), but JSON types are strict as in OpenAI (vLLM's pydantic lax mode would take ``"yes"`` for
true); an integer may be written as an integral float (``16.0``), as pydantic accepts:

| field | rule |
| --- | --- |
| ``stream`` | boolean |
| ``stream_options`` | object of booleans ``include_usage``, ``continuous_usage_stats``; non-empty only with ``stream: true`` (vLLM) |
| ``n`` | integer >= 1 |
| ``max_tokens``, ``max_completion_tokens`` (chat) | integer >= 1 |
| ``temperature`` | number >= 0 |
| ``top_p`` | number in (0, 1] |
| ``presence_penalty``, ``frequency_penalty`` | number in [-2, 2] |
| ``top_k`` | integer, -1 or >= 0 (vLLM: 0 and -1 disable it) |
| ``seed`` | integer in [-2**63, 2**63) (vLLM: a torch long) |
| ``user`` | string |
| ``stop`` | string, or array of strings (vLLM sets no count limit; OpenAI's 4 is not enforced) |
| ``logprobs`` | chat: boolean; completions: integer in [0, 20] |
| ``top_logprobs`` (chat) | integer, -1 or in [0, 20]; -1 or > 0 only with ``logprobs: true`` (vLLM's wording) |
| ``echo`` (completions) | boolean |
| ``prompt`` token ids | integers in [0, 2**31) (a token id is an int32 in every engine) |

20 is vLLM's default ``--max-logprobs`` and OpenAI's cap.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Callable, Container, Mapping
from typing import Any

import orjson
import xxhash

from prefixroute import responses_prompt
from prefixroute.openai_errors import OpenAIError
from prefixroute.extproc.routing.hashing import hash_blocks, seed_for
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing.tokens import PromptHasher
from prefixroute.types import BlockHash, RequestKind

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

_xxh3_hex = xxhash.xxh3_64_hexdigest


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
    # Conversation state (issue 14). `session_key`: the chat session this request continues (RoutingSettings.
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


MAX_ECHO_CHARS = 100
"""Most characters of a client's value quoted back in an error message (`clip`)."""
MAX_TOKEN_ID = 2**31 - 1
"""Largest token id accepted (int32: vLLM's and every engine's token tensors)."""
MAX_LOGPROBS = 20
"""Largest ``logprobs`` (completions) / ``top_logprobs`` (chat): vLLM's default --max-logprobs, OpenAI's cap."""
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def clip(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """`value` as text for an error message: at most `limit` characters, then a marker saying how many more."""
    s = value if isinstance(value, str) else repr(value)
    if len(s) <= limit:
        return s
    return f"{s[:limit]}...({len(s) - limit} more characters)"


def _bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


class _Canon:
    """Accumulates canonical text up to `limit` characters; beyond it only counts characters. Also the
    request's parse budgets (`RoutingSettings.max_messages`, ``max_content_parts``, ``max_input_chars``):
    `over_chars` and the part counter raise the 400 that names the limit once one is passed."""

    __slots__ = ("parts", "size", "limit", "num_chars", "num_parts", "max_parts", "max_chars", "max_messages")

    def __init__(self, limit: int, settings: RoutingSettings | None = None) -> None:
        self.parts: list[str] = []
        self.size = 0
        self.limit = limit
        self.num_chars = 0  # prompt content characters, all of them
        self.num_parts = 0  # content parts, over all messages
        self.max_parts = settings.max_content_parts if settings is not None else None
        self.max_chars = settings.max_input_chars if settings is not None else None
        self.max_messages = settings.max_messages if settings is not None else None

    def check_chars(self, param: str) -> None:
        """400 once the prompt's content characters pass ``max_input_chars`` (checked after each message)."""
        if self.max_chars is not None and self.num_chars > self.max_chars:
            raise _bad(f"the prompt has more than {self.max_chars} characters of content (at '{param}'); this "
                       "gateway accepts at most that many per request (max_input_chars)", param)

    def check_ids(self, n: int) -> None:
        """400 when a completion prompt has more token ids than ``max_input_chars`` (one unit each)."""
        if self.max_chars is not None and n > self.max_chars:
            raise _bad(f"'prompt' has {n} token ids; this gateway accepts at most {self.max_chars} per request "
                       "(max_input_chars)", "prompt")

    def count_parts(self, n: int, param: str) -> None:
        self.num_parts += n
        if self.max_parts is not None and self.num_parts > self.max_parts:
            raise _bad(f"the request has more than {self.max_parts} content parts (at '{param}'); this gateway "
                       "accepts at most that many per request (max_content_parts)", param)

    def count_messages(self, n: int, param: str) -> None:
        if self.max_messages is not None and n > self.max_messages:
            raise _bad(f"'{param}' has {n} items; this gateway accepts at most {self.max_messages} per request "
                       "(max_messages)", param)

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
        raise _bad(f"'{param}' cannot be serialised: {clip(str(exc))}", param) from None


def _render_content(content: Any, canon: _Canon, param: str) -> None:
    if isinstance(content, str):
        canon.num_chars += len(content)
        canon.add(content)
        return
    if content is None:
        return
    if not isinstance(content, list):
        raise _bad(f"'{param}' must be a string, a list of content parts or null", param)
    canon.count_parts(len(content), param)
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


def _render_tools(tools: Any, canon: _Canon) -> None:
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("'tools' must be a list", "tools")
        canon.count_parts(len(tools), "tools")
        if tools:
            canon.add("<|tools|>")
            canon.add(_canonical_json(tools, "tools"))
            canon.add("\n")


def _render_chat(body: dict[str, Any], canon: _Canon) -> None:
    _render_tools(body.get("tools"), canon)
    messages = body.get("messages")
    if messages is None:
        raise _bad("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    canon.count_messages(len(messages), "messages")
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
        content = msg.get("content")
        if content is None and "content" in msg and role not in _NULL_CONTENT_ROLES:
            # vLLM 0.33 (its message types): content may be absent, but null only for an assistant message
            # (which may carry tool_calls instead) or a function result.
            raise _bad(f"'{param}.content' is null: only an assistant message may have null content; send a "
                       "string, a list of content parts, or leave it out", f"{param}.content")
        _render_content(content, canon, f"{param}.content")
        canon.check_chars(f"{param}.content")
        if tool_calls and not canon.full:
            canon.add("<|tool_calls|>")
            canon.add(_canonical_json(tool_calls, f"{param}.tool_calls"))
        if tool_call_id is not None:
            canon.add(f"<|tool_call_id|>{tool_call_id}")
        canon.add("\n")


_NULL_CONTENT_ROLES = frozenset({"assistant", "function"})


def _is_token_ids(value: list[Any]) -> bool:
    return all(type(t) is int for t in value)  # noqa: E721 - bool is an int subclass and is not a token id


def _check_token_range(ids: list[int], param: str) -> None:
    """`ids` (all ints, non-empty) within [0, MAX_TOKEN_ID]; min/max run in C, the search only on failure."""
    if min(ids) < 0 or max(ids) > MAX_TOKEN_ID:
        j, bad = next((j, t) for j, t in enumerate(ids) if not 0 <= t <= MAX_TOKEN_ID)
        raise _bad(f"'{param}[{j}]' token id {clip(bad)} is out of range: token ids are integers in "
                   f"[0, {MAX_TOKEN_ID}]", "prompt")


def _render_completion(body: dict[str, Any], canon: _Canon) -> None:
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("'prompt' is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        canon.num_chars += len(prompt)
        canon.check_chars("prompt")
        canon.add(prompt)
        return
    if not isinstance(prompt, list) or not prompt:
        raise _bad("'prompt' must be a string, a list of strings, a list of token ids or a list of lists of "
                   "token ids, and not empty", "prompt")
    first = prompt[0]
    if isinstance(first, str):
        canon.count_messages(len(prompt), "prompt")
        if not all(isinstance(p, str) for p in prompt):
            raise _bad("'prompt' mixes strings with other types", "prompt")
        canon.num_chars += sum(map(len, prompt))
        canon.check_chars("prompt")
        canon.num_chars = len(first)  # the first prompt routes the request (module docstring)
        canon.add(first)
        return
    if type(first) is int:  # noqa: E721
        ids = prompt
        canon.check_ids(len(ids))
        if not _is_token_ids(ids):
            raise _bad("'prompt' token ids must all be integers", "prompt")
        _check_token_range(ids, "prompt")
    elif isinstance(first, list):
        canon.count_messages(len(prompt), "prompt")
        canon.check_ids(sum(len(p) if isinstance(p, list) else 1 for p in prompt))
        if not all(isinstance(p, list) and p and _is_token_ids(p) for p in prompt):
            raise _bad("'prompt' must be a list of non-empty lists of integer token ids", "prompt")
        for i, p in enumerate(prompt):
            _check_token_range(p, f"prompt[{i}]")
        ids = first
    else:
        raise _bad("'prompt' must be a string, a list of strings or token ids", "prompt")
    canon.num_chars += len(ids)
    canon.add("<|ids|>")
    # Each id renders to >= 2 characters ("7,"), so limit // 2 ids fill the hashed prefix; the trailing comma
    # keeps the prefix property (ids [1, 2] must not render as a prefix of [1, 23]).
    canon.add(",".join(map(str, ids[: canon.limit // 2])) + ",")


# --- sampling fields (module docstring's table) ------------------------------------------------------------
# A field's rule is (kind, low, high, extra): kind "int" (low <= v <= high, or v == extra), "num" (low <= v <=
# high; extra True = the low end is open), "bool", "str", or a function (value, name) for the rest. The loop in
# `_check_fields` tests the plain kinds inline: a function call per field would double its cost.
Check = Callable[[Any, str], None]
Rule = tuple[Any, float | None, float | None, Any]


def _check_stop(value: Any, name: str) -> None:
    t = type(value)
    if t is str or (t is list and all(map(str.__instancecheck__, value))):
        return
    raise _bad(f"'{name}' must be a string or an array of strings", name)


def _check_stream_options(value: Any, name: str) -> None:
    if type(value) is not dict:
        raise _bad(f"'{name}' must be an object", name)
    for key in ("include_usage", "continuous_usage_stats"):
        v = value.get(key)
        if v is not None and v is not True and v is not False:
            raise _bad(f"'{name}.{key}' must be a boolean", f"{name}.{key}")


def _check_logit_bias(value: Any, name: str) -> None:
    # vLLM: dict[str, float] (JSON keys are strings; the values numbers, strictly typed here).
    if type(value) is not dict or not all(type(v) in (int, float) for v in value.values()):
        raise _bad(f"'{name}' must be an object mapping token ids to numbers", name)


_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")


def _check_response_format(value: Any, name: str) -> None:
    # vLLM's AnyResponseFormat: ResponseFormat (type text / json_object / json_schema, the last with a
    # json_schema object naming its schema) or a structural tag (format, or structures and triggers).
    if type(value) is not dict:
        raise _bad(f"'{name}' must be an object with a 'type'", name)
    rtype = value.get("type")
    if rtype not in _RESPONSE_FORMAT_TYPES:
        raise _bad(f"'{name}.type' must be one of {', '.join(_RESPONSE_FORMAT_TYPES)}", f"{name}.type")
    if rtype == "json_schema":
        schema = value.get("json_schema")
        if schema is None:
            raise _bad("When response_format type is 'json_schema', the 'json_schema' field must be provided.", name)
        if type(schema) is not dict or type(schema.get("name")) is not str:
            raise _bad(f"'{name}.json_schema' must be an object with a string 'name'", f"{name}.json_schema")
    elif rtype == "structural_tag" and "format" not in value and not (
            type(value.get("structures")) is list and type(value.get("triggers")) is list):
        raise _bad(f"'{name}' of type structural_tag needs 'format', or 'structures' and 'triggers'", name)


def _check_tools(data: dict[str, Any]) -> None:
    """Chat ``tools`` and ``tool_choice`` as vLLM 0.33's ChatCompletionRequest checks them (its wording where it
    has one): each tool a function with a name; no empty list; a tool_choice other than none needs tools and is
    auto, required or a named function among them."""
    tools = data.get("tools")
    if tools is not None:
        if type(tools) is not list:
            raise _bad("'tools' must be a list", "tools")
        if not tools:
            raise _bad("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                       "entirely.", "tools")
        for i, tool in enumerate(tools):
            if type(tool) is not dict or tool.get("type", "function") != "function":
                raise _bad(f"'tools[{i}]' must be an object of type 'function'", f"tools[{i}]")
            fn = tool.get("function")
            if type(fn) is not dict or type(fn.get("name")) is not str:
                raise _bad(f"'tools[{i}].function' must be an object with a string 'name'", f"tools[{i}].function")
    choice = data.get("tool_choice")
    if choice is None or choice == "none":
        return
    if tools is None:
        raise _bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice in ("auto", "required"):
        return
    if type(choice) is not dict:
        raise _bad(f"Invalid value for `tool_choice`: {clip(choice)}! Only named tools, \"none\", \"auto\" or "
                   "\"required\" are supported.", "tool_choice")
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    fn = choice.get("function")
    if type(fn) is not dict:
        raise _bad(f"Invalid value for `function`: `{clip(fn)}` in `tool_choice`! {usage}", "tool_choice.function")
    fname = fn.get("name")
    if type(fname) is not str or not fname:
        raise _bad(f"Invalid `name` in `function`: `{clip(fname)}` in `tool_choice`! {usage}",
                   "tool_choice.function.name")
    if not any(t["function"]["name"] == fname for t in tools):
        raise _bad("The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice")


def _int_message(name: str, low: float | None, high: float | None, extra: Any) -> str:
    if high is None:
        return f"'{name}' must be an integer >= {low}"
    alt = f" or {extra}" if extra is not None else ""
    return f"'{name}' must be an integer in [{low}, {high}]{alt}"


def _num_message(name: str, low: float | None, high: float | None, low_open: bool) -> str:
    if high is None:
        return f"'{name}' must be a number >= {low:g}"
    return f"'{name}' must be a number in {'(' if low_open else '['}{low:g}, {high:g}]"


_BOOL: Rule = ("bool", None, None, None)
_STR: Rule = ("str", None, None, None)
_AT_LEAST_1: Rule = ("int", 1, None, None)
_PENALTY: Rule = ("num", -2.0, 2.0, False)
_COMMON_RULES: dict[str, Rule] = {
    "stream": _BOOL,
    "stream_options": (_check_stream_options, None, None, None),
    "n": _AT_LEAST_1,
    "max_tokens": _AT_LEAST_1,
    "temperature": ("num", 0.0, None, False),
    "top_p": ("num", 0.0, 1.0, True),
    "presence_penalty": _PENALTY,
    "frequency_penalty": _PENALTY,
    "top_k": ("int", -1, None, None),  # -1 and 0 disable it (vLLM)
    "seed": ("int", _INT64_MIN, _INT64_MAX, None),
    "user": _STR,
    "stop": (_check_stop, None, None, None),
    "prompt_cache_key": _STR,
    "logit_bias": (_check_logit_bias, None, None, None),
    "response_format": (_check_response_format, None, None, None),
}
_FIELD_RULES: dict[RequestKind, dict[str, Rule]] = {
    "chat": {**_COMMON_RULES, "max_completion_tokens": _AT_LEAST_1, "logprobs": _BOOL,
             "top_logprobs": ("int", 0, MAX_LOGPROBS, -1)},
    "completion": {**_COMMON_RULES, "logprobs": ("int", 0, MAX_LOGPROBS, None), "echo": _BOOL},
    # vLLM's ResponsesRequest: no n / max_tokens / stream_options; top_logprobs without a logprobs switch.
    "responses": {"stream": _BOOL, "max_output_tokens": _AT_LEAST_1, "temperature": _COMMON_RULES["temperature"],
                  "top_p": _COMMON_RULES["top_p"], "top_k": _COMMON_RULES["top_k"], "seed": _COMMON_RULES["seed"],
                  "user": _STR, "stop": _COMMON_RULES["stop"], "prompt_cache_key": _STR,
                  "top_logprobs": ("int", 0, MAX_LOGPROBS, None)},
}
"""Per request kind: field -> rule (the module docstring's table)."""


def _check_fields(data: dict[str, Any], kind: RequestKind) -> None:
    """Type and range of the sampling fields present (a loop over the body's keys: typically a handful), then
    the rules between fields, with vLLM's wording."""
    get = _FIELD_RULES[kind].get
    for key, value in data.items():
        rule = get(key)
        if rule is None or value is None:
            continue
        what, low, high, extra = rule
        t = type(value)
        if what == "int":
            if t is not int:
                if t is not float or not value.is_integer():  # 16.0: pydantic's int accepts it
                    raise _bad(f"'{key}' must be an integer", key)
            if (value < low or (high is not None and value > high)) and value != extra:
                raise _bad(_int_message(key, low, high, extra), key)
        elif what == "num":
            if t is not float and t is not int:  # not bool (a subclass of int)
                raise _bad(f"'{key}' must be a number", key)
            if (value <= low if extra else value < low) or (high is not None and value > high):
                raise _bad(_num_message(key, low, high, extra), key)
        elif what == "bool":
            if t is not bool:
                raise _bad(f"'{key}' must be a boolean", key)
        elif what == "str":
            if t is not str:
                raise _bad(f"'{key}' must be a string", key)
        else:
            what(value, key)
    if kind != "responses" and data.get("stream_options") and data.get("stream") is not True:
        raise _bad("Stream options can only be defined when `stream=True`.", "stream_options")
    if kind == "chat":
        if "tools" in data or "tool_choice" in data:
            _check_tools(data)
        top = data.get("top_logprobs")
        if top is not None and top != 0 and data.get("logprobs") is not True:
            raise _bad("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")


def parse_request(method: str, path: str, headers: Mapping[str, str], body: bytes,
                  settings: RoutingSettings, tokenizer: PromptHasher | None = None,
                  adapters: Container[str] | None = None) -> InferenceRequest:
    """Understand one request. `headers` keys must be lower case (HTTP/2 and Envoy's ext_proc give them so).

    `tokenizer` (built once: ``PromptHasher.from_settings(settings)``) selects token mode (module docstring);
    None keeps text mode. `adapters`: the model names that are LoRA adapters (a set, or any container such as
    a live view of the pool's served adapters); a request for one is hashed with ``lora_name`` = its model, as
    vLLM keys its blocks. None: every model is a base model.

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
    if method.upper() != "POST":
        raise OpenAIError(405, f"method {clip(method)} is not allowed on {clip(path)}; use POST")
    encoding = headers.get("content-encoding")
    if encoding and encoding.strip().lower() != "identity":
        # The body would reach JSON parsing compressed (and fail as "not valid UTF-8"): say what is wrong.
        raise OpenAIError(415, f"unsupported content-encoding {clip(encoding)!r}: send the request body "
                               "uncompressed (identity)")
    if not body:
        raise _bad("request body is empty; expected a JSON object")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"request body is not valid JSON: {clip(str(exc))}") from None
    if not isinstance(data, dict):
        raise _bad("request body must be a JSON object")

    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    if model is not None and len(model) > MAX_MODEL_CHARS:
        raise _bad(f"'model' has {len(model)} characters; model names are at most {MAX_MODEL_CHARS}", "model")
    _check_fields(data, kind)
    stream = data.get("stream")
    # Kept with the request (sessions, the policy's tables, telemetry): bounded here, once (MAX_KEY_CHARS).
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

    session_key = _session_key(settings, headers, data)
    response_ref = None
    canon = _Canon(settings.max_prompt_chars, settings)
    if kind == "chat":
        _render_chat(data, canon)
        chat_body: dict[str, Any] | None = data
    elif kind == "responses":
        inp = data.get("input")
        if isinstance(inp, list):
            canon.count_messages(len(inp), "input")
        chat_body, response_ref = _responses_chat_body(data)
        if response_ref is not None:
            _check_response_id(response_ref)
        if chat_body["messages"]:
            _render_chat(chat_body, canon)
        else:  # input [] without instructions: nothing to hash (vLLM renders an empty conversation)
            _render_tools(chat_body.get("tools"), canon)
    else:
        chat_body = None
        _render_completion(data, canon)
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
    hashes = hash_blocks(canon.text(), seed_for(model, salt), settings.block_chars, settings.max_blocks)
    return InferenceRequest(kind=kind, path=path, model=model, tenant=tenant, stream=bool(stream),
                            block_hashes=hashes, num_prompt_chars=canon.num_chars, request_id=request_id,
                            session_key=session_key, response_ref=response_ref)


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


def _responses_chat_body(data: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A validated Responses body as the chat body whose rendering is its prompt's visible head, and its
    ``previous_response_id``. First turn: the whole prompt (`responses_prompt.input_messages`: instructions, then
    the input), so it hashes exactly like its chat equivalent. Follow-up: the prompt is instructions, then the
    stored chain of the previous response (on its endpoint only), then the input; only the tools and the
    instructions precede the unseen chain, so only they are rendered (blocks that would need the chain are
    never invented)."""
    body = responses_prompt.parse_body(data)
    tools = responses_prompt.chat_tools(body.tools)
    if body.previous_response_id is None:
        messages = responses_prompt.input_messages(body)
        return {"messages": messages, "tools": tools}, None
    head = [{"role": "system", "content": body.instructions}] if body.instructions else []
    return {"messages": head, "tools": tools}, body.previous_response_id


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
    canon = _Canon(limit_chars)
    if kind == "chat":
        _render_chat(dict(body), canon)
    elif kind == "responses":
        chat_body, _ = _responses_chat_body(dict(body))
        if chat_body["messages"]:
            _render_chat(chat_body, canon)
        else:
            _render_tools(chat_body.get("tools"), canon)
    elif kind == "completion":
        _render_completion(dict(body), canon)
    return canon.text()
