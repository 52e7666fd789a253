"""Issue 11 finding 8: Envoy's own replies are OpenAI JSON (`{"error": {...}}`, application/json), while the
router's own refusals (ext_proc ImmediateResponse bodies) pass through untouched. Real Envoy + real ext_proc in
front of a canary endpoint, every request written as raw bytes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.procs import free_port

from helpers.canary import Canary
from helpers.fleet import MODEL
from helpers.rawhttp import request, send

pytestmark = pytest.mark.integration

MAX_BODY = 64 * 1024
CHAT = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode()
POST_CHUNKED = b"POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\ntransfer-encoding: chunked\r\n\r\n"

# name -> (raw request, expected status, a word the message must contain)
ENVOY_REPLIES = {
    "bad chunk size": (POST_CHUNKED + b"zz\r\n{}\r\n0\r\n\r\n", 400, "codec"),
    "chunk size overflows": (POST_CHUNKED + b"fffffffffffffffffffffff\r\n{}\r\n0\r\n\r\n", 400, "codec"),
    "not HTTP": (b"GARBAGE\r\n\r\n", 400, "codec"),
    "bad method token": (b"G(T /v1/models HTTP/1.1\r\nhost: g\r\n\r\n", 400, "codec"),
    "two content-lengths": (b"POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\ncontent-length: 2\r\n"
                            b"content-length: 3\r\n\r\n{}", 400, "codec"),
    "content-length and chunked": (b"POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\ncontent-length: 3\r\n"
                                   b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n", 400, "chunked"),
    "space before colon": (b"GET /v1/models HTTP/1.1\r\nhost : g\r\n\r\n", 400, "codec"),
    "path that cannot be normalised": (request("GET", "/v1/models/a%00b"), 400, "cannot be normalised"),
    "unknown transfer-encoding": (b"POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\ntransfer-encoding: gzip\r\n\r\n",
                                  501, "transfer_encoding"),
    "HTTP/1.0": (b"GET /v1/models HTTP/1.0\r\n\r\n", 426, "HTTP/1.1 and HTTP/2 only"),
    "HTTP/0.9": (b"GET /v1/models\r\n\r\n", 426, "HTTP/1.1 and HTTP/2 only"),
    # Envoy takes any other version for a low one too: the sentence must not call it HTTP/1.0.
    "HTTP/2.0 request line": (b"GET /v1/models HTTP/2.0\r\nhost: g\r\n\r\n", 426, "HTTP/1.1 and HTTP/2 only"),
    "headers too large": (request("GET", "/v1/models", headers={"x-big": "a" * 40 * 1024}), 431, "KiB"),
    "too many header bytes in many headers": (
        request("GET", "/v1/models", headers={f"x-h{i}": "b" * 1000 for i in range(40)}), 431, "KiB"),
    "body over the limit": (request("POST", "/v1/chat/completions", b"x" * (MAX_BODY + 1)), 413, "limit"),
    "chunked body over the limit": (POST_CHUNKED + (b"4000\r\n" + b"x" * 0x4000 + b"\r\n") * 5 + b"0\r\n\r\n",
                                    413, "limit"),
    "OPTIONS *": (b"OPTIONS * HTTP/1.1\r\nhost: g\r\n\r\n", 404, "path"),
    "CONNECT": (b"CONNECT evil:443 HTTP/1.1\r\nhost: evil:443\r\n\r\n", 403, "CONNECT"),
    "unknown path": (request("POST", "/admin/faults", b"{}"), 404, "path"),
    "endpoint answers garbage": (request("POST", "/v1/chat/completions", CHAT, {"x-canary-garbage": "1"}),
                                 502, "endpoint"),
    "endpoint too slow": (request("POST", "/v1/chat/completions", CHAT, {"x-canary-delay-s": "3"}), 504, "time"),
}


@pytest.fixture(scope="module")
def canary() -> Iterator[Canary]:
    c = Canary()
    yield c
    c.close()


@pytest.fixture(scope="module")
def gateway(canary: Canary, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcesses]:
    with ExitStack() as stack:
        gw = GatewayProcesses(
            GatewaySettings(port=free_port(), ports="random", extproc_replicas=1, listen_address="127.0.0.1", envoy_log_level="info"),
            RoutingSettings(max_body_bytes=MAX_BODY), PoolSettings(endpoints=(canary.endpoint,)),
            log_dir=tmp_path_factory.mktemp("replies-gateway"), envoy_overrides={"upstream_timeout_s": 1.0})
        stack.enter_context(gw)
        yield gw


@pytest.mark.parametrize("name", list(ENVOY_REPLIES))
def test_envoy_own_replies_are_openai_json(gateway: GatewayProcesses, name: str) -> None:
    data, status, word = ENVOY_REPLIES[name]
    reply = send(gateway.gateway.port, data)
    assert reply is not None, "closed without a reply"
    assert reply.status == status, (reply.status, reply.body[:300])
    err = reply.json_error()
    assert word.lower() in err["message"].lower(), err
    assert err["type"].endswith("Error"), err


def test_request_timeouts_are_openai_json(stack: ExitStack, canary: Canary, tmp_path) -> None:  # noqa: ANN001
    gw = GatewayProcesses(GatewaySettings(port=free_port(), ports="random", extproc_replicas=1, listen_address="127.0.0.1"), RoutingSettings(),
                          PoolSettings(endpoints=(canary.endpoint,)), log_dir=tmp_path,
                          envoy_overrides={"request_timeout_s": 1.0, "request_headers_timeout_s": 0.5})
    stack.enter_context(gw)
    # Headers never finished, then a body never finished: each gets a 408 in OpenAI format.
    for data, detail in ((b"POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\n", "request_header_timeout"),
                         (b"POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\ncontent-length: 100\r\n\r\n{",
                          "request_overall_timeout")):
        reply = send(gw.gateway.port, data, timeout_s=5)
        assert reply is not None and reply.status == 408, reply
        assert detail in reply.json_error()["message"]


def test_router_refusals_pass_through_untouched(gateway: GatewayProcesses) -> None:
    # The router's own 4xx bodies (ext_proc ImmediateResponse) keep their precise messages and params.
    cases = [(request("POST", "/v1/chat/completions", b"{bad json"), 400, "not valid JSON", None),
             (request("POST", "/v1/chat/completions", json.dumps({"model": MODEL}).encode()), 400, "messages",
              "messages"),
             (request("POST", "/v1/chat/completions", json.dumps({"model": "no-such-model", "messages": [
                 {"role": "user", "content": "x"}]}).encode()), 404, "no-such-model", None),
             (request("GET", "/v1/chat/completions"), 405, "use POST", None)]
    for data, status, word, param in cases:
        reply = send(gateway.gateway.port, data)
        assert reply is not None and reply.status == status, (status, reply)
        err = reply.json_error()
        assert word in err["message"], err
        assert "codec" not in err["message"] and "gateway" not in err["message"], err
        if param:
            assert err["param"] == param


def test_an_ordinary_request_still_routes(gateway: GatewayProcesses, canary: Canary) -> None:
    reply = send(gateway.gateway.port, request("POST", "/v1/chat/completions", CHAT))
    assert reply is not None and reply.status == 200
    assert json.loads(reply.body)["path"] == "/v1/chat/completions"


@pytest.mark.parametrize(("endpoint", "words"), [
    # No endpoint resolves: the cluster has no host (Envoy: no_healthy_upstream, flag UH).
    ("no-such-host.invalid:8000", "No healthy endpoint"),
    # The endpoint refuses the connection (flag UF).
    ("127.0.0.1:{closed}", "refused or dropped the connection"),
])
def test_no_endpoint_replies_are_openai_json_with_retry_after(tmp_path, endpoint: str, words: str) -> None:  # noqa: ANN001
    # Envoy alone (the ext_proc filter off: its round-robin route), so the 503 is Envoy's own, not the router's.
    from prefixroute.extproc.envoy_config import EnvoySettings, render
    from prefixroute.extproc.gateway import envoy_binary
    from prefixroute.procs import ProcessGroup, http_ok, tcp_open

    port, admin, closed = free_port(), free_port(), free_port()
    config = tmp_path / "envoy.yaml"
    config.write_text(render(EnvoySettings(gateway_port=port, admin_port=admin, listen_address="127.0.0.1",
                                           extproc_enabled=False, endpoints=(endpoint.format(closed=closed),))))
    with ProcessGroup(tmp_path, ready_timeout_s=30) as group:
        group.start("envoy", [envoy_binary(), "-c", str(config), "--disable-hot-restart"], ports=(port, admin),
                    ready=lambda: http_ok(f"http://127.0.0.1:{admin}/ready") and tcp_open(port))
        reply = send(port, request("POST", "/v1/chat/completions", CHAT))
    assert reply is not None and reply.status == 503, reply
    assert reply.headers.get("content-type") == "application/json" and reply.headers.get("retry-after") == "1"
    err = reply.json_error()
    assert words in err["message"] and err["type"] == "ServiceUnavailableError" and err["code"] == 503, err
