"""The simulated server's Responses API pieces (pure): the bounded LRU response store, tool choice, the
response object and the SSE encoder, checked against the openai SDK's own types."""

from __future__ import annotations

import orjson
import pytest
import typing

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import ValidationError

from prefixroute.model_servers import protocol, response_store
from prefixroute.openai_errors import OpenAIError

MSGS = [{"role": "user", "content": "hi"}]


def resp(i: int, pad: int = 0) -> dict:
    return {"id": f"resp_{i}", "pad": "x" * pad}


def test_store_entry_cap_evicts_least_recently_used_first() -> None:
    s = response_store.ResponseStore(max_entries=3, max_bytes=1 << 20)
    for i in range(3):
        assert s.put(f"resp_{i}", MSGS, resp(i))
    assert s.get("resp_0") is not None  # a follow-up's read refreshes resp_0: resp_1 is now the oldest
    s.put("resp_3", MSGS, resp(3))
    assert s.ids() == ["resp_2", "resp_0", "resp_3"]
    assert "resp_1" not in s and s.num_evictions == 1 and len(s) == 3
    s.put("resp_4", MSGS, resp(4))
    assert s.ids() == ["resp_0", "resp_3", "resp_4"] and s.num_evictions == 2


def test_store_peek_does_not_refresh() -> None:
    s = response_store.ResponseStore(max_entries=2, max_bytes=1 << 20)
    s.put("resp_a", MSGS, resp(0))
    s.put("resp_b", MSGS, resp(1))
    assert s.peek("resp_a") is not None
    s.put("resp_c", MSGS, resp(2))
    assert s.ids() == ["resp_b", "resp_c"]


