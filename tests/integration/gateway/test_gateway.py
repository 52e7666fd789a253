"""The gateway end to end: real Envoy + real ext_proc process + real simulated model servers on loopback."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import pytest

from prefixroute.extproc.headers import DESTINATION_HEADER, SERVED_HEADER, fallback_header
from prefixroute.extproc.gateway import GatewayProcesses

from helpers.fleet import MAX_BODY_BYTES, MODEL, Fleet, SpyListener, start_fleet, start_gateway
from helpers.waiting import until

pytestmark = pytest.mark.integration

SERVER_ID = "x-prefixroute-server-id"
SYSTEM_PROMPT = ("You are a meticulous assistant for the prefixroute project. " * 60).strip()  # ~3.6k chars


def request(gw: GatewayProcesses, method: str, path: str, body: bytes | dict | None = None,
            headers: dict[str, str] | None = None, timeout_s: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    host, port = gw.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        hdrs = {"content-type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def chat(system: str, user: str, **extra: object) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}], **extra}


def assert_openai_error(status: int, headers: dict[str, str], body: bytes, expected: int) -> dict:
    assert status == expected, body
    assert headers["content-type"].startswith("application/json")
    err = json.loads(body)["error"]
    assert err["code"] == expected and err["message"] and err["type"]
    return err


# --- routing ------------------------------------------------------------------------------------------------


def test_shared_system_prompt_sticks_to_one_endpoint_and_hits_its_cache(gateway: GatewayProcesses) -> None:
    system = "Affinity test. " + SYSTEM_PROMPT
    served, cached = [], []
    for i in range(8):
        status, headers, body = request(gateway, "POST", "/v1/chat/completions", chat(system, f"question {i}?"))
        assert status == 200, body
        served.append(headers[SERVER_ID])
        cached.append(json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert len(set(served)) == 1, served
    assert cached[0] == 0
    assert all(c > 500 for c in cached[1:]), cached  # the ~900-token system prompt is reused


def test_different_prefixes_spread_over_every_endpoint(gateway: GatewayProcesses, fleet: Fleet) -> None:
    counts: Counter[str] = Counter()
    for i in range(40):
        status, headers, body = request(gateway, "POST", "/v1/chat/completions",
                                        chat(f"Tenant {i} has its own instructions: " + SYSTEM_PROMPT[:600], "hi"))
        assert status == 200, body
        counts[headers[SERVER_ID]] += 1
    assert set(counts) == {f"s{i}" for i in range(len(fleet.servers))}, counts
    assert max(counts.values()) <= 20, counts  # no endpoint takes half of 40 distinct prefixes


def test_completions_and_streaming_pass_through(gateway: GatewayProcesses) -> None:
    status, _, body = request(gateway, "POST", "/v1/completions",
                              {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"]
    status, headers, body = request(gateway, "POST", "/v1/chat/completions",
                                    chat("Streaming test.", "go", stream=True, max_tokens=4))
    assert status == 200, body
    assert headers["content-type"].startswith("text/event-stream")
    events = [line for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def test_models_path_is_served_by_an_endpoint(gateway: GatewayProcesses, fleet: Fleet) -> None:
    status, headers, body = request(gateway, "GET", "/v1/models")
    assert status == 200, body
    assert MODEL in [m["id"] for m in json.loads(body)["data"]]
    assert headers[SERVED_HEADER] in fleet.endpoints


# --- security -----------------------------------------------------------------------------------------------


def test_client_destination_headers_are_never_honoured(gateway: GatewayProcesses, fleet: Fleet,
                                                      spy: SpyListener) -> None:
    target = f"127.0.0.1:{spy.port}"
    spoof = {DESTINATION_HEADER: target, fallback_header(1): target, fallback_header(2): target,
             SERVED_HEADER: target, "x-envoy-original-dst-host": target}
    for path, body in (("/v1/chat/completions", chat("Spoof test.", "hi")), ("/v1/models", None)):
        for _ in range(3):
            status, headers, resp = request(gateway, "POST" if body else "GET", path, body, headers=spoof)
            assert status == 200, resp
            assert "x-spy" not in headers
            assert headers[SERVED_HEADER] in fleet.endpoints
    assert spy.num_connections == 0


# --- errors -------------------------------------------------------------------------------------------------

BAD_BODIES = [
    pytest.param(b"{not json", None, id="malformed-json"),
    pytest.param(b"[1, 2]", None, id="not-an-object"),
    pytest.param(json.dumps({"model": MODEL}).encode(), "messages", id="missing-messages"),
    pytest.param(json.dumps({"model": MODEL, "messages": "hi"}).encode(), "messages", id="messages-not-a-list"),
    pytest.param(json.dumps({"model": 7, "messages": [{"role": "user", "content": "x"}]}).encode(), "model",
                 id="model-not-a-string"),
    pytest.param(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": 5}]}).encode(),
                 "messages[0].content", id="content-wrong-type"),
    pytest.param(b"", None, id="empty-body"),
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES)
def test_bad_request_gets_400_and_the_next_good_one_succeeds(gateway: GatewayProcesses, body: bytes,
                                                             param: str | None) -> None:
    status, headers, resp = request(gateway, "POST", "/v1/chat/completions", body)
    err = assert_openai_error(status, headers, resp, 400)
    if param is not None:
        assert err["param"] == param
    status, _, resp = request(gateway, "POST", "/v1/chat/completions", chat("After a bad one.", "hi"))
    assert status == 200, resp


def test_body_over_the_limit_gets_413_in_openai_format(gateway: GatewayProcesses) -> None:
    big = chat("x" * (MAX_BODY_BYTES + 1024), "hi")
    status, headers, resp = request(gateway, "POST", "/v1/chat/completions", big)
    assert_openai_error(status, headers, resp, 413)
    status, _, resp = request(gateway, "POST", "/v1/chat/completions", chat("After a big one.", "hi"))
    assert status == 200, resp


def test_unknown_model_gets_404(gateway: GatewayProcesses) -> None:
    status, headers, resp = request(gateway, "POST", "/v1/chat/completions",
                                    {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    err = assert_openai_error(status, headers, resp, 404)
    assert "no-such-model" in err["message"]


def test_no_healthy_endpoint_gets_503_with_retry_after(stack: ExitStack, log_dir: Path) -> None:
    # Ports held bound but not listening: connections are refused, and no other process can take them meanwhile.
    held = [stack.enter_context(socket.socket()) for _ in range(2)]
    for sock in held:
        sock.bind(("127.0.0.1", 0))
    dead = [f"127.0.0.1:{sock.getsockname()[1]}" for sock in held]
    gw = start_gateway(stack, dead, log_dir, extra_extproc_args=["--ready-timeout-s", "0.2"])
    for body in (chat("Nobody home.", "hi"), None):
        status, headers, resp = request(gw, "POST" if body else "GET",
                                        "/v1/chat/completions" if body else "/v1/models", body)
        assert_openai_error(status, headers, resp, 503)
        assert int(headers["retry-after"]) >= 1


# --- failures of parts --------------------------------------------------------------------------------------


def test_killing_a_server_loses_no_request_that_had_not_started_on_it(stack: ExitStack, log_dir: Path) -> None:
    fleet = start_fleet(stack, 3, log_dir, prefix="f")
    gw = start_gateway(stack, fleet.endpoints, log_dir)
    victim_ep, victim = next(iter(fleet.servers.items()))
    results: list[tuple[float, int, str, bytes]] = []  # (start time, status, served-by id, error body)
    kill_at: list[float] = []
    stop = threading.Event()

    def client(worker: int) -> None:
        i = 0
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                status, headers, body = request(gw, "POST", "/v1/chat/completions",
                                                chat(f"Worker {worker} prefix {i % 7}. " + SYSTEM_PROMPT[:400], "q"))
                results.append((t0, status, headers.get(SERVER_ID, ""), b"" if status == 200 else body[:300]))
            except OSError as exc:
                results.append((t0, 0, "", repr(exc).encode()))
            i += 1

    threads = [threading.Thread(target=client, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    until(lambda: len(results) > 10 and any(r[2] == "f0" for r in results), 10,
          message="requests served, some by the victim, before it dies")
    kill_at.append(time.monotonic())
    victim.kill()
    until(lambda: sum(r[0] >= kill_at[0] for r in results) > 20
          and "marked down after a passive failure" in (log_dir / "extproc.log").read_text(), 15,
          message="requests after the kill and the victim marked down")
    stop.set()
    for t in threads:
        t.join(timeout=30)

    before = [r for r in results if r[0] < kill_at[0]]
    after = [r for r in results if r[0] >= kill_at[0]]
    assert len(before) > 10 and len(after) > 10, (len(before), len(after))
    assert any(r[2] == "f0" for r in before), "the victim served nothing before it died: the test proves nothing"
    failed_after = [r for r in after if r[1] != 200]
    assert not failed_after, failed_after[:5]
    assert not any(r[2] == "f0" for r in after)
    # Envoy's served header told the picker a fallback served: the victim was marked down passively (the
    # active probe needs two failed probes 1 s apart, so it cannot have been first).
    assert f"endpoint {victim_ep} marked down after a passive failure" in (log_dir / "extproc.log").read_text()


def test_ext_proc_down_fails_open_to_round_robin_and_still_ignores_client_headers(
        stack: ExitStack, log_dir: Path, spy: SpyListener) -> None:
    fleet = start_fleet(stack, 2, log_dir, prefix="o")
    gw = start_gateway(stack, fleet.endpoints, log_dir)
    gw.stop_extproc()
    target = f"127.0.0.1:{spy.port}"
    served = Counter()
    for i in range(6):
        status, headers, resp = request(gw, "POST", "/v1/chat/completions", chat("Same prefix.", f"q{i}"),
                                        headers={DESTINATION_HEADER: target, fallback_header(1): target})
        assert status == 200, resp
        served[headers[SERVER_ID]] += 1
    assert set(served) == {"o0", "o1"}, served  # round robin: affinity is lost, availability is kept
    assert spy.num_connections == 0
    # ... except for the Responses API: a follow-up lives only on its endpoint, so it fails closed (a 503 that
    # says so, not a false "not found" from whichever endpoint round-robin picked).
    for method, path, body in (("POST", "/v1/responses", {"model": "m", "input": "hi",
                                                          "previous_response_id": "resp_0"}),
                               ("GET", "/v1/responses/resp_0", None)):
        status, headers, resp = request(gw, method, path, body)
        assert_openai_error(status, headers, resp, 503)
        assert "Responses API" in json.loads(resp)["error"]["message"]
        assert headers.get("retry-after") == "1"
    gw.start_extproc()  # and routing resumes once the service is back
    status, headers, resp = request(gw, "POST", "/v1/chat/completions", chat("Back again.", "hi"))
    assert status == 200, resp


def test_ext_proc_down_with_fail_closed_answers_503(stack: ExitStack, log_dir: Path) -> None:
    fleet = start_fleet(stack, 1, log_dir, prefix="c")
    gw = start_gateway(stack, fleet.endpoints, log_dir, failure_mode="closed")
    status, _, _ = request(gw, "POST", "/v1/chat/completions", chat("Closed.", "hi"))
    assert status == 200
    gw.stop_extproc()
    status, headers, resp = request(gw, "POST", "/v1/chat/completions", chat("Closed.", "hi"))
    # The routing filter's own failure reply (status_on_error): 503, not Envoy's default 500.
    assert_openai_error(status, headers, resp, 503)
