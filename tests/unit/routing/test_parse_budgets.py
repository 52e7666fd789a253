"""Issue 27: parse budgets (a clear 400 naming the limit past them), validation as vLLM 0.33's protocol models,
and which bodies are parsed off the event loop (extproc/parse_offload.py; the worker processes themselves are
tested in tests/integration/routing/test_parse_workers.py).

The vLLM cases were checked against the vllm==0.33.0 wheel: its ChatCompletionRequest validators
(entrypoints/openai/chat_completion/protocol.py: check_tool_usage, validate_response_format) and its message
types (renderers/chat_utils/types.py, validated with pydantic: content may be absent, but null only for an
assistant or function message); the messages quoted are vLLM's own where it writes one."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.extproc.parse_offload import ParseOffload, precheck_lists
from prefixroute.extproc.routing.request import parse_request
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.openai_errors import OpenAIError

CHAT, COMP, RESP = "/v1/chat/completions", "/v1/completions", "/v1/responses"
S = RoutingSettings(max_messages=50, max_content_parts=40, max_input_chars=10_000)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}


def _err(body: dict, path: str = CHAT, settings: RoutingSettings = S) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse_request("POST", path, {}, orjson.dumps(body), settings)
    return info.value


def _ok(body: dict, path: str = CHAT, settings: RoutingSettings = S):
    return parse_request("POST", path, {}, orjson.dumps(body), settings)


@pytest.mark.parametrize("body, path, param, limit", [
    ({"messages": [{"role": "user", "content": "a"}] * 51}, CHAT, "messages", "max_messages"),
    ({"input": [{"role": "user", "content": "a"}] * 51}, RESP, "input", "max_messages"),
    ({"prompt": ["a"] * 51}, COMP, "prompt", "max_messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 41}]}, CHAT,
     "messages[0].content", "max_content_parts"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [TOOL] * 41}, CHAT, "tools", "max_content_parts"),
    ({"messages": [{"role": "user", "content": "a" * 6000}, {"role": "user", "content": "b" * 6000}]}, CHAT,
     "messages[1].content", "max_input_chars"),
    ({"prompt": "x" * 10_001}, COMP, "prompt", "max_input_chars"),
    ({"prompt": [1] * 10_001}, COMP, "prompt", "max_input_chars"),
])
def test_budgets_give_a_400_naming_the_limit(body, path, param, limit):
    err = _err({"model": "m", **body}, path)
    assert (err.status, err.param) == (400, param)
    assert limit in err.message
    assert _ok({"model": "m", "messages": [{"role": "user", "content": "a"}] * 50})  # at the limit: fine


def test_a_long_response_id_is_vllms_404_without_a_lookup():
    err = _err({"model": "m", "input": "hi", "previous_response_id": "resp_" + "x" * 33_000}, RESP)
    assert err.status == 404 and err.param == "response_id" and len(err.message) < 300
    with pytest.raises(OpenAIError) as info:
        parse_request("GET", "/v1/responses/resp_" + "y" * 1000, {}, b"", S)
    assert info.value.status == 404


# (body fields, param of the 400): refused by vLLM 0.33 (module docstring), so refused here too.
REFUSED = [
    ({"logit_bias": 5}, "logit_bias"),
    ({"logit_bias": {"1": "x"}}, "logit_bias"),
    ({"response_format": 5}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema"),
    ({"tool_choice": 5, "tools": [TOOL]}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [TOOL]}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {}}, "tools": [TOOL]}, "tool_choice.function.name"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function"),
    ({"tools": []}, "tools"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "x"}]}, "messages[0].content"),
]
ACCEPTED = [
    {"logit_bias": {"1": 2, "50256": -100.0}},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
    {"response_format": {"type": "structural_tag", "format": {}}},
    {"tool_choice": "none"},
    {"tool_choice": "required", "tools": [TOOL]},
    {"tool_choice": {"type": "function", "function": {"name": "f"}}, "tools": [TOOL]},
    {"messages": [{"role": "user"}]},  # absent content: vLLM's custom message type takes it
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                                     "tool_calls": [{"id": "1", "type": "function",
                                                                     "function": {"name": "f", "arguments": "{}"}}]}]},
]


@pytest.mark.parametrize("fields, param", REFUSED)
def test_refused_as_vllm_refuses(fields, param):
    err = _err({"model": "m", "messages": [{"role": "user", "content": "x"}], **fields})
    assert (err.status, err.param) == (400, param), err.message


@pytest.mark.parametrize("fields", ACCEPTED)
def test_accepted_as_vllm_accepts(fields):
    assert _ok({"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}).kind == "chat"


def test_completions_check_logit_bias_and_response_format_too():
    assert _err({"model": "m", "prompt": "x", "logit_bias": []}, COMP).param == "logit_bias"
    assert _err({"model": "m", "prompt": "x", "response_format": "json"}, COMP).param == "response_format"


# --- off the event loop ---------------------------------------------------------------------------------------
BIG = RoutingSettings(tokenizer="sim", inline_tokenize_bytes=1024, inline_parse_objects=8)


def test_heavy_bodies_are_named_by_size_or_objects():
    off = ParseOffload(BIG)
    small = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    many = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}] * 9})
    large = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]})
    assert not off.heavy(CHAT, small) and off.heavy(CHAT, many) and off.heavy(CHAT, large)
    assert not off.heavy("/v1/models", large)  # not parsed at all
    assert not ParseOffload(RoutingSettings(parse_workers=0)).heavy(CHAT, large)
    text = ParseOffload(RoutingSettings(inline_parse_objects=8))  # hashing text: a long prompt is cheap
    assert not text.heavy(CHAT, large) and text.heavy(CHAT, many)
    assert text.heavy(CHAT, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * (1 << 20)}]}))


def test_a_full_parse_queue_answers_503_at_once():
    async def run():
        off = ParseOffload(RoutingSettings(max_parse_queue=1, inline_parse_bytes=10))
        off.in_queue = 1  # one body already waits
        with pytest.raises(OpenAIError) as info:
            await off.parse("POST", CHAT, {}, b'{"messages": []}', None)
        assert info.value.status == 503 and info.value.retry_after_s == 1 and off.num_refused == 1

    asyncio.run(run())


@pytest.mark.parametrize("body, path", [
    ({"messages": [{"role": "user", "content": "a"}] * 51}, CHAT),
    ({"messages": ["not an object"] * 51}, CHAT),  # refused for its count first, as parse_request does
    ({"input": [{"role": "user", "content": "a"}] * 51}, RESP),
    ({"prompt": ["a"] * 51}, COMP),
    ({"prompt": [[1, 2]] * 51}, COMP),
])
def test_the_workers_precheck_refuses_exactly_what_the_parse_refuses_for_its_count(body, path):
    """The worker skims the top-level list's length before the full parse (parse_offload.precheck_lists): its
    400 is the parse's own, word for word."""
    data = orjson.dumps({"model": "m", **body})
    with pytest.raises(OpenAIError) as info:
        precheck_lists(path, {}, data, S)
    full = _err({"model": "m", **body}, path)
    assert (info.value.status, info.value.param, info.value.message) == (full.status, full.param, full.message)


