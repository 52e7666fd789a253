"""The OpenAI Responses API request, as vLLM reads it: validation, and conversion to chat messages (pure).

Shared by the router (which must hash a Responses request exactly as the server will tokenize it) and the
simulated servers (which serve it): one definition of how a Responses request becomes a prompt.

vLLM (``vllm/entrypoints/openai/responses/utils.py``, ``construct_input_messages``, read at a 2026 commit)
builds the prompt of a Responses request as chat messages, then applies the chat template:

1. ``instructions``, when non-empty, as a system message;
2. for a follow-up (``previous_response_id``): the stored messages of the previous response *without its
   system messages* (instructions do not carry over, per OpenAI), then each output *message* of the previous
   response as an assistant message (reasoning and function-call output items are skipped);
3. the new ``input``: a string is one user message; a list of items is converted item by item
   (`input_items_to_messages`): a message stays a message, a ``function_call`` becomes an assistant message's
   ``tool_calls`` entry (merged into the preceding assistant message), a ``function_call_output`` a ``tool``
   message, a ``reasoning`` item an assistant message's ``reasoning`` (merged likewise).

What the server stores for a response (and what a follow-up's step 2 reads) is the list of messages of
steps 1-3 of the request that produced it.

Content parts are normalised to the chat forms the router's canonical rendering and the chat templates
know: ``input_text`` / ``output_text`` -> ``{"type": "text"}``, ``input_image`` -> ``{"type": "image_url"}``;
other parts (``input_file``, ``refusal``, ...) pass through unchanged. An assistant message keeps only its
first content part's text (as vLLM). An item type this module does not know (``item_reference``,
``web_search_call``, ...) becomes a user message holding the item as one opaque part: the router hashes it
(it never refuses what the server might serve) and the simulated server answers 400 for it.

Errors are `OpenAIError` 400 naming the field (``input[2].call_id``), as the router's other parsers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from prefixroute.openai_errors import OpenAIError

RESPONSES_PATH = "/v1/responses"
RESPONSES_PREFIX = "/v1/responses/"
RESPONSE_ID_PREFIX = "resp"
"""vLLM refuses a response id that does not begin with this (``Invalid 'response_id'``)."""

MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
KNOWN_ITEM_TYPES = frozenset({"message", "function_call", "function_call_output", "reasoning"})

_ECHO_CHARS = 100


def _clip(value: object) -> str:
    s = value if isinstance(value, str) else repr(value)
    return s if len(s) <= _ECHO_CHARS else f"{s[:_ECHO_CHARS]}...({len(s) - _ECHO_CHARS} more characters)"


def _bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def not_found(response_id: str) -> OpenAIError:
    """vLLM's 404 for a response id its store does not hold (message, type and param as vLLM writes them)."""
    return OpenAIError(404, f"Response with id '{_clip(response_id)}' not found.", param="response_id",
                       type_="invalid_request_error", record_message="Response with id (withheld) not found.")


def invalid_id(response_id: str) -> OpenAIError:
    """vLLM's 400 for a response id that does not begin with ``resp``."""
    return OpenAIError(400, f"Invalid 'response_id': '{_clip(response_id)}'. Expected an ID that begins with "
                            f"'{RESPONSE_ID_PREFIX}'.", param="response_id", type_="invalid_request_error",
                       record_message=f"Invalid 'response_id' (withheld). Expected an ID that begins with "
                                      f"'{RESPONSE_ID_PREFIX}'.")


def path_response_id(path: str) -> str | None:
    """The ``{id}`` of ``/v1/responses/{id}`` or ``/v1/responses/{id}/<action>`` (query string ignored), else
    None. The id is returned as written (percent-escapes are refused by the gateway before this runs)."""
    path = path.split("?", 1)[0]
    if not path.startswith(RESPONSES_PREFIX):
        return None
    rest = path[len(RESPONSES_PREFIX):]
    rid = rest.split("/", 1)[0]
    return rid or None


