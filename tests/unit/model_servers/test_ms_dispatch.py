"""The server's request dispatcher without sockets: every body gets a JSON answer, never an exception.

A fake connection records what the server answers; a stub engine records what it would run. Anything that
escaped `ModelServer.dispatch` would, on a real connection, surface as an httptools callback error (issue 11
finding 9: a token id of 2**63 gave "Malformed HTTP request: on_message_complete callback error").
"""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixroute.model_servers.server import ModelServer, ServerSettings


class FakeConn:
    admin = False

    def __init__(self) -> None:
        self.active = None
        self.replies: list[tuple[int, bytes]] = []

    def respond(self, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
        self.replies.append((status, body))
        self.active = None


class StubEngine:
    def __init__(self) -> None:
        self.submitted: list = []
        self.aborted: list = []

    def submit(self, req) -> None:
        self.submitted.append(req)

    def abort(self, req) -> None:
        self.aborted.append(req)


@pytest.fixture(scope="module")
def app() -> ModelServer:
    srv = ModelServer(ServerSettings(port=0, time_scale=0.0, max_model_len=4096))
    srv.engine = StubEngine()  # type: ignore[assignment]
    return srv


def answer(app: ModelServer, path: bytes, body: bytes, method: bytes = b"POST") -> tuple[int, object]:
    conn = FakeConn()
    before = len(app.engine.submitted)
    app.dispatch(conn, method, path, body)  # type: ignore[arg-type]
    if len(app.engine.submitted) > before:
        assert not conn.replies and conn.active is app.engine.submitted[-1]
        return 200, None  # accepted: the engine would stream the answer
    assert len(conn.replies) == 1
    status, raw = conn.replies[0]
    return status, orjson.loads(raw)


FIELDS = ["prompt", "messages", "model", "max_tokens", "max_completion_tokens", "stream", "stream_options",
          "n", "tools", "cache_salt", "stop", "logprobs", "top_logprobs", "temperature", "top_p", "top_k",
          "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "role", "content",
          "type", "text", "include_usage", "tool_calls", "function", "name"]
BIG = st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what orjson reads as ints
SCALARS = (st.none() | st.booleans() | BIG | st.integers(-3, 130000) | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=6) | st.sampled_from(["user", "assistant", "system", "text", "base", ""]))
JSON = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4)
                    | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=3), c, max_size=6), max_leaves=20)
BODIES = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=8) | JSON


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(BODIES, st.sampled_from([b"/v1/chat/completions", b"/v1/completions", b"/tokenize"]))
def test_any_json_body_gets_200_or_a_4xx_json_error(app, data, path):
    status, body = answer(app, path, json.dumps(data).encode())
    assert status == 200 or 400 <= status < 500, (status, body)
    if status != 200:
        err = body["error"]  # type: ignore[index]
        assert err["code"] == status and err["type"].endswith("Error") and err["message"]
        assert len(err["message"]) < 400  # echoed values are truncated


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(BIG, min_size=1, max_size=5), st.sampled_from([b"/v1/completions", b"/tokenize"]))
def test_token_id_lists_never_escape(app, ids, path):
    status, body = answer(app, path, orjson.dumps({"prompt": ids, "max_tokens": 1}))
    in_vocab = all(0 <= t < 128256 for t in ids)
    assert status == (200 if in_vocab else 400), body


def test_token_id_2_pow_63_is_a_400_naming_the_prompt(app):
    status, body = answer(app, b"/v1/completions", b'{"prompt": [9223372036854775808], "max_tokens": 1}')
    assert status == 400
    assert body["error"]["param"] == "prompt" and "vocabulary" in body["error"]["message"]  # type: ignore[index]


def test_unexpected_handler_exception_is_an_openai_500(app, monkeypatch):
    def boom(*a, **k):
        raise KeyError("simulated bug")

    monkeypatch.setattr(type(app.spec), "parse_generate", boom)
    failed = app.num_failed
    status, body = answer(app, b"/v1/completions", b'{"prompt": "x"}')
    assert status == 500 and app.num_failed == failed + 1
    err = body["error"]  # type: ignore[index]
    assert err["type"] == "InternalServerError" and "KeyError" in err["message"]


def test_admin_paths_are_404_on_the_serving_port_and_served_on_the_admin_one(app):
    for method, body in ((b"POST", b'{"fail_ratio": 1}'), (b"GET", b"")):
        status, reply = answer(app, b"/admin/faults", body, method)
        assert status == 404 and reply["error"]["type"] == "NotFoundError"  # type: ignore[index]
    assert app.fail_ratio == 0
    conn = FakeConn()
    conn.admin = True
    app.dispatch(conn, b"POST", b"/admin/faults", b'{"fail_ratio": 0.25}')  # type: ignore[arg-type]
    assert conn.replies[0][0] == 200 and app.fail_ratio == 0.25
    conn = FakeConn()
    conn.admin = True
    app.dispatch(conn, b"POST", b"/v1/completions", b'{"prompt": "x"}')  # type: ignore[arg-type]
    assert conn.replies[0][0] == 404  # the admin listener serves no inference
    app.fail_ratio = 0.0
