"""Validation gaps through the real gateway (issue 11, finding 9): Envoy + `prefixroute extproc` + a simulated
server. Each case was accepted (and forwarded) or answered wrongly before; now the router answers a precise
OpenAI-format error naming the field, and the next good request succeeds."""

from __future__ import annotations

import gzip
import http.client
import json

import orjson
import pytest

from prefixroute.extproc.routing.request import MAX_ECHO_CHARS

from helpers.fleet import MODEL

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "hello"}]


def post(gw: object, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
    host, port = gw.url.removeprefix("http://").split(":")  # type: ignore[attr-defined]
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def chat(**fields: object) -> bytes:
    return orjson.dumps({"model": MODEL, "max_tokens": 2, "messages": MSGS, **fields})


CASES = [
    ("/v1/chat/completions", chat(stop=5), "stop"),
    ("/v1/chat/completions", chat(stop=[1, 2]), "stop"),
    ("/v1/chat/completions", chat(logprobs="yes"), "logprobs"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=-5), "top_logprobs"),
    ("/v1/chat/completions", chat(n=0), "n"),
    ("/v1/chat/completions", chat(temperature="hot"), "temperature"),
    ("/v1/chat/completions", chat(stream_options={"include_usage": True}), "stream_options"),
    ("/v1/completions", orjson.dumps({"model": MODEL, "prompt": [1, 2**63]}), "prompt"),
    ("/v1/completions", orjson.dumps({"model": MODEL, "prompt": "x", "logprobs": "yes"}), "logprobs"),
]


@pytest.mark.parametrize("path,body,param", CASES)
def test_invalid_field_gets_a_precise_400(gateway: object, path: str, body: bytes, param: str) -> None:
    status, headers, resp = post(gateway, path, body)
    assert status == 400, resp
    assert headers["content-type"].startswith("application/json")
    err = json.loads(resp)["error"]
    assert (err["param"], err["code"], err["type"]) == (param, 400, "BadRequestError"), err
    status, _, resp = post(gateway, "/v1/chat/completions", chat())
    assert status == 200, resp


def test_gzip_body_gets_415_not_a_utf8_error(gateway: object) -> None:
    status, headers, resp = post(gateway, "/v1/chat/completions", gzip.compress(chat()),
                                 {"content-encoding": "gzip"})
    assert status == 415, resp
    err = json.loads(resp)["error"]
    assert "content-encoding" in err["message"] and "UTF-8" not in err["message"]


def test_a_huge_model_name_is_not_echoed_whole(gateway: object) -> None:
    huge = "m" * 200_000  # under the gateway's body limit in these tests (256 KiB)
    status, _, resp = post(gateway, "/v1/chat/completions", orjson.dumps({"model": huge, "messages": MSGS}))
    assert status == 400, resp[:300]  # longer than any model name (request.MAX_MODEL_CHARS): refused as such
    assert len(resp) < 4 * MAX_ECHO_CHARS, len(resp)
    assert "200000 characters" in json.loads(resp)["error"]["message"]  # named by its length, never quoted