@dataclasses.dataclass(frozen=True, slots=True)
class ResponsesBody:
    """The validated fields of a ``POST /v1/responses`` body that shape its prompt and its routing.

    `input` is the string, or the list of items (each a dict, validated); `tools` the body's list (possibly
    empty). `store` defaults to True (OpenAI and vLLM)."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: tuple[dict[str, Any], ...] = ()
    store: bool = True
    stream: bool = False


def _opt(data: dict[str, Any], key: str, types: tuple[type, ...], what: str) -> Any:
    v = data.get(key)
    if v is not None and (type(v) not in types):
        raise _bad(f"'{key}' must be {what}", key)
    return v


def _check_parts(content: Any, param: str) -> None:
    if isinstance(content, str) or content is None:
        return
    if not isinstance(content, list):
        raise _bad(f"'{param}' must be a string or a list of content parts", param)
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _bad(f"'{p}' must be an object", p)
        ptype = part.get("type")
        if not isinstance(ptype, str):
            raise _bad(f"'{p}.type' must be a string", f"{p}.type")
        if ptype in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise _bad(f"'{p}.text' must be a string", f"{p}.text")
        elif ptype == "input_image":
            url, file_id = part.get("image_url"), part.get("file_id")
            if not isinstance(url, str) and not isinstance(file_id, str):
                raise _bad(f"'{p}' needs image_url or file_id (a string)", f"{p}.image_url")
        elif ptype == "refusal" and not isinstance(part.get("refusal"), str):
            raise _bad(f"'{p}.refusal' must be a string", f"{p}.refusal")


def check_item(item: Any, param: str) -> None:
    """Validate one input item (module docstring); raises `OpenAIError` 400 naming the field."""
    if not isinstance(item, dict):
        raise _bad(f"'{param}' must be an object", param)
    itype = item.get("type")
    if itype is not None and not isinstance(itype, str):
        raise _bad(f"'{param}.type' must be a string", f"{param}.type")
    if itype is None or itype == "message":
        role = item.get("role")
        if not isinstance(role, str):
            raise _bad(f"'{param}.role' must be a string", f"{param}.role")
        if role not in MESSAGE_ROLES:
            raise _bad(f"'{param}.role' must be one of {', '.join(sorted(MESSAGE_ROLES))}; got {_clip(role)}",
                       f"{param}.role")
        if "content" not in item:
            raise _bad(f"'{param}.content' is required", f"{param}.content")
        _check_parts(item["content"], f"{param}.content")
    elif itype == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise _bad(f"'{param}.{key}' must be a string", f"{param}.{key}")
    elif itype == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise _bad(f"'{param}.call_id' must be a string", f"{param}.call_id")
        output = item.get("output")
        if not isinstance(output, str | list):
            raise _bad(f"'{param}.output' must be a string or a list of content parts", f"{param}.output")
        _check_parts(output, f"{param}.output")
    elif itype == "reasoning":
        for key in ("summary", "content"):
            v = item.get(key)
            if v is not None and not isinstance(v, list):
                raise _bad(f"'{param}.{key}' must be a list", f"{param}.{key}")
        if item.get("encrypted_content"):
            raise _bad(f"'{param}.encrypted_content': encrypted content is not supported", f"{param}.encrypted_content")


def parse_body(data: dict[str, Any]) -> ResponsesBody:
    """Validate the fields of a Responses body that shape its prompt (types strict, as JSON); raises
    `OpenAIError` 400 naming the field. Sampling fields are checked by the caller's own rules."""
    if "input" not in data or data["input"] is None:
        raise _bad("'input' is required", "input")
    inp = data["input"]
    if isinstance(inp, list):
        for i, item in enumerate(inp):
            check_item(item, f"input[{i}]")
    elif not isinstance(inp, str):
        raise _bad("'input' must be a string or a list of input items", "input")
    instructions = _opt(data, "instructions", (str,), "a string")
    prev = _opt(data, "previous_response_id", (str,), "a string")
    if prev is not None and not prev.startswith(RESPONSE_ID_PREFIX):
        raise invalid_id(prev)
    tools = data.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _bad("'tools' must be a list of objects", "tools")
    for i, t in enumerate(tools):
        if t.get("type") == "function" and not isinstance(t.get("name"), str):
            raise _bad(f"'tools[{i}].name' must be a string", f"tools[{i}].name")
    store = _opt(data, "store", (bool,), "a boolean")
    stream = _opt(data, "stream", (bool,), "a boolean")
    for key in ("prompt_cache_key", "user", "model"):
        _opt(data, key, (str,), "a string")
    return ResponsesBody(input=inp, instructions=instructions or None, previous_response_id=prev,
                         tools=tuple(tools), store=True if store is None else store, stream=bool(stream))


