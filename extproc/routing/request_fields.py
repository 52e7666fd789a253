"""Validation of a request body's sampling fields as vLLM refuses them (`check_fields`; pure).

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
| ``prompt`` token ids | integers in [0, 2**31) (a token id is an int32 in every engine; request_prompt.py) |

20 is vLLM's default ``--max-logprobs`` and OpenAI's cap. Chat ``tools`` and ``tool_choice`` are checked as
vLLM's ChatCompletionRequest checks them (`_check_tools`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixroute.extproc.routing.request_errors import bad_request, clip
from prefixroute.types import RequestKind

MAX_LOGPROBS = 20
"""Largest ``logprobs`` (completions) / ``top_logprobs`` (chat): vLLM's default --max-logprobs, OpenAI's cap."""
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

# A field's rule is (kind, low, high, extra): kind "int" (low <= v <= high, or v == extra), "num" (low <= v <=
# high; extra True = the low end is open), "bool", "str", or a function (value, name) for the rest. The loop in
# `_check_fields` tests the plain kinds inline: a function call per field would double its cost.
Check = Callable[[Any, str], None]
Rule = tuple[Any, float | None, float | None, Any]


def _check_stop(value: Any, name: str) -> None:
    t = type(value)
    if t is str or (t is list and all(map(str.__instancecheck__, value))):
        return
    raise bad_request(f"'{name}' must be a string or an array of strings", name)


def _check_stream_options(value: Any, name: str) -> None:
    if type(value) is not dict:
        raise bad_request(f"'{name}' must be an object", name)
    for key in ("include_usage", "continuous_usage_stats"):
        v = value.get(key)
        if v is not None and v is not True and v is not False:
            raise bad_request(f"'{name}.{key}' must be a boolean", f"{name}.{key}")


def _check_logit_bias(value: Any, name: str) -> None:
    # vLLM: dict[str, float] (JSON keys are strings; the values numbers, strictly typed here).
    if type(value) is not dict or not all(type(v) in (int, float) for v in value.values()):
        raise bad_request(f"'{name}' must be an object mapping token ids to numbers", name)


_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")


def _check_response_format(value: Any, name: str) -> None:
    # vLLM's AnyResponseFormat: ResponseFormat (type text / json_object / json_schema, the last with a
    # json_schema object naming its schema) or a structural tag (format, or structures and triggers).
    if type(value) is not dict:
        raise bad_request(f"'{name}' must be an object with a 'type'", name)
    rtype = value.get("type")
    if rtype not in _RESPONSE_FORMAT_TYPES:
        raise bad_request(f"'{name}.type' must be one of {', '.join(_RESPONSE_FORMAT_TYPES)}", f"{name}.type")
    if rtype == "json_schema":
        schema = value.get("json_schema")
        if schema is None:
            raise bad_request("When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                              name)
        if type(schema) is not dict or type(schema.get("name")) is not str:
            raise bad_request(f"'{name}.json_schema' must be an object with a string 'name'", f"{name}.json_schema")
    elif rtype == "structural_tag" and "format" not in value and not (
            type(value.get("structures")) is list and type(value.get("triggers")) is list):
        raise bad_request(f"'{name}' of type structural_tag needs 'format', or 'structures' and 'triggers'", name)


def _check_tools(data: dict[str, Any]) -> None:
    """Chat ``tools`` and ``tool_choice`` as vLLM 0.33's ChatCompletionRequest checks them (its wording where it
    has one): each tool a function with a name; no empty list; a tool_choice other than none needs tools and is
    auto, required or a named function among them."""
    tools = data.get("tools")
    if tools is not None:
        if type(tools) is not list:
            raise bad_request("'tools' must be a list", "tools")
        if not tools:
            raise bad_request("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                              "entirely.", "tools")
        for i, tool in enumerate(tools):
            if type(tool) is not dict or tool.get("type", "function") != "function":
                raise bad_request(f"'tools[{i}]' must be an object of type 'function'", f"tools[{i}]")
            fn = tool.get("function")
            if type(fn) is not dict or type(fn.get("name")) is not str:
                raise bad_request(f"'tools[{i}].function' must be an object with a string 'name'",
                                  f"tools[{i}].function")
    choice = data.get("tool_choice")
    if choice is None or choice == "none":
        return
    if tools is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice in ("auto", "required"):
        return
    if type(choice) is not dict:
        raise bad_request(f"Invalid value for `tool_choice`: {clip(choice)}! Only named tools, \"none\", \"auto\" or "
                          "\"required\" are supported.", "tool_choice")
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    fn = choice.get("function")
    if type(fn) is not dict:
        raise bad_request(f"Invalid value for `function`: `{clip(fn)}` in `tool_choice`! {usage}",
                          "tool_choice.function")
    fname = fn.get("name")
    if type(fname) is not str or not fname:
        raise bad_request(f"Invalid `name` in `function`: `{clip(fname)}` in `tool_choice`! {usage}",
                          "tool_choice.function.name")
    if not any(t["function"]["name"] == fname for t in tools):
        raise bad_request("The tool specified in `tool_choice` does not match any of the specified `tools`",
                          "tool_choice")


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


def check_fields(data: dict[str, Any], kind: RequestKind) -> None:
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
                    raise bad_request(f"'{key}' must be an integer", key)
            if (value < low or (high is not None and value > high)) and value != extra:
                raise bad_request(_int_message(key, low, high, extra), key)
        elif what == "num":
            if t is not float and t is not int:  # not bool (a subclass of int)
                raise bad_request(f"'{key}' must be a number", key)
            if (value <= low if extra else value < low) or (high is not None and value > high):
                raise bad_request(_num_message(key, low, high, extra), key)
        elif what == "bool":
            if t is not bool:
                raise bad_request(f"'{key}' must be a boolean", key)
        elif what == "str":
            if t is not str:
                raise bad_request(f"'{key}' must be a string", key)
        else:
            what(value, key)
    if kind != "responses" and data.get("stream_options") and data.get("stream") is not True:
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    if kind == "chat":
        if "tools" in data or "tool_choice" in data:
            _check_tools(data)
        top = data.get("top_logprobs")
        if top is not None and top != 0 and data.get("logprobs") is not True:
            raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
