"""Request parsing and canonicalisation (routing/request.py)."""

from __future__ import annotations

import json
import random

import orjson
import pytest
from hypothesis import given, settings as hsettings, strategies as st

from prefixroute.openai_errors import OpenAIError
from prefixroute.extproc.routing.hashing import hash_blocks, seed_for
from prefixroute.extproc.routing.request import canonical_text, parse_request
from prefixroute.extproc.routing.settings import RoutingSettings

S = RoutingSettings()
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
LONG = "You are a meticulous assistant. " * 40  # 1,280 chars = 20 blocks


def chat(messages, **extra) -> bytes:
    return orjson.dumps({"model": "m", "messages": messages, **extra})


def parse(body: bytes, path: str = CHAT, headers=None, method: str = "POST", settings: RoutingSettings = S):
    return parse_request(method, path, headers or {}, body, settings)


# --- accepted requests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,kind,model,stream,num_blocks", [
    (CHAT, chat([{"role": "user", "content": LONG}]), "chat", "m", False, (len("<|user|>") + len(LONG) + 1) // 64),
    (CHAT, chat([{"role": "user", "content": "hi"}], stream=True), "chat", "m", True, 0),
    (CHAT, orjson.dumps({"messages": [{"role": "user", "content": LONG}]}), "chat", None, False, 20),
    (CHAT, chat([{"role": "user", "content": [{"type": "text", "text": LONG}]}]), "chat", "m", False, 20),
    (CHAT, chat([{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "1",
            "content": LONG}]), "chat", "m", False, 21),
    (COMP, orjson.dumps({"model": "m", "prompt": LONG}), "completion", "m", False, 20),
    (COMP, orjson.dumps({"model": "m", "prompt": [LONG, "other"]}), "completion", "m", False, 20),
    (COMP, orjson.dumps({"model": "m", "prompt": list(range(1000, 1100))}), "completion", "m", False,
     (len("<|ids|>") + 500) // 64),
    (COMP, orjson.dumps({"model": "m", "prompt": [list(range(1000, 1100)), [1]]}), "completion", "m", False, 7),
])
def test_accepted(path, body, kind, model, stream, num_blocks):
    r = parse(body, path)
    assert (r.kind, r.model, r.stream, len(r.block_hashes)) == (kind, model, stream, num_blocks)


def test_other_paths_are_not_parsed():
    r = parse(b"not json", "/v1/models?x=1", method="GET", headers={"x-request-id": "abc"})
    assert (r.kind, r.path, r.block_hashes, r.request_id) == ("other", "/v1/models", [], "abc")


def test_request_id_from_header():
    assert parse(chat([{"role": "user", "content": "x"}]), headers={"x-request-id": "r-1"}).request_id == "r-1"