@pytest.mark.parametrize("data, path, headers", [
    (orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "a"}] * 50}), CHAT, {}),  # at the limit
    (orjson.dumps({"model": "m", "prompt": [1] * 51}), COMP, {}),  # token ids: max_input_tokens' business
    (orjson.dumps({"model": "m", "input": "a string"}), RESP, {}),
    (orjson.dumps({"model": "m", "messages": {"role": "user"}}), CHAT, {}),  # the parse names the wrong type
    (b'{"model": "m", "messages": [' + b'{},' * 60, CHAT, {}),  # truncated JSON: the parse's 400
    (orjson.dumps({"model": "m", "messages": [{}] * 60}), CHAT, {"content-encoding": "gzip"}),  # not decoded here
    (orjson.dumps({"model": "m", "messages": [{}] * 60}), "/v1/models", {}),
])
def test_the_workers_precheck_leaves_every_other_body_to_the_parse(data, path, headers):
    precheck_lists(path, headers, data, S)  # no exception


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(-2**40, 2**40), st.text(max_size=3), st.dictionaries(st.text(max_size=3), st.integers(0, 9),
                                                                              max_size=2)), max_size=60),
       st.sampled_from(["messages", "input", "prompt"]), st.sampled_from([CHAT, RESP, COMP]))
def test_the_precheck_never_refuses_a_body_the_parse_accepts(items, key, path):
    data = orjson.dumps({"model": "m", key: items})
    try:
        precheck_lists(path, {}, data, S)
    except OpenAIError as err:
        full = _err({"model": "m", key: items}, path)
        assert full.status == 400 and "max_messages" in err.message
