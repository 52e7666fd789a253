"""The Responses API of the simulated server: the bounded response store and the response encoders (pure).

vLLM (``vllm/entrypoints/openai/responses/serving.py``, with ``VLLM_ENABLE_RESPONSES_API_STORE=1``) keeps two
in-process dicts per server: the messages each stored request rendered (``msg_store``) and the finished
response objects (``response_store``); a follow-up's ``previous_response_id`` is looked up there, and an id
the process does not hold is a 404. Upstream's dicts never shrink (its own warning: "a memory leak"); here
`ResponseStore` keeps the same pair per id under an entry cap and a byte cap, evicting the least recently
used (a follow-up's read refreshes its previous response, so live conversations stay). The store lives and
dies with the process: a restarted server answers 404 for every old id, which the router relies on.

Response objects have vLLM's / OpenAI's fields (`response_object`), so the ``openai`` SDK parses them.
`StreamEncoder` pre-encodes the SSE events of one streamed response (named events,
``event: <type>\\ndata: <json>\\n\\n``, each with ``type`` and ``sequence_number``, in vLLM's order), so each
token costs one bytes join and one ``transport.write``, as chat's encoder does.

Chosen where vLLM depends on a real model: the simulated model never stops early, so a response is exactly
``max_output_tokens`` tokens and its status is ``completed`` (a real vLLM would say ``incomplete`` /
``max_output_tokens`` for a generation cut by the limit; the simulation stands for a model whose answer
happens to have that length). With function tools and a forcing ``tool_choice`` (``"required"`` or
``{"type": "function", "name": N}``) the output is one ``function_call`` item instead of a message: name N
(or the first function tool), arguments a JSON object whose one string value is the token stream (so its
size follows ``max_output_tokens``), so agent loops (function_call -> function_call_output) can be driven.
"""

from __future__ import annotations

import collections
import dataclasses
import secrets
from typing import Any

import orjson

from prefixroute.openai_errors import OpenAIError


def new_id(prefix: str, num_hex: int = 32) -> str:
    """``<prefix>_<num_hex hex digits>`` (vLLM: ``resp_`` + a uuid4's 32 hex digits; ``msg_``, ``fc_``)."""
    return f"{prefix}_{secrets.token_hex(num_hex // 2)}"


# -- the store --------------------------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class StoredResponse:
    """One stored response: the chat messages its request rendered (`responses_api.input_messages`), the
    response object, and its JSON (what GET /v1/responses/{id} answers). `size_bytes` is what it counts
    against the store's byte cap: the JSON of both."""

    messages: list[dict[str, Any]]
    response: dict[str, Any]
    body: bytes
    size_bytes: int


