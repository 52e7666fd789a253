"""Request validation (vLLM-like 400/404s) and the SSE encoder's exact bytes."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixroute.model_servers import protocol
from prefixroute.openai_errors import OpenAIError

MODELS = frozenset({"base", "lora1"})


def parse(data, chat=True, max_model_len=1000):
    return protocol.parse_generate(data, chat=chat, served="base", models=MODELS, max_model_len=max_model_len,
                                   default_max_tokens=16)


MSG = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(("data", "chat", "status", "param"), [
    ({}, True, 400, "messages"),
    ({}, False, 400, "prompt"),
    ({"messages": MSG, "model": 3}, True, 400, "model"),
    ({"messages": MSG, "model": "other"}, True, 404, "model"),
    ({"messages": MSG, "max_tokens": 0}, True, 400, "max_tokens"),
    ({"messages": MSG, "max_tokens": True}, True, 400, "max_tokens"),
    ({"messages": MSG, "max_completion_tokens": 1.5}, True, 400, "max_completion_tokens"),
    ({"messages": MSG, "stream": 1}, True, 400, "stream"),
    ({"messages": MSG, "stream_options": {"include_usage": True}}, True, 400, "stream_options"),
    ({"messages": MSG, "stream": True, "stream_options": {"include_usage": "y"}}, True, 400,
     "stream_options.include_usage"),
    ({"messages": MSG, "temperature": "hot"}, True, 400, "temperature"),
    ({"messages": MSG, "cache_salt": 5}, True, 400, "cache_salt"),
    ({"prompt": ""}, False, 400, "prompt"),
    ({"prompt": ["a", "b"]}, False, 400, "prompt"),
    ({"prompt": [1, -2]}, False, 400, "prompt"),
    ({"prompt": "x" * 4000, "max_tokens": 10}, False, 400, "prompt"),
    ({"prompt": "x" * 3960, "max_tokens": 20}, False, 400, "prompt"),
    # issue 11 finding 9: validation gaps (each accepted, or a 500/parser error, before)
    ({"prompt": [2**63]}, False, 400, "prompt"),
    ({"prompt": [1, 2**64 - 1]}, False, 400, "prompt"),
    ({"prompt": [128256]}, False, 400, "prompt"),
    ({"prompt": "x", "stop": 5}, False, 400, "stop"),
    ({"prompt": "x", "stop": [1, 2]}, False, 400, "stop"),
    ({"prompt": "x", "stop": ["a", ""]}, False, 400, "stop"),
    ({"messages": MSG, "stop": {"a": 1}}, True, 400, "stop"),
    ({"messages": MSG, "logprobs": "yes"}, True, 400, "logprobs"),
    ({"messages": MSG, "logprobs": 1}, True, 400, "logprobs"),
    ({"messages": MSG, "top_logprobs": -5}, True, 400, "top_logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, True, 400, "top_logprobs"),
    ({"messages": MSG, "top_logprobs": 3}, True, 400, "top_logprobs"),  # needs logprobs: true (vLLM)
    ({"messages": MSG, "logprobs": True, "top_logprobs": 2.5}, True, 400, "top_logprobs"),
    ({"prompt": "x", "logprobs": True}, False, 400, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, False, 400, "logprobs"),
    ({"prompt": "x", "logprobs": 21}, False, 400, "logprobs"),
    ({"prompt": "x", "n": 0}, False, 400, "n"),
    ({"prompt": "x", "temperature": -0.5}, False, 400, "temperature"),
    ({"prompt": "x", "temperature": 2.5}, False, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, False, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.01}, False, 400, "top_p"),
    ({"prompt": "x", "presence_penalty": 3}, False, 400, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -2.5}, False, 400, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, False, 400, "repetition_penalty"),
    ({"prompt": "x", "top_k": -2}, False, 400, "top_k"),
    ({"prompt": "x", "min_p": 1.5}, False, 400, "min_p"),
    ({"prompt": "x", "seed": "1"}, False, 400, "seed"),
    ({"prompt": "x", "max_tokens": 2**63}, False, 400, "prompt"),  # over the context window
])
def test_invalid_requests(data, chat, status, param):
    with pytest.raises(OpenAIError) as ei:
        parse(data, chat)
    assert ei.value.status == status and ei.value.param == param
    assert ei.value.message


@pytest.mark.parametrize(("data", "chat"), [
    ({"prompt": "x", "stop": "end", "logprobs": 5, "temperature": 0, "top_p": 1, "top_k": -1, "seed": -1,
      "presence_penalty": -2, "frequency_penalty": 2, "min_p": 0, "repetition_penalty": 1.1}, False),
    ({"prompt": "x", "stop": ["a", "b"], "logprobs": 0, "top_k": 0}, False),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 20, "stop": None, "temperature": 2}, True),
    ({"messages": MSG, "logprobs": False, "top_logprobs": 0}, True),
])
def test_sampling_fields_vllm_accepts(data, chat):
    assert parse(data, chat).max_tokens >= 1


def test_echoed_values_are_truncated():
    with pytest.raises(OpenAIError) as ei:
        parse({"messages": MSG, "model": "m" * 1_000_000})
    assert ei.value.status == 404 and len(ei.value.message) < 200
    with pytest.raises(OpenAIError) as ei:
        parse({"prompt": "x", "stop": ["s" * 100_000, 1]}, chat=False)
    assert len(ei.value.message) < 300
    with pytest.raises(OpenAIError) as ei:
        parse({"messages": [{"role": "r" * 100_000, "content": "x"}]})
    assert ei.value.param == "messages[0].role" and len(ei.value.message) < 200


@pytest.mark.parametrize(("data", "chat", "max_tokens", "n_prompt"), [
    ({"prompt": "abcdefgh"}, False, 16, 2),
    ({"prompt": ["abcdefgh"]}, False, 16, 2),
    ({"prompt": [5, 6, 7], "max_tokens": 3}, False, 3, 3),
    ({"prompt": [[5, 6, 7]]}, False, 16, 3),
    ({"messages": MSG, "max_tokens": 5, "max_completion_tokens": 7}, True, 7, None),
    ({"prompt": "x" * 3960}, False, 10, 990),  # default max_tokens capped by the context window
])
def test_valid_requests(data, chat, max_tokens, n_prompt):
    g = parse(data, chat)
    assert g.max_tokens == max_tokens and g.model == "base"
    if n_prompt is not None:
        assert len(g.prompt_ids) == n_prompt


KEYS = st.sampled_from(["prompt", "messages", "model", "max_tokens", "stream", "stream_options", "n", "tools",
                        "cache_salt", "role", "content", "type", "text", "include_usage", "tool_calls"])


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5) | st.just("base"),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(KEYS | st.text(max_size=4), c, max_size=5),
                    max_leaves=16),
       st.booleans())
def test_arbitrary_json_parses_or_gives_a_4xx(data, chat):
    body = json.dumps(data).encode()
    try:
        g = parse(protocol.load_json_object(body), chat)
    except OpenAIError as exc:
        assert exc.status in (400, 404)
    else:
        assert g.max_tokens >= 1 and len(g.prompt_ids) >= 1


def test_stream_chunks_are_vllm_json():
    enc = protocol.StreamEncoder(chat=True, request_id="chatcmpl-1", created=7, model='m"x')
    first = orjson.loads(enc.first[6:])
    mid = orjson.loads(enc.token(b" hi", False)[6:])
    last = orjson.loads(enc.token(b" yo", True)[6:])
    use = orjson.loads(enc.usage_chunk(10, 2, 0)[6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert mid == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": 'm"x',
                   "choices": [{"index": 0, "delta": {"content": " hi"}, "logprobs": None, "finish_reason": None}]}
    assert last["choices"][0]["finish_reason"] == "length"
    assert use["choices"] == [] and use["usage"] == {"prompt_tokens": 10, "total_tokens": 12,
                                                     "completion_tokens": 2,
                                                     "prompt_tokens_details": {"cached_tokens": 0}}
    cmpl = protocol.StreamEncoder(chat=False, request_id="cmpl-1", created=7, model="m")
    assert orjson.loads(cmpl.token(b" a", False)[6:])["choices"][0]["text"] == " a"
    assert cmpl.first == b""
