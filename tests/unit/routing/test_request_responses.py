"""`parse_request` on ``/v1/responses`` (hypothesis over every input item type): only `OpenAIError` escapes, a
first turn hashes exactly like its chat equivalent, a follow-up hashes only its visible head; ``/v1/responses/
{id}`` carries the id; session keys."""

from __future__ import annotations

import hashlib

import orjson
import pytest
from hypothesis import given, settings as hsettings, strategies as st

from prefixroute import responses_prompt
from prefixroute.extproc.routing.request import MAX_SESSION_KEY_CHARS, parse_request
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.openai_errors import OpenAIError

S = RoutingSettings(block_chars=16)
text = st.text(max_size=60)
part = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": text}),
    st.fixed_dictionaries({"type": st.just("input_image"), "image_url": text}),
    st.fixed_dictionaries({"type": st.just("input_file"), "file_id": text}),
)
content = st.one_of(text, st.lists(part, max_size=3))
item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]), "content": content}),
    st.fixed_dictionaries({"type": st.just("message"), "role": st.sampled_from(["user", "assistant"]),
                           "content": content}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": text, "name": text, "arguments": text}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": text,
                           "output": st.one_of(text, st.lists(part, max_size=2))}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.lists(
        st.fixed_dictionaries({"type": st.just("summary_text"), "text": text}), max_size=2)}),
    st.fixed_dictionaries({"type": st.just("item_reference"), "id": text}),
)
tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "name": text,
                                         "parameters": st.just({"type": "object"})}), max_size=2)
body = st.fixed_dictionaries({"input": st.one_of(text, st.lists(item, max_size=6))},
                             optional={"instructions": st.one_of(st.none(), text), "tools": tools,
                                       "model": st.just("m"), "stream": st.booleans()})
junk = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), text),
                    lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(text, c, max_size=3)), max_leaves=12)


def _route(b: object, path: str = "/v1/responses", headers: dict | None = None):
    return parse_request("POST", path, headers or {}, orjson.dumps(b), S)


@hsettings(max_examples=300, deadline=None)
@given(body)
def test_first_turn_hashes_like_its_chat_equivalent(b: dict) -> None:
    req = _route(b)
    parsed = responses_prompt.parse_body(b)
    messages = responses_prompt.input_messages(parsed)
    assert req.kind == "responses" and req.response_ref is None
    if not messages:
        return
    chat = {"messages": messages}
    tools = responses_prompt.chat_tools(parsed.tools)
    if tools:  # chat refuses an empty tools list (vLLM), a Responses body may send one
        chat["tools"] = tools
    if "model" in b:
        chat["model"] = b["model"]
    assert req.block_hashes == _route(chat, "/v1/chat/completions").block_hashes


@hsettings(max_examples=300, deadline=None)
@given(st.one_of(junk, st.fixed_dictionaries({"input": st.one_of(junk, st.lists(junk, max_size=4))},
                                              optional={"instructions": junk, "tools": junk,
                                                        "previous_response_id": junk, "max_output_tokens": junk,
                                                        "temperature": junk, "store": junk})))
def test_any_body_raises_only_openai_errors(b: object) -> None:
    try:
        _route(b)
    except OpenAIError as err:
        assert err.status == 400


@hsettings(max_examples=100, deadline=None)
@given(body, text)
def test_follow_up_hashes_only_tools_and_instructions(b: dict, rid_tail: str) -> None:
    rid = "resp_" + "".join(c for c in rid_tail if c.isalnum())
    req = _route({**b, "previous_response_id": rid})
    assert req.response_ref == rid
    parsed = responses_prompt.parse_body(b)
    head = [{"role": "system", "content": parsed.instructions}] if parsed.instructions else []
    chat_head = {"messages": head or [{"role": "user", "content": ""}]}
    if parsed.tools:  # chat refuses an empty tools list (vLLM)
        chat_head["tools"] = responses_prompt.chat_tools(parsed.tools)
    if "model" in b:
        chat_head["model"] = b["model"]
    full_head = _route(chat_head, "/v1/chat/completions").block_hashes
    # Never a block beyond the visible head; all of the head's full blocks (the user stub adds < 1 block).
    assert req.block_hashes == full_head[:len(req.block_hashes)]
    assert len(full_head) - len(req.block_hashes) <= 1


@pytest.mark.parametrize("field, value", [("max_output_tokens", 0), ("temperature", -1), ("top_p", 0),
                                          ("user", 5), ("prompt_cache_key", 1), ("stream", "yes"),
                                          ("previous_response_id", "chat_1"), ("input", None)])
def test_bad_fields_are_400_naming_them(field: str, value: object) -> None:
    with pytest.raises(OpenAIError) as ei:
        _route({"input": "hi", field: value})
    assert ei.value.status == 400
    assert ei.value.param == ("response_id" if field == "previous_response_id" else field)


@pytest.mark.parametrize("method, path, ref", [("GET", "/v1/responses/resp_abc", "resp_abc"),
                                               ("POST", "/v1/responses/resp_abc/cancel", "resp_abc"),
                                               ("DELETE", "/v1/responses/resp_abc?x=1", "resp_abc"),
                                               ("GET", "/v1/models", None)])
def test_response_paths_carry_the_id(method: str, path: str, ref: str | None) -> None:
    req = parse_request(method, path, {}, b"", S)
    assert (req.kind, req.response_ref) == ("other", ref)


def test_bad_id_in_path_is_vllms_400() -> None:
    with pytest.raises(OpenAIError) as ei:
        parse_request("GET", "/v1/responses/msg_1", {}, b"", S)
    assert ei.value.status == 400 and "msg_1" in ei.value.message


@pytest.mark.parametrize("source, headers, b, key", [
    ("header", {"x-session-id": "s1"}, {"user": "u"}, "s1"),
    ("header", {}, {"user": "u"}, None),
    ("user", {"x-session-id": "s1"}, {"user": "u"}, "u"),
    ("prompt_cache_key", {}, {"prompt_cache_key": "k"}, "k"),
    ("off", {"x-session-id": "s1"}, {"user": "u"}, None),
    # A long key is kept short, distinct per value (request.bounded_key): never the 10,000 characters.
    ("header", {"x-session-id": "x" * 10_000}, {}, "x" * (MAX_SESSION_KEY_CHARS - 33) + "~"
     + hashlib.blake2b(b"x" * 10_000, digest_size=16).hexdigest()),
])
@pytest.mark.parametrize("path, base", [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                        ("/v1/completions", {"prompt": "hi"}), ("/v1/responses", {"input": "hi"})])
def test_session_key(source: str, headers: dict, b: dict, key: str | None, path: str, base: dict) -> None:
    s = RoutingSettings(session_key=source)
    req = parse_request("POST", path, headers, orjson.dumps({**base, **b}), s)
    assert req.session_key == key


def test_empty_image_url_is_routed_not_refused() -> None:
    # responses_api turned image_url "" into url None (`"" or file_id`), which the chat renderer refused.
    req = _route({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": ""}]}]})
    assert req.kind == "responses"