# --- rejected requests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    (CHAT, b"", None),
    (CHAT, b"{not json", None),
    (CHAT, b"[1, 2]", None),
    (CHAT, b'"string"', None),
    (CHAT, orjson.dumps({"model": "m"}), "messages"),
    (CHAT, orjson.dumps({"model": "m", "messages": []}), "messages"),
    (CHAT, orjson.dumps({"model": "m", "messages": "hi"}), "messages"),
    (CHAT, orjson.dumps({"model": 3, "messages": [{"role": "user", "content": "x"}]}), "model"),
    (CHAT, chat([{"role": "user", "content": "x"}], stream="yes"), "stream"),
    (CHAT, chat([{"role": "user", "content": "x"}], prompt_cache_key=5), "prompt_cache_key"),
    (CHAT, chat([{"role": "user", "content": "x"}], tools={"a": 1}), "tools"),
    (CHAT, chat(["hi"]), "messages[0]"),
    (CHAT, chat([{"content": "x"}]), "messages[0].role"),
    (CHAT, chat([{"role": "user", "content": "x"}, {"role": "user", "content": 5}]), "messages[1].content"),
    (CHAT, chat([{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text"),
    (CHAT, chat([{"role": "user", "content": [{"text": "x"}]}]), "messages[0].content[0].type"),
    (CHAT, chat([{"role": "user", "content": ["x"]}]), "messages[0].content[0]"),
    (CHAT, chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content[0].image_url"),
    (CHAT, chat([{"role": "user", "name": 1, "content": "x"}]), "messages[0].name"),
    (CHAT, chat([{"role": "tool", "tool_call_id": 1, "content": "x"}]), "messages[0].tool_call_id"),
    (CHAT, chat([{"role": "assistant", "tool_calls": {}}]), "messages[0].tool_calls"),
    # a bad message far beyond the hashed prefix is still rejected: acceptance never depends on length
    (CHAT, chat([{"role": "user", "content": "x" * 100_000}, {"role": 7}]), "messages[1].role"),
    (COMP, orjson.dumps({"model": "m"}), "prompt"),
    (COMP, orjson.dumps({"model": "m", "prompt": []}), "prompt"),
    (COMP, orjson.dumps({"model": "m", "prompt": 5}), "prompt"),
    (COMP, orjson.dumps({"model": "m", "prompt": ["a", 1]}), "prompt"),
    (COMP, orjson.dumps({"model": "m", "prompt": [1, "a"]}), "prompt"),
    (COMP, orjson.dumps({"model": "m", "prompt": [1, True]}), "prompt"),
    (COMP, orjson.dumps({"model": "m", "prompt": [[1], []]}), "prompt"),
    (COMP, orjson.dumps({"model": "m", "prompt": [{"a": 1}]}), "prompt"),
])
def test_rejected_with_400_and_param(path, body, param):
    with pytest.raises(OpenAIError) as info:
        parse(body, path)
    assert info.value.status == 400
    assert info.value.param == param
    assert json.loads(info.value.body())["error"]["code"] == 400


def test_body_over_limit_is_413_on_any_path():
    small = RoutingSettings(max_body_bytes=100)
    body = chat([{"role": "user", "content": "x" * 200}])
    for path in (CHAT, "/v1/models"):
        with pytest.raises(OpenAIError) as info:
            parse(body, path, settings=small)
        assert info.value.status == 413
    assert parse(chat([{"role": "user", "content": "x"}]), settings=small).kind == "chat"  # at the limit: fine


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
@pytest.mark.parametrize("path", [CHAT, COMP])
def test_wrong_method_is_405(method, path):
    with pytest.raises(OpenAIError) as info:
        parse(b"", path, method=method)
    assert info.value.status == 405


def test_nesting_deeper_than_the_serialiser_is_400_not_a_crash():
    body = b'{"messages": [{"role": "user", "content": "x"}], "tools": ' + b"[" * 400 + b"]" * 400 + b"}"
    with pytest.raises(OpenAIError) as info:
        parse(body)
    assert info.value.status == 400 and info.value.param.startswith("tools")  # vLLM: a tool must be an object


# --- canonicalisation ------------------------------------------------------------------------------------------
def test_canonical_text_of_a_chat():
    body = {"tools": [{"b": 1, "a": 2}], "messages": [
        {"role": "system", "content": "S"},
        {"role": "user", "name": "bob", "content": [{"type": "text", "text": "T1"}, {"type": "text", "text": "T2"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "R"}]}
    assert canonical_text(body, "chat", 10_000) == (
        '<|tools|>[{"a":2,"b":1}]\n<|system|>S\n<|user|>name=bob\nT1T2\n'
        '<|assistant|><|tool_calls|>[{"function":{"name":"f"},"id":"c"}]\n<|tool|>R<|tool_call_id|>c\n')


@pytest.mark.parametrize("a,b,same", [
    ({"type": "image_url", "image_url": {"url": "http://x/1.png"}},
     {"type": "image_url", "image_url": "http://x/1.png"}, True),
    ({"type": "image_url", "image_url": {"url": "http://x/1.png"}},
     {"type": "image_url", "image_url": {"url": "http://x/2.png"}}, False),
    ({"type": "input_audio", "input_audio": {"data": "AAA", "format": "wav"}},
     {"input_audio": {"format": "wav", "data": "AAA"}, "type": "input_audio"}, True),
    ({"type": "input_audio", "input_audio": {"data": "AAA", "format": "wav"}},
     {"type": "input_audio", "input_audio": {"data": "AAB", "format": "wav"}}, False),
])
def test_non_text_parts_render_to_stable_placeholders(a, b, same):
    def text(part):
        return canonical_text({"messages": [{"role": "user", "content": [part]}]}, "chat", 10_000)
    assert (text(a) == text(b)) is same
    assert len(text(a)) < 60  # a placeholder, not the (possibly huge) payload


def test_tools_belong_to_the_prefix():
    msgs = [{"role": "user", "content": LONG}]
    plain = parse(chat(msgs)).block_hashes
    with_tools = parse(chat(msgs, tools=[{"type": "function", "function": {"name": "lookup"}}])).block_hashes
    assert plain[0] != with_tools[0]


def test_rendering_is_bounded_but_counts_all_characters():
    r = parse(chat([{"role": "user", "content": "x" * 1_000_000}]))
    assert len(r.block_hashes) == S.max_blocks
    assert r.num_prompt_chars == 1_000_000
    short = parse(chat([{"role": "user", "content": "x" * (S.max_prompt_chars + 100)}]))
    assert short.block_hashes == r.block_hashes


def test_token_ids_keep_the_prefix_property_and_differ_from_text():
    ids = [random.Random(1).randrange(50_000) for _ in range(400)]
    a = parse(orjson.dumps({"prompt": ids[:200]}), COMP).block_hashes
    b = parse(orjson.dumps({"prompt": ids}), COMP).block_hashes
    assert a and b[: len(a)] == a
    as_text = parse(orjson.dumps({"prompt": ",".join(map(str, ids)) + ","}), COMP).block_hashes
    assert not set(as_text) & set(b)


# --- tenant and model salting ------------------------------------------------------------------------------------
@pytest.mark.parametrize("headers,extra,tenant", [
    ({}, {}, None),
    ({"x-prefixroute-tenant": "acme"}, {}, "acme"),
    ({}, {"prompt_cache_key": "k1"}, "k1"),
    ({"x-prefixroute-tenant": "acme"}, {"prompt_cache_key": "k1"}, "acme\x1fk1"),
    ({"x-prefixroute-tenant": ""}, {}, None),
])
def test_tenant_key(headers, extra, tenant):
    r = parse(chat([{"role": "user", "content": LONG}], **extra), headers=headers)
    assert r.tenant == tenant


def test_tenants_and_models_share_no_hash():
    msgs = [{"role": "user", "content": LONG}]
    variants = [parse(chat(msgs)), parse(chat(msgs), headers={"x-prefixroute-tenant": "a"}),
                parse(chat(msgs), headers={"x-prefixroute-tenant": "b"}), parse(chat(msgs, prompt_cache_key="a")),
                parse(orjson.dumps({"model": "lora-1", "messages": msgs}))]
    seen: set[int] = set()
    for r in variants:
        assert len(r.block_hashes) == 20
        assert not seen & set(r.block_hashes)
        seen |= set(r.block_hashes)


def test_tenant_header_is_configurable():
    s = RoutingSettings(tenant_header="x-org")
    body = chat([{"role": "user", "content": LONG}])
    assert parse(body, headers={"x-org": "o1"}, settings=s).tenant == "o1"
    assert parse(body, headers={"x-prefixroute-tenant": "o1"}, settings=s).tenant is None


# --- properties ----------------------------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20)
content_parts = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=80)),
    st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, st.text(max_size=20)))
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
     "content": st.one_of(st.text(max_size=300), st.lists(content_parts, max_size=3))},
    optional={"name": st.text(min_size=1, max_size=8)}), min_size=1, max_size=6)