def test_store_byte_cap_counts_json_of_messages_and_response() -> None:
    entry = len(orjson.dumps(resp(0, 1000))) + len(orjson.dumps(MSGS))
    s = response_store.ResponseStore(max_entries=100, max_bytes=3 * entry + entry // 2)
    for i in range(3):
        s.put(f"resp_{i}", MSGS, resp(i, 1000))
    assert len(s) == 3 and s.num_bytes == 3 * entry
    s.put("resp_3", MSGS, resp(3, 1000))  # over the byte cap by half an entry: the oldest goes
    assert s.ids() == ["resp_1", "resp_2", "resp_3"] and s.num_bytes == 3 * entry and s.num_evictions == 1
    big = response_store.ResponseStore(max_entries=100, max_bytes=10 * entry)
    for i in range(3):
        big.put(f"resp_{i}", MSGS, resp(i, 1000))
    big.put("resp_huge", MSGS, resp(9, 11 * entry))  # bigger than the whole cap alone: not stored, nothing evicted
    assert "resp_huge" not in big and big.num_too_large == 1 and len(big) == 3 and big.num_evictions == 0


def test_store_replace_keeps_bytes_exact() -> None:
    s = response_store.ResponseStore(max_entries=10, max_bytes=1 << 20)
    s.put("resp_a", MSGS, resp(0, 500))
    s.put("resp_a", MSGS, resp(0, 10))
    assert len(s) == 1 and s.num_bytes == len(orjson.dumps(resp(0, 10))) + len(orjson.dumps(MSGS))


def test_store_rejects_zero_bounds() -> None:
    with pytest.raises(ValueError):
        response_store.ResponseStore(max_entries=0, max_bytes=10)


TOOLS = ({"type": "web_search"}, {"type": "function", "name": "a", "parameters": {"properties": {"city": {}}}},
         {"type": "function", "name": "b"})


@pytest.mark.parametrize(("choice", "name"), [
    (None, None), ("auto", None), ("none", None), ("required", "a"), ({"type": "function", "name": "b"}, "b"),
    ({"type": "web_search"}, None),
])
def test_forced_function(choice, name) -> None:
    f = response_store.forced_function(TOOLS, choice)
    assert (f["name"] if f else None) == name


@pytest.mark.parametrize("choice", [{"type": "function", "name": "zzz"}, {"type": "function"}, 3, "always"])
def test_forced_function_refuses(choice) -> None:
    with pytest.raises(OpenAIError) as ei:
        response_store.forced_function(TOOLS, choice)
    assert ei.value.status == 400 and ei.value.param.startswith("tool_choice")


def test_required_without_function_tools_answers_text() -> None:
    assert response_store.forced_function(({"type": "web_search"},), "required") is None


def meta(function=None, data=None) -> response_store.ResponseMeta:
    return response_store.ResponseMeta(
        response_id=response_store.new_id("resp"), created_at=1, model="m", max_output_tokens=3, store=True,
        data=data or {}, tools=list(TOOLS), instructions=None, previous_response_id=None, function=function,
        item_id=response_store.new_id("fc" if function else "msg"), call_id=response_store.new_id("call", 24))


def test_ids_have_vllm_shape() -> None:
    rid = response_store.new_id("resp")
    assert rid.startswith("resp_") and len(rid) == 37 and int(rid[5:], 16) >= 0


def _event_classes() -> dict[str, type]:
    union = typing.get_args(ResponseStreamEvent)[0]  # Annotated[Union[...], discriminator]
    return {typing.get_args(cls.model_fields["type"].annotation)[0]: cls for cls in typing.get_args(union)}


EVENT_CLASSES = _event_classes()


def strict(model, value):
    """Validate `value` with the SDK's strict pydantic types. The one error tolerated: a missing
    ``cache_write_tokens`` (a newer OpenAI-only usage field vLLM does not send; the SDK's client parses
    leniently and reads it as None)."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        errors = [e for e in exc.errors() if not (e["type"] == "missing" and e["loc"][-1] == "cache_write_tokens")]
        assert not errors, errors
        return None


def test_response_object_parses_as_sdk_response() -> None:
    m = meta(data={"temperature": 0.5, "metadata": {"k": "v"}, "user": "u"})
    obj = response_store.response_object(m, status="completed", output=response_store.output_items(m, " a b"),
                                     usage_=response_store.usage(10, 2, 8))
    strict(Response, orjson.loads(orjson.dumps(obj)))
    r = Response.construct(**orjson.loads(orjson.dumps(obj)))  # how the SDK's client parses a body
    assert r.output_text == " a b" and r.usage.input_tokens_details.cached_tokens == 8
    assert r.usage.total_tokens == 12 and r.temperature == 0.5 and r.top_p == 1.0 and r.metadata == {"k": "v"}


def events(raw: bytes) -> list[dict]:
    out = []
    assert raw.endswith(b"\n\n")
    for block in raw.split(b"\n\n")[:-1]:
        name, data = block.split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: ")
        ev = orjson.loads(data[6:])
        assert ev["type"] == name[7:].decode()
        strict(EVENT_CLASSES[ev["type"]], ev)  # the SDK's own (strict) type of that event accepts it
        out.append(ev)
    return out


def stream(m: response_store.ResponseMeta, words: list[bytes]) -> list[dict]:
    enc = response_store.StreamEncoder(m)
    raw = enc.opening() + enc.first()
    raw += b"".join(enc.token(w, i, i == len(words) - 1) for i, w in enumerate(words))
    text = b"".join(words).decode()
    final = response_store.response_object(m, status="completed", output=response_store.output_items(m, text),
                                      usage_=response_store.usage(5, len(words), 0))
    return events(raw + enc.closing(text, len(words), final))


def test_stream_text_events_in_vllm_order() -> None:
    evs = stream(meta(), [b" x", b" y", b" z"])
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert "".join(e["delta"] for e in evs if e["type"].endswith(".delta")) == " x y z"
    assert evs[-1]["response"]["output"][0]["content"][0]["text"] == " x y z"
    assert evs[0]["response"]["status"] == "in_progress" and evs[0]["response"]["usage"] is None


@pytest.mark.parametrize("num", [1, 4])
def test_stream_function_call_arguments_concatenate_to_json(num) -> None:
    m = meta(function=TOOLS[1])
    evs = stream(m, [b" w"] * num)
    types = [e["type"] for e in evs]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * num, "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    args = "".join(e["delta"] for e in evs if e["type"].endswith(".delta"))
    assert orjson.loads(args) == {"city": " w" * num}  # the tool's first parameter, a JSON object
    done = evs[-3]
    assert done["arguments"] == args and done["name"] == "a"
    item = evs[-1]["response"]["output"][0]
    assert item["type"] == "function_call" and item["call_id"].startswith("call_") and item["arguments"] == args


@pytest.mark.parametrize(("data", "param"), [
    ({"max_output_tokens": 0}, "max_output_tokens"), ({"max_output_tokens": "5"}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_logprobs": 21}, "top_logprobs"),
    ({"cache_salt": ""}, "cache_salt"), ({"cache_salt": 5}, "cache_salt"), ({"background": True}, "background"),
    ({"metadata": {"k": 1}}, "metadata"), ({"stop": [1]}, "stop"),
])
def test_check_responses_fields_refuses(data, param) -> None:
    with pytest.raises(OpenAIError) as ei:
        protocol.check_responses_fields(data)
    assert ei.value.status == 400 and ei.value.param == param


def test_check_responses_fields_prompt_cache_key_is_not_a_salt() -> None:
    assert protocol.check_responses_fields({"prompt_cache_key": "k", "max_output_tokens": 7}) == (7, None)
    assert protocol.check_responses_fields({"prompt_cache_key": "k", "cache_salt": "s"}) == (None, "s")