class ResponseStore:
    """Bounded LRU map response id -> `StoredResponse` (module docstring). Not thread-safe (one event loop).

    Bounds: at most `max_entries` entries and `max_bytes` bytes of JSON; `put` evicts least recently used
    entries until the new one fits (`num_evictions` counts them). An entry larger than `max_bytes` on its own
    is not stored (counted in `num_too_large`): its follow-up gets the 404 an evicted one gets."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("the response store needs max_entries >= 1 and max_bytes >= 1")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self.num_bytes = 0
        self.num_evictions = 0
        self.num_too_large = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._entries

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, refreshed as most recently used; None when not held."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def peek(self, response_id: str) -> StoredResponse | None:
        """The stored response without refreshing it (GET /v1/responses/{id}: reading is not continuing)."""
        return self._entries.get(response_id)

    def put(self, response_id: str, messages: list[dict[str, Any]], response: dict[str, Any],
            body: bytes | None = None) -> bool:
        """Store (or replace) `response_id`; returns False when the entry alone is over `max_bytes`."""
        if body is None:
            body = orjson.dumps(response)
        size = len(body) + len(orjson.dumps(messages))
        old = self._entries.pop(response_id, None)
        if old is not None:
            self.num_bytes -= old.size_bytes
        if size > self.max_bytes:
            self.num_too_large += 1
            return False
        while self._entries and (len(self._entries) >= self.max_entries or self.num_bytes + size > self.max_bytes):
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.size_bytes
            self.num_evictions += 1
        self._entries[response_id] = StoredResponse(messages, response, body, size)
        self.num_bytes += size
        return True

    def ids(self) -> list[str]:
        """Held ids, least recently used first (for tests and debugging)."""
        return list(self._entries)


# -- tool choice ------------------------------------------------------------------------------------
def forced_function(tools: tuple[dict[str, Any], ...] | list[dict[str, Any]],
                    tool_choice: Any) -> dict[str, Any] | None:
    """The function tool the simulated model calls, or None for a text answer (module docstring).

    `tool_choice` ``"required"`` picks the first function tool; ``{"type": "function", "name": N}`` picks N
    (400 when no function tool has that name, as OpenAI); anything else (``"auto"``, ``"none"``, hosted-tool
    choices) gives a text answer. Raises `OpenAIError` 400 for a malformed `tool_choice`."""
    functions = [t for t in tools if t.get("type") == "function"]
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if tool_choice == "required":
        return functions[0] if functions else None
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("type"), str):
        if tool_choice["type"] != "function":
            return None
        name = tool_choice.get("name")
        if not isinstance(name, str):
            raise OpenAIError(400, "'tool_choice.name' must be a string", param="tool_choice.name")
        for t in functions:
            if t.get("name") == name:
                return t
        raise OpenAIError(400, f"Tool choice '{name[:100]}' not found in 'tools' parameter.", param="tool_choice")
    raise OpenAIError(400, "'tool_choice' must be 'auto', 'none', 'required' or an object with a 'type'",
                      param="tool_choice")


def argument_key(tool: dict[str, Any]) -> str:
    """The key of the simulated call's one argument: the tool's first declared parameter, else "input"."""
    params = tool.get("parameters")
    props = params.get("properties") if isinstance(params, dict) else None
    if isinstance(props, dict):
        for key in props:
            if isinstance(key, str):
                return key
    return "input"


# -- response objects -------------------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class ResponseMeta:
    """What a response object echoes of its request, fixed when the request is admitted."""

    response_id: str
    created_at: int
    model: str
    max_output_tokens: int
    store: bool
    data: dict[str, Any]  # the request body (validated)
    tools: list[dict[str, Any]]
    instructions: str | None
    previous_response_id: str | None
    function: dict[str, Any] | None  # the tool called (forced_function), or None for a message
    item_id: str  # id of the one output item: msg_... or fc_...
    call_id: str  # call_... (function calls only)


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, block_size: int = 16) -> dict[str, Any]:
    """A Responses ``usage`` as vLLM 0.33's ``ResponseUsage`` (its ``InputTokensDetails`` requires
    ``cache_write_tokens``: the prompt tokens this request added to the prefix cache, its full blocks less what
    was cached already; ``tool_output_tokens`` 0 without tools run by the server)."""
    full = input_tokens // block_size * block_size if block_size > 0 else 0
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens,
                                     "cache_write_tokens": max(0, full - cached_tokens)},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def function_item(m: ResponseMeta, arguments: str, status: str = "completed") -> dict[str, Any]:
    assert m.function is not None
    return {"id": m.item_id, "type": "function_call", "call_id": m.call_id, "name": m.function["name"],
            "arguments": arguments, "status": status}


def output_items(m: ResponseMeta, text: str) -> list[dict[str, Any]]:
    """The output of a finished response: one message (`text`), or one function call (arguments around it)."""
    if m.function is not None:
        return [function_item(m, arguments_json(m, text))]
    return [message_item(m.item_id, text)]


def arguments_json(m: ResponseMeta, text: str) -> str:
    assert m.function is not None
    return orjson.dumps({argument_key(m.function): text}).decode()


def response_object(m: ResponseMeta, *, status: str, output: list[dict[str, Any]],
                    usage_: dict[str, Any] | None) -> dict[str, Any]:
    """A response object with the fields vLLM / OpenAI return (echoing the request as vLLM does)."""
    d = m.data
    temperature = d.get("temperature")
    top_p = d.get("top_p")
    return {
        "id": m.response_id, "object": "response", "created_at": m.created_at, "status": status,
        "background": False, "error": None, "incomplete_details": None, "instructions": m.instructions,
        "max_output_tokens": m.max_output_tokens, "max_tool_calls": d.get("max_tool_calls"),
        "metadata": d.get("metadata"), "model": m.model, "output": output,
        "parallel_tool_calls": d.get("parallel_tool_calls", True) is not False,
        "previous_response_id": m.previous_response_id, "prompt": None,
        "prompt_cache_key": d.get("prompt_cache_key"), "reasoning": d.get("reasoning"),
        "service_tier": d.get("service_tier") or "auto", "store": m.store,
        "temperature": 1.0 if temperature is None else float(temperature),
        "text": d.get("text") or {"format": {"type": "text"}}, "tool_choice": d.get("tool_choice") or "auto",
        "tools": m.tools, "top_logprobs": d.get("top_logprobs") or 0,
        "top_p": 1.0 if top_p is None else float(top_p), "truncation": d.get("truncation") or "disabled",
        "usage": usage_, "user": d.get("user"),
    }


# -- streaming --------------------------------------------------------------------------------------
def _event(etype: str, seq: int, fields: dict[str, Any]) -> bytes:
    return b"event: %b\ndata: %b\n\n" % (etype.encode(), orjson.dumps({"type": etype, "sequence_number": seq,
                                                                       **fields}))


def _json_str_body(s: str) -> bytes:
    """`s` as it appears between the quotes of a JSON string."""
    return orjson.dumps(s)[1:-1]


class StreamEncoder:
    """The SSE events of one streamed response, in vLLM's order (module docstring).

    `opening` (response.created, response.in_progress) is written at admission; `first` precedes the first
    token (output_item.added [+ content_part.added]); `token(word, index)` is one delta event; `closing`
    follows the last token (the .done events, output_item.done, response.completed). Sequence numbers run
    0, 1, 2, ... over the whole stream. Word texts must be JSON-safe."""

    __slots__ = ("m", "_delta_head", "_delta_tail", "_base", "_arg_open", "_arg_close")

    def __init__(self, m: ResponseMeta) -> None:
        self.m = m
        iid = orjson.dumps(m.item_id).decode()
        if m.function is None:
            self._delta_head = (f'event: response.output_text.delta\ndata: {{"type":"response.output_text.delta",'
                                f'"item_id":{iid},"output_index":0,"content_index":0,"logprobs":[],'
                                f'"delta":"').encode()
            self._arg_open = self._arg_close = b""
            self._base = 4  # created, in_progress, output_item.added, content_part.added
        else:
            self._delta_head = (f'event: response.function_call_arguments.delta\ndata: {{"type":'
                                f'"response.function_call_arguments.delta","item_id":{iid},"output_index":0,'
                                f'"delta":"').encode()
            key = argument_key(m.function)
            self._arg_open = _json_str_body(orjson.dumps({key: ""}).decode()[:-2])  # {"key":"
            self._arg_close = _json_str_body('"}')
            self._base = 3  # created, in_progress, output_item.added
        self._delta_tail = b'","sequence_number":'

    def opening(self) -> bytes:
        obj = response_object(self.m, status="in_progress", output=[], usage_=None)
        return (_event("response.created", 0, {"response": obj})
                + _event("response.in_progress", 1, {"response": obj}))

    def first(self) -> bytes:
        m = self.m
        if m.function is None:
            return (_event("response.output_item.added", 2, {"output_index": 0,
                                                              "item": message_item(m.item_id, None, "in_progress")})
                    + _event("response.content_part.added", 3, {
                        "item_id": m.item_id, "output_index": 0, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}))
        return _event("response.output_item.added", 2, {"output_index": 0,
                                                         "item": function_item(m, "", "in_progress")})

    def token(self, word: bytes, index: int, last: bool) -> bytes:
        """The delta event of output token `index` (0-based); a function call's first and last deltas also
        carry the JSON object's opening and closing characters."""
        if index == 0 and self._arg_open:
            word = self._arg_open + word
        if last and self._arg_close:
            word = word + self._arg_close
        return b"%b%b%b%d}\n\n" % (self._delta_head, word, self._delta_tail, self._base + index)

    def closing(self, text: str, num_output: int, final: dict[str, Any]) -> bytes:
        """Events after the last of `num_output` tokens; `final` is the completed response object."""
        m = self.m
        seq = self._base + num_output
        if m.function is None:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out = [_event("response.output_text.done", seq, {"item_id": m.item_id, "output_index": 0,
                                                              "content_index": 0, "text": text, "logprobs": []}),
                   _event("response.content_part.done", seq + 1, {"item_id": m.item_id, "output_index": 0,
                                                                   "content_index": 0, "part": part}),
                   _event("response.output_item.done", seq + 2, {"output_index": 0,
                                                                 "item": message_item(m.item_id, text)})]
            seq += 3
        else:
            assert m.function is not None
            args = arguments_json(m, text)
            out = [_event("response.function_call_arguments.done", seq, {
                       "item_id": m.item_id, "output_index": 0, "name": m.function["name"], "arguments": args}),
                   _event("response.output_item.done", seq + 1, {"output_index": 0,
                                                                 "item": function_item(m, args)})]
            seq += 2
        out.append(_event("response.completed", seq, {"response": final}))
        return b"".join(out)