fuzz_bodies = st.one_of(
    json_values,
    st.fixed_dictionaries({}, optional={"model": json_values, "messages": st.one_of(json_values, messages),
                                        "prompt": json_values, "stream": json_values, "tools": json_values,
                                        "prompt_cache_key": json_values}),
    st.fixed_dictionaries({"messages": st.lists(st.dictionaries(
        st.sampled_from(["role", "content", "name", "tool_calls", "tool_call_id"]), json_values), max_size=3)}))


@hsettings(max_examples=300, deadline=None)
@given(body=fuzz_bodies, path=st.sampled_from([CHAT, COMP]))
def test_random_bodies_raise_only_openai_errors(body, path):
    try:
        parse(orjson.dumps(body), path)
    except OpenAIError as exc:
        assert exc.status == 400 and exc.message


@hsettings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=200), path=st.sampled_from([CHAT, COMP]))
def test_random_bytes_raise_only_openai_errors(raw, path):
    try:
        parse(raw, path)
    except OpenAIError as exc:
        assert exc.status == 400


def _shuffled_json(value, rnd: random.Random, indent: bool) -> str:
    """Serialise with random key order and whitespace (what different client libraries produce)."""
    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        sep = ",\n  " if indent else ", "
        return "{" + sep.join(f"{json.dumps(k)} : {_shuffled_json(v, rnd, indent)}" for k, v in items) + "}"
    if isinstance(value, list):
        return "[ " + " ,".join(_shuffled_json(v, rnd, indent) for v in value) + " ]"
    return json.dumps(value, ensure_ascii=rnd.random() < 0.5)


@hsettings(max_examples=150, deadline=None)
@given(msgs=messages, seed=st.integers(0, 2**32), indent=st.booleans())
def test_hashes_ignore_key_order_whitespace_and_escapes(msgs, seed, indent):
    body = {"model": "m", "stream": False, "messages": msgs}
    reference = parse(orjson.dumps(body)).block_hashes
    variant = _shuffled_json(body, random.Random(seed), indent).encode()
    assert parse(variant).block_hashes == reference


@hsettings(max_examples=150, deadline=None)
@given(msgs=messages, more=messages)
def test_next_turn_extends_the_previous_turns_hashes(msgs, more):
    turn_n = parse(chat(msgs)).block_hashes
    turn_n1 = parse(chat(msgs + more)).block_hashes
    assert turn_n1[: len(turn_n)] == turn_n


@hsettings(max_examples=100, deadline=None)
@given(msgs=messages)
def test_hashes_are_the_hashes_of_the_canonical_text(msgs):
    text = canonical_text({"messages": msgs}, "chat", S.max_prompt_chars)
    expected = hash_blocks(text, seed_for("m", None), S.block_chars, S.max_blocks)
    assert parse(chat(msgs)).block_hashes == expected
