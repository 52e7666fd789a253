"""Issue 11 finding 1 (and CONNECT of finding 8): the gateway forwards only allowlisted OpenAI inference paths.

Real Envoy + real ext_proc in front of a canary endpoint that records every path it receives through Envoy.
Dozens of spellings of private paths (admin, metrics, vLLM's control paths) are sent as raw bytes; each must
get an OpenAI-format 4xx from Envoy, and the canary must never see a path outside the allowlist, with the
ext_proc service up (picked route), down (fail-open route) or fail-closed.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import pytest

from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.envoy_config import DEFAULT_ALLOWED_PATH_PREFIXES, DEFAULT_ALLOWED_PATHS
from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.procs import free_port

from helpers.canary import Canary
from helpers.fleet import MODEL
from helpers.rawhttp import Reply, request, send

pytestmark = pytest.mark.integration

CHAT = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode()
COMPLETION = json.dumps({"model": MODEL, "max_tokens": 2, "prompt": "hi"}).encode()
RESPONSES = json.dumps({"model": MODEL, "max_output_tokens": 2, "input": "hi"}).encode()
FAULTS = b'{"refuse_connections": true, "fail_ratio": 1}'

# Request targets that must never reach an endpoint. Mixed: what the finding used, traversal, encodings,
# case, slashes, absolute URIs, vLLM's control and dev paths.
PRIVATE_TARGETS = [
    "/admin/faults", "/admin/faults/", "/admin", "/metrics", "/metrics?x", "/metrics?format=prometheus", "/health",
    "/", "/v1", "/v1/", "/ping", "/version", "/server_info", "/reset_prefix_cache", "/sleep", "/wake_up",
    "/is_sleeping", "/start_profile", "/stop_profile", "/collective_rpc", "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter", "/scale_elastic_ep", "/pooling", "/invocations",
    # traversal and slashes
    "/v1/../admin/faults", "/v1/chat/completions/../../admin/faults", "/v1/models/../../metrics",
    "/v1/models/x/../../../admin/faults", "/tokenize/../admin/faults", "/v1/responses/../../admin/faults",
    "//admin/faults", "///admin//faults", "/v1//../admin/faults", "/./admin/faults", "/v1/./../metrics",
    # percent-encodings
    "/v1/chat/completions/..%2F..%2Fadmin", "/v1/chat/completions/..%2f..%2fadmin%2ffaults",
    "/v1/models/..%5C..%5Cadmin", "/v1/models/%2e%2e/%2e%2e/admin/faults", "/v1/models/%2E%2E/%2E%2E/metrics",
    "/%61dmin/faults", "/%2561dmin/faults", "/v1/models%2F..%2F..%2Fmetrics", "/admin%2Ffaults",
    # case and look-alikes
    "/ADMIN/faults", "/Admin/Faults", "/METRICS", "/V1/CHAT/COMPLETIONS", "/v1/Chat/Completions",
    "/v1/chat/completions/", "/v1/chat/completionsx", "/v1/chat/completions;/../../admin/faults",
    "/v1/chat/completions;x", "/v1/models.json", "/v1/modelsx", "/tokenizer", "/v2/chat/completions",
    # absolute-URI request targets
    "http://evil/admin/faults", "http://127.0.0.1/metrics", "https://gateway/v1/../admin/faults",
    "http://gateway//admin/faults", "http://gateway/%2e%2e/metrics",
]


def allowed(target: str) -> bool:
    path = target.split("?")[0]
    return path in DEFAULT_ALLOWED_PATHS or path.startswith(DEFAULT_ALLOWED_PATH_PREFIXES)


def assert_refused(reply: Reply | None, target: str) -> None:
    assert reply is not None, f"{target}: connection closed without a reply"
    assert 400 <= reply.status < 500, (target, reply.status, reply.body[:300])
    reply.json_error()


def start_gateway(stack: ExitStack, canary: Canary, log_dir: Path, *, failure_mode: str = "open",
                  envoy: dict | None = None) -> GatewayProcesses:
    gw = GatewayProcesses(GatewaySettings(port=free_port(), ports="random", extproc_replicas=1, listen_address="127.0.0.1", failure_mode=failure_mode,
                                          envoy_log_level="info"),
                          RoutingSettings(), PoolSettings(endpoints=(canary.endpoint,)), log_dir=log_dir,
                          envoy_overrides=envoy)
    stack.enter_context(gw)
    return gw


@pytest.fixture(scope="module")
def canary() -> Iterator[Canary]:
    c = Canary()
    yield c
    c.close()


@pytest.fixture(scope="module")
def gateway(canary: Canary, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcesses]:
    with ExitStack() as stack:
        yield start_gateway(stack, canary, tmp_path_factory.mktemp("paths-gateway"))


def probe_private_targets(gw: GatewayProcesses, canary: Canary) -> None:
    before = len(canary.seen)
    for target in PRIVATE_TARGETS:
        for method, body in (("GET", b""), ("POST", FAULTS)):
            assert_refused(send(gw.gateway.port, request(method, target, body,
                                                         {"content-type": "application/json"})), target)
    leaked = [s.target for s in canary.seen[before:] if not allowed(s.target)]
    assert not leaked, leaked
    assert len(canary.seen) == before  # not even an allowlisted normalisation of these reached it


def test_allowlisted_paths_are_routed_to_the_endpoint(gateway: GatewayProcesses, canary: Canary) -> None:
    port = gateway.gateway.port
    for target, method, body in [("/v1/chat/completions", "POST", CHAT), ("/v1/completions", "POST", COMPLETION),
                                 ("/v1/models", "GET", b""), ("/v1/models?limit=1", "GET", b""),
                                 (f"/v1/models/{MODEL.split('/')[0]}", "GET", b""), ("/tokenize", "POST", COMPLETION),
                                 ("/detokenize", "POST", COMPLETION), ("/v1/embeddings", "POST", COMPLETION),
                                 ("/v1/responses", "POST", RESPONSES), ("/v1/responses/resp_123", "GET", b""),
                                 ("/v1/responses/resp_123/input_items", "GET", b"")]:
        reply = send(port, request(method, target, body, {"content-type": "application/json"}))
        assert reply is not None and reply.status == 200, (target, reply)
        assert canary.seen[-1].target == target  # forwarded as sent (already normalised)
    # Normalisation happens before matching, and the endpoint gets the normalised path.
    reply = send(port, request("POST", "/v1/models/../chat//completions", CHAT))
    assert reply is not None and reply.status == 200 and canary.seen[-1].target == "/v1/chat/completions"


def test_private_paths_never_reach_an_endpoint_with_ext_proc_up(gateway: GatewayProcesses, canary: Canary) -> None:
    probe_private_targets(gateway, canary)


def test_refusals_come_from_envoy_without_calling_ext_proc(gateway: GatewayProcesses, canary: Canary) -> None:
    reply = send(gateway.gateway.port, request("POST", "/admin/faults", FAULTS))
    assert reply is not None and reply.status == 404
    assert reply.json_error()["type"] == "NotFoundError"
    assert "x-gateway-destination-endpoint-served" not in reply.headers
    # A path Envoy cannot normalise (a NUL) is refused in OpenAI JSON, in words, not forwarded.
    before = len(canary.seen)
    reply = send(gateway.gateway.port, request("GET", "/v1/models/a%00b"))
    assert reply is not None and reply.status == 400 and "cannot be normalised" in reply.json_error()["message"]
    assert len(canary.seen) == before


@pytest.mark.parametrize(("target", "forwarded"), [
    ("/v1/models/meta-llama%2FLlama-3.1-8B-Instruct", "/v1/models/meta-llama/Llama-3.1-8B-Instruct"),
    ("/v1/models/meta-llama%2fLlama-3.1-8B-Instruct", "/v1/models/meta-llama/Llama-3.1-8B-Instruct"),
    ("/v1/models/org%5Cmodel", "/v1/models/org/model"),
    ("/v1/responses/resp_1%2Finput_items", "/v1/responses/resp_1/input_items"),
])
def test_escaped_slashes_are_decoded_then_matched_and_forwarded_as_matched(
        gateway: GatewayProcesses, canary: Canary, target: str, forwarded: str) -> None:
    # A model id with a slash, as the OpenAI SDK sends it: decoded before normalising and matching, and the endpoint
    # receives the very path that was matched (what a vLLM server sees when called directly: its HTTP server
    # decodes %2F before routing).
    before = len(canary.seen)
    reply = send(gateway.gateway.port, request("GET", target))
    assert reply is not None and reply.status == 200, reply
    assert [s.target for s in canary.seen[before:]] == [forwarded]


def test_private_paths_never_reach_an_endpoint_with_ext_proc_down_fail_open(
        stack: ExitStack, canary: Canary, tmp_path: Path) -> None:
    gw = start_gateway(stack, canary, tmp_path)
    gw.stop_extproc()
    before = len(canary.seen)
    reply = send(gw.gateway.port, request("POST", "/v1/chat/completions", CHAT))
    assert reply is not None and reply.status == 200  # the fail-open route still serves allowlisted paths
    assert len(canary.seen) == before + 1
    probe_private_targets(gw, canary)


def test_fail_closed_refuses_private_paths_with_404_not_503(stack: ExitStack, canary: Canary, tmp_path: Path) -> None:
    gw = start_gateway(stack, canary, tmp_path, failure_mode="closed")
    gw.stop_extproc()
    reply = send(gw.gateway.port, request("POST", "/v1/chat/completions", CHAT))
    assert reply is not None and reply.status in (500, 503)
    reply.json_error()
    reply = send(gw.gateway.port, request("POST", "/admin/faults", FAULTS))
    assert reply is not None and reply.status == 404
    reply.json_error()


def test_operators_can_extend_the_allowlist(stack: ExitStack, canary: Canary, tmp_path: Path) -> None:
    gw = start_gateway(stack, canary, tmp_path, envoy={
        "allowed_paths": (*DEFAULT_ALLOWED_PATHS, "/v1/audio/transcriptions"),
        "allowed_path_prefixes": ("/v1/files/",)})
    port = gw.gateway.port
    for target in ("/v1/audio/transcriptions", "/v1/files/f1/content", "/v1/chat/completions"):
        reply = send(port, request("POST", target, CHAT))
        assert reply is not None and reply.status == 200, (target, reply)
    for target in ("/v1/models/x", "/v1/files", "/v1/audio/translations", "/v1/files/../admin/faults"):
        assert_refused(send(port, request("GET", target)), target)


@pytest.mark.parametrize("target", ["127.0.0.1:{canary}", "evil:443", "127.0.0.1:{admin}"])
def test_connect_gets_an_openai_json_answer_at_once(gateway: GatewayProcesses, canary: Canary, target: str) -> None:
    authority = target.format(canary=canary.port, admin=gateway.admin_port)
    before = len(canary.seen)
    t0 = time.monotonic()
    reply = send(gateway.gateway.port, request("CONNECT", authority, headers={"host": authority}), timeout_s=5)
    assert time.monotonic() - t0 < 2
    assert_refused(reply, authority)
    assert len(canary.seen) == before


def test_websocket_upgrade_is_refused_in_openai_json(gateway: GatewayProcesses) -> None:
    reply = send(gateway.gateway.port, request("GET", "/v1/chat/completions", headers={
        "connection": "Upgrade", "upgrade": "websocket", "sec-websocket-version": "13",
        "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="}))
    assert_refused(reply, "websocket")


def _h2_get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    """One request over HTTP/2 prior knowledge (h2c), the :path sent as is."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, validate_outbound_headers=False,
                                                                normalize_outbound_headers=False))
    conn.initiate_connection()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(conn.data_to_send())
        conn.send_headers(1, [(":method", method), (":path", path), (":scheme", "http"),
                              (":authority", "gateway")], end_stream=True)
        s.sendall(conn.data_to_send())
        status, body = 0, b""
        while True:
            data = s.recv(65536)
            if not data:
                return status, body
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    status = int(dict(ev.headers)[b":status"])
                elif isinstance(ev, h2.events.DataReceived):
                    body += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)):
                    return status, body
            s.sendall(conn.data_to_send())


@pytest.mark.parametrize("path", ["/admin/faults", "/v1/../admin/faults", "//metrics", "/v1/models/..%2F..%2Fmetrics",
                                  "/METRICS", "/v1/models/%2e%2e/%2e%2e/admin/faults"])
def test_http2_clients_get_the_same_allowlist(gateway: GatewayProcesses, canary: Canary, path: str) -> None:
    before = len(canary.seen)
    status, body = _h2_get(gateway.gateway.port, path)
    assert 400 <= status < 500, (path, status, body)
    assert json.loads(body)["error"]["code"] == status
    assert len(canary.seen) == before
    assert _h2_get(gateway.gateway.port, "/v1/models")[0] == 200
