"""The canonical prompt text of a request body, and the request's parse budgets (`CanonicalText`; pure).

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

Work is bounded: rendering stops after ``limit`` characters (``max_blocks * block_chars``: the hashed prefix), so
beyond JSON parsing a 1 MB prompt costs about what a 16 KB one does. All messages are still type-checked, so
whether a request is accepted never depends on its length; the parse budgets (``max_messages``,
``max_content_parts``, ``max_input_chars``) refuse a request past them with a 400 naming the limit.

A Responses API body is rendered as its chat equivalent (`responses_chat_body`).
"""

from __future__ import annotations

from typing import Any

import orjson
import xxhash

from prefixroute import responses_prompt
from prefixroute.extproc.routing.request_errors import bad_request, clip
from prefixroute.extproc.routing.settings import RoutingSettings

MAX_TOKEN_ID = 2**31 - 1
"""Largest token id accepted (int32: vLLM's and every engine's token tensors)."""

_xxh3_hex = xxhash.xxh3_64_hexdigest


class CanonicalText:
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
            raise bad_request(f"the prompt has more than {self.max_chars} characters of content (at '{param}'); this "
                              "gateway accepts at most that many per request (max_input_chars)", param)

    def check_ids(self, n: int) -> None:
        """400 when a completion prompt has more token ids than ``max_input_chars`` (one unit each)."""
        if self.max_chars is not None and n > self.max_chars:
            raise bad_request(f"'prompt' has {n} token ids; this gateway accepts at most {self.max_chars} per request "
                              "(max_input_chars)", "prompt")

    def count_parts(self, n: int, param: str) -> None:
        self.num_parts += n
        if self.max_parts is not None and self.num_parts > self.max_parts:
            raise bad_request(f"the request has more than {self.max_parts} content parts (at '{param}'); this gateway "
                              "accepts at most that many per request (max_content_parts)", param)

    def count_messages(self, n: int, param: str) -> None:
        if self.max_messages is not None and n > self.max_messages:
            raise bad_request(f"'{param}' has {n} items; this gateway accepts at most {self.max_messages} per request "
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
        raise bad_request(f"'{param}' cannot be serialised: {clip(str(exc))}", param) from None


def _render_content(content: Any, canon: CanonicalText, param: str) -> None:
    if isinstance(content, str):
        canon.num_chars += len(content)
        canon.add(content)
        return
    if content is None:
        return
    if not isinstance(content, list):
        raise bad_request(f"'{param}' must be a string, a list of content parts or null", param)
    canon.count_parts(len(content), param)
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise bad_request(f"'{p}' must be an object", p)
        ptype = part.get("type")
        if not isinstance(ptype, str):
            raise bad_request(f"'{p}.type' must be a string", f"{p}.type")
        if ptype == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"'{p}.text' must be a string", f"{p}.text")
            canon.num_chars += len(text)
            canon.add(text)
        elif ptype == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise bad_request(f"'{p}.image_url.url' must be a string", f"{p}.image_url")
            if not canon.full:
                canon.add(f"<|image:{_xxh3_hex(url.encode('utf-8', 'surrogatepass'))}|>")
        elif not canon.full:
            canon.add(f"<|{ptype}:{_xxh3_hex(_canonical_json(part, p).encode('utf-8', 'surrogatepass'))}|>")


def render_tools(tools: Any, canon: CanonicalText) -> None:
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("'tools' must be a list", "tools")
        canon.count_parts(len(tools), "tools")
        if tools:
            canon.add("<|tools|>")
            canon.add(_canonical_json(tools, "tools"))
            canon.add("\n")


def render_chat(body: dict[str, Any], canon: CanonicalText) -> None:
    render_tools(body.get("tools"), canon)
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    canon.count_messages(len(messages), "messages")
    for i, msg in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad_request(f"'{param}' must be an object", param)
        role = msg.get("role")
        if not isinstance(role, str):
            raise bad_request(f"'{param}.role' must be a string", f"{param}.role")
        name = msg.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request(f"'{param}.name' must be a string", f"{param}.name")
        tool_calls = msg.get("tool_calls")
        if tool_calls is not None and not isinstance(tool_calls, list):
            raise bad_request(f"'{param}.tool_calls' must be a list", f"{param}.tool_calls")
        tool_call_id = msg.get("tool_call_id")
        if tool_call_id is not None and not isinstance(tool_call_id, str):
            raise bad_request(f"'{param}.tool_call_id' must be a string", f"{param}.tool_call_id")
        canon.add(f"<|{role}|>")
        if name:
            canon.add(f"name={name}\n")
        content = msg.get("content")
        if content is None and "content" in msg and role not in _NULL_CONTENT_ROLES:
            # vLLM 0.33 (its message types): content may be absent, but null only for an assistant message
            # (which may carry tool_calls instead) or a function result.
            raise bad_request(f"'{param}.content' is null: only an assistant message may have null content; send a "
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
        raise bad_request(f"'{param}[{j}]' token id {clip(bad)} is out of range: token ids are integers in "
                          f"[0, {MAX_TOKEN_ID}]", "prompt")


def render_completion(body: dict[str, Any], canon: CanonicalText) -> None:
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("'prompt' is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        canon.num_chars += len(prompt)
        canon.check_chars("prompt")
        canon.add(prompt)
        return
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("'prompt' must be a string, a list of strings, a list of token ids or a list of lists of "
                          "token ids, and not empty", "prompt")
    first = prompt[0]
    if isinstance(first, str):
        canon.count_messages(len(prompt), "prompt")
        if not all(isinstance(p, str) for p in prompt):
            raise bad_request("'prompt' mixes strings with other types", "prompt")
        canon.num_chars += sum(map(len, prompt))
        canon.check_chars("prompt")
        canon.num_chars = len(first)  # the first prompt routes the request (module docstring)
        canon.add(first)
        return
    if type(first) is int:  # noqa: E721
        ids = prompt
        canon.check_ids(len(ids))
        if not _is_token_ids(ids):
            raise bad_request("'prompt' token ids must all be integers", "prompt")
        _check_token_range(ids, "prompt")
    elif isinstance(first, list):
        canon.count_messages(len(prompt), "prompt")
        canon.check_ids(sum(len(p) if isinstance(p, list) else 1 for p in prompt))
        if not all(isinstance(p, list) and p and _is_token_ids(p) for p in prompt):
            raise bad_request("'prompt' must be a list of non-empty lists of integer token ids", "prompt")
        for i, p in enumerate(prompt):
            _check_token_range(p, f"prompt[{i}]")
        ids = first
    else:
        raise bad_request("'prompt' must be a string, a list of strings or token ids", "prompt")
    canon.num_chars += len(ids)
    canon.add("<|ids|>")
    # Each id renders to >= 2 characters ("7,"), so limit // 2 ids fill the hashed prefix; the trailing comma
    # keeps the prefix property (ids [1, 2] must not render as a prefix of [1, 23]).
    canon.add(",".join(map(str, ids[: canon.limit // 2])) + ",")


def responses_chat_body(data: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
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
