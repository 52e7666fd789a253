"""Request validation of the sampling fields, 415 for compressed bodies, clipped echoes (issue 11, finding 9).

Every rejection is a 400 (415 for an encoding) naming the field in ``param``, as the model server would, and the
router never raises anything but `OpenAIError` nor answers 5xx for a body of any shape.
"""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings as hsettings, strategies as st

from prefixroute.openai_errors import OpenAIError
from prefixroute.extproc.routing.request import MAX_ECHO_CHARS, MAX_MODEL_CHARS, clip, parse_request
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.types import EndpointId, EndpointState

S = RoutingSettings(rng_seed=1)
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hello"}]


def chat(**fields) -> bytes:
    return orjson.dumps({"model": "m", "messages": MSGS, **fields})


def comp(prompt=("hello",), **fields) -> bytes:
    return orjson.dumps({"model": "m", "prompt": prompt if isinstance(prompt, (str, int)) else list(prompt),
                         **fields})


def parse(body: bytes, path: str = CHAT, headers=None, method: str = "POST"):
    return parse_request(method, path, headers or {}, body, S)


REJECTED = [
    # the cases
    (CHAT, chat(stop=5), "stop"),
    (CHAT, chat(stop=[1, 2]), "stop"),
    (COMP, comp(stop=["a", None]), "stop"),
    (CHAT, chat(logprobs="yes"), "logprobs"),
    (CHAT, chat(logprobs=1), "logprobs"),  # chat: a boolean
    (COMP, comp(logprobs="yes"), "logprobs"),
    (COMP, comp(logprobs=True), "logprobs"),  # completions: an integer, not a boolean
    (COMP, comp(logprobs=-1), "logprobs"),
    (COMP, comp(logprobs=21), "logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=-5), "top_logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs="3"), "top_logprobs"),
    (CHAT, chat(top_logprobs=3), "top_logprobs"),  # without logprobs: true
    (CHAT, chat(logprobs=False, top_logprobs=-1), "top_logprobs"),
    (COMP, comp([2**63]), "prompt"),
    (COMP, comp([1, 2, 2**31]), "prompt"),
    (COMP, comp([1, -1]), "prompt"),
    (COMP, comp([[1, 2], [3, 2**63]]), "prompt"),
    # common fields
    (CHAT, chat(n=0), "n"),
    (CHAT, chat(n="2"), "n"),
    (CHAT, chat(n=1.5), "n"),
    (CHAT, chat(n=True), "n"),
    (CHAT, chat(max_tokens=0), "max_tokens"),
    (COMP, comp(max_tokens=-3), "max_tokens"),
    (CHAT, chat(max_tokens="10"), "max_tokens"),
    (CHAT, chat(max_completion_tokens=0), "max_completion_tokens"),
    (CHAT, chat(max_completion_tokens=[5]), "max_completion_tokens"),
    (CHAT, chat(temperature=-0.1), "temperature"),
    (CHAT, chat(temperature="hot"), "temperature"),
    (CHAT, chat(temperature=False), "temperature"),
    (CHAT, chat(top_p=0), "top_p"),
    (CHAT, chat(top_p=1.01), "top_p"),
    (CHAT, chat(top_p="1"), "top_p"),
    (CHAT, chat(presence_penalty=2.5), "presence_penalty"),
    (COMP, comp(frequency_penalty=-3), "frequency_penalty"),
    (CHAT, chat(top_k=-2), "top_k"),
    (CHAT, chat(stream="yes"), "stream"),
    (CHAT, chat(stream=1), "stream"),
    (CHAT, chat(stream=True, stream_options="yes"), "stream_options"),
    (CHAT, chat(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    (CHAT, chat(stream_options={"include_usage": True}), "stream_options"),  # only with stream: true
    (COMP, comp(stream=False, stream_options={"include_usage": True}), "stream_options"),
    (CHAT, chat(seed=2**63), "seed"),
    (CHAT, chat(seed="7"), "seed"),
    (CHAT, chat(user=5), "user"),
    (COMP, comp(echo="yes"), "echo"),
    (CHAT, chat(prompt_cache_key=5), "prompt_cache_key"),
]


@pytest.mark.parametrize("path,body,param", REJECTED)
def test_rejected_with_a_precise_400(path, body, param):
    with pytest.raises(OpenAIError) as info:
        parse(body, path)
    err = json.loads(info.value.body())["error"]
    assert (info.value.status, err["code"], err["param"], err["type"]) == (400, 400, param, "BadRequestError")
    assert f"'{param.split('.')[0]}" in err["message"] or "`" in err["message"], err["message"]


ACCEPTED = [
    (CHAT, chat(stop="END")),
    (CHAT, chat(stop=["a", "b", "c", "d", "e"])),  # vLLM sets no count limit
    (CHAT, chat(stop=[])),
    (CHAT, chat(stop=None, logprobs=None, n=None, temperature=None)),  # null = unset
    (CHAT, chat(logprobs=True, top_logprobs=20)),
    (CHAT, chat(logprobs=True, top_logprobs=-1)),  # vLLM: -1 = the whole vocabulary
    (CHAT, chat(top_logprobs=0)),  # 0 needs no logprobs (vLLM)
    (CHAT, chat(logprobs=False)),
    (COMP, comp(logprobs=0)),
    (COMP, comp(logprobs=20)),
    (COMP, comp([0, 2**31 - 1])),
    (COMP, comp([[0], [2**31 - 1]])),
    (CHAT, chat(n=3, max_tokens=16.0, max_completion_tokens=1)),  # an integral float is an integer
    (CHAT, chat(temperature=0, top_p=1, presence_penalty=-2, frequency_penalty=2.0)),
    (CHAT, chat(temperature=3.5)),  # vLLM has no upper bound (OpenAI's 2 is not enforced)
    (CHAT, chat(top_k=-1, seed=-(2**63))),
    (CHAT, chat(top_k=0, seed=2**63 - 1)),
    (CHAT, chat(user="u-1", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": False})),
    (CHAT, chat(stream=False, stream_options={})),  # empty: vLLM accepts it without stream
    (CHAT, chat(stream=False, stream_options=None)),
    (COMP, comp(echo=True, stream=True, stream_options={"include_usage": False})),
    (CHAT, chat(unknown_field={"anything": [1, "x"]}, logit_bias={"1": 2})),  # other fields pass through
]


@pytest.mark.parametrize("path,body", ACCEPTED)
def test_accepted_within_vllm_ranges(path, body):
    assert parse(body, path).kind in ("chat", "completion")


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd", "GZIP", "gzip, identity"])
@pytest.mark.parametrize("path", [CHAT, COMP])
def test_compressed_body_is_415_not_a_utf8_error(encoding, path):
    import gzip
    with pytest.raises(OpenAIError) as info:
        parse(gzip.compress(chat()), path, headers={"content-encoding": encoding})
    assert info.value.status == 415
    assert "unsupported content-encoding" in info.value.message
    assert json.loads(info.value.body())["error"]["type"] == "UnsupportedMediaTypeError"


def test_identity_encoding_is_parsed_and_other_paths_are_left_to_the_server():
    assert parse(chat(), headers={"content-encoding": "identity"}).kind == "chat"
    assert parse(chat(), headers={"content-encoding": " Identity "}).kind == "chat"
    assert parse(b"\x1f\x8b", "/v1/embeddings", headers={"content-encoding": "gzip"}).kind == "other"


def test_clip_keeps_short_values_and_marks_long_ones():
    assert clip("abc") == "abc"
    long = clip("x" * 1_000_000)
    assert long.startswith("x" * MAX_ECHO_CHARS) and long.endswith("(999900 more characters)")
    assert len(long) < MAX_ECHO_CHARS + 40


def _all_echo_paths():
    """Every error that quotes a client value, each given a 1 MB value."""
    huge = "m" * 1_000_000
    longest = "m" * MAX_MODEL_CHARS  # the longest model name accepted (a longer one is a 400 of its own)
    st_known = [EndpointState(EndpointId("127.0.0.1:1"), models=frozenset({"other"}))]
    st_down = [EndpointState(EndpointId("127.0.0.1:1"), models=frozenset({longest}), healthy=False)]
    req = parse(orjson.dumps({"model": longest, "messages": MSGS}))
    yield "400 model too long", lambda: parse(orjson.dumps({"model": huge, "messages": MSGS}))
    yield "404 model", lambda: RouterCore(S).route(req, st_known, {})
    yield "503 model", lambda: RouterCore(S).route(req, st_down, {})
    yield "405 method+path", lambda: parse(b"", "/v1/completions", method="X" * 1_000_000)
    yield "415 encoding", lambda: parse(chat(), headers={"content-encoding": huge})
    yield "400 token id", lambda: parse(comp([2**64 - 1]), COMP)


@pytest.mark.parametrize("name,call", list(_all_echo_paths()), ids=lambda x: x if isinstance(x, str) else "")
def test_echoed_values_are_clipped(name, call):
    with pytest.raises(OpenAIError) as info:
        call()
    assert len(info.value.message) < 3 * MAX_ECHO_CHARS, (name, len(info.value.message))
    assert len(info.value.body()) < 4 * MAX_ECHO_CHARS


# --- property: any JSON body gives a decision or a precise 4xx -----------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)
FIELDS = ["model", "messages", "prompt", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens",
          "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "seed", "user", "stop",
          "logprobs", "top_logprobs", "echo", "prompt_cache_key", "tools"]
token_ids = st.lists(st.integers(-(2**63), 2**64 - 1), min_size=1, max_size=6)
bodies = st.one_of(
    json_values,
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8),
    st.fixed_dictionaries({"model": st.just("m"), "messages": st.just(MSGS)},
                          optional={f: json_values for f in FIELDS[3:]}),
    st.fixed_dictionaries({"model": st.just("m"), "prompt": st.one_of(token_ids, st.lists(token_ids, max_size=3))},
                          optional={f: json_values for f in FIELDS[3:]}))
POOL = [EndpointState(EndpointId(f"127.0.0.1:{8000 + i}"), models=frozenset({"m"})) for i in range(3)]
CORE = RouterCore(S)


@hsettings(max_examples=400, deadline=None)
@given(body=bodies, path=st.sampled_from([CHAT, COMP]))
def test_any_json_body_gives_a_decision_or_a_precise_4xx(body, path):
    try:
        decision = CORE.route(parse(orjson.dumps(body), path), POOL, {})
    except OpenAIError as exc:
        assert 400 <= exc.status < 500, exc.message
        if exc.status == 400 and isinstance(body, dict):
            assert exc.param, exc.message  # names the field
        elif exc.status == 404:
            assert exc.param == "model"
        assert len(exc.message) < 400
    else:
        assert decision.endpoints and set(decision.endpoints) <= {s.endpoint for s in POOL}