def _chat_parts(content: Any) -> Any:
    if not isinstance(content, list):
        return content
    out = []
    for part in content:
        ptype = part.get("type")
        if ptype in ("input_text", "output_text"):
            out.append({"type": "text", "text": part["text"]})
        elif ptype == "input_image":
            url = part.get("image_url")  # "" is a string check_item accepted: never fall through to None
            out.append({"type": "image_url", "image_url": {"url": url if isinstance(url, str) else part["file_id"]}})
        else:
            out.append(part)
    return out


def _first_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        first = content[0]
        if isinstance(first, dict):
            for key in ("text", "refusal"):
                if isinstance(first.get(key), str):
                    return first[key]
    return ""


def _reasoning_text(item: dict[str, Any]) -> str:
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts:
            first = parts[0]
            text = first.get("text", "") if isinstance(first, dict) else first
            return text if isinstance(text, str) else ""
    return ""


def input_items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validated input items -> chat messages (module docstring, step 3). New dicts; `items` is not changed."""
    messages: list[dict[str, Any]] = []
    for item in items:
        itype = item.get("type")
        prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
        if itype == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if prev is not None:
                prev.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif itype == "function_call_output":
            messages.append({"role": "tool", "content": _chat_parts(item["output"]), "tool_call_id": item["call_id"]})
        elif itype == "reasoning":
            text = _reasoning_text(item)
            if prev is not None and prev.get("reasoning") is None:
                prev["reasoning"] = text
            else:
                messages.append({"role": "assistant", "reasoning": text})
        elif itype is None or itype == "message":
            if item["role"] == "assistant":
                text = _first_text(item["content"])
                if prev is not None and prev.get("content") is None:
                    prev["content"] = text
                else:
                    messages.append({"role": "assistant", "content": text})
            else:
                messages.append({"role": item["role"], "content": _chat_parts(item["content"])})
        else:  # not a type this module knows: one opaque part (module docstring)
            messages.append({"role": "user", "content": [item]})
    return messages


def output_to_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's ``output`` items -> the assistant messages a follow-up's prompt carries (only
    message items, one per content part; reasoning and function calls are skipped, as vLLM does)."""
    messages: list[dict[str, Any]] = []
    for item in output:
        if isinstance(item, dict) and item.get("type") == "message":
            for part in item.get("content") or ():
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    messages.append({"role": "assistant", "content": part["text"]})
    return messages


def input_messages(body: ResponsesBody, prev_messages: list[dict[str, Any]] | None = None,
                   prev_output: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The chat messages of a Responses request (module docstring, steps 1-3). `prev_messages`: the stored
    messages of the previous response; `prev_output`: its output items (both None for a first turn)."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if prev_messages is not None:
        messages.extend(m for m in prev_messages if m.get("role") != "system")
    if prev_output is not None:
        messages.extend(output_to_messages(prev_output))
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        messages.extend(input_items_to_messages(body.input))
    return messages


def chat_tools(tools: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses function tools (flat: ``{"type": "function", "name", "description", "parameters"}``) in the
    chat form a chat template renders (``{"type": "function", "function": {...}}``); other tool types
    (built-in tools) are dropped, as vLLM does for chat-template rendering."""
    return [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
            for t in tools if t.get("type") == "function"]
