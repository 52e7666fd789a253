"""A client that closes its connection at a stream's ``data: [DONE]`` (what the OpenAI SDK does), before Envoy has
read the model server's end of stream: real Envoy with the facts path (the default ext_proc routing filter), real
`prefixroute extproc`, a real `prefixroute telemetry` receiver, and a model-server stand-in that holds its stream's
end open for a while after ``[DONE]`` (the race a real vLLM server loses now and then, made certain).

What must hold: the response's usage is still learned (its cached tokens counted, as the server reported them),
and the record is not an error: the client had its whole answer. The same for a Responses stream closed at its
``response.completed`` event. A client that closes before ``[DONE]`` is still
recorded as cut short, with no usage (so the test can tell the two apart).

The observing stream (``response_path observe``, an option) finishes such a response too when its ``[DONE]`` chunk
reached the router before Envoy cancelled the stream (tests/unit/extproc/test_tracking.py); under load Envoy's
cancel can overtake that chunk (gRPC drops a cancelled stream's unread messages), so it is not asserted here.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from helpers.gateway_requests import router_metrics, start_facts_gateway, wait_records
from helpers.receiver import ReceiverProc, start_receiver
from helpers.stack import metric_value
from helpers.procs import environ_set
from helpers.threaded_endpoint import METRICS
from helpers.waiting import until
from prefixroute.extproc.envoy_facts import CLIENT_CUT_ERROR
from prefixroute.extproc.gateway import GatewayProcesses
from prefixroute.telemetry.tracecontext import format_traceparent, new_span_id, new_trace_id

pytestmark = pytest.mark.integration

CACHED_TOKENS = 64
USAGE = {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102,
         "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS}}
RESPONSE_ID = "resp_held_end"
RESPONSES_USAGE = {"input_tokens": 100, "output_tokens": 2, "total_tokens": 102,
                   "input_tokens_details": {"cached_tokens": CACHED_TOKENS}}
END_HELD_S = 1.0  # how long the stand-in holds its stream's end after [DONE]
BEFORE_DONE_S = 0.5  # and how long between its first token and its usage + [DONE]


class HeldEndServer:
    """A chat completions server that streams a token, then (after `BEFORE_DONE_S`) its usage and ``[DONE]``, and
    ends the HTTP stream (the last chunk of its chunked encoding) only `END_HELD_S` later."""

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                body = {"/metrics": METRICS, "/v1/models": b'{"object":"list","data":[{"id":"m"}]}'}.get(
                    self.path, b"")
                self.send_response(200 if self.path in ("/health", "/metrics", "/v1/models") else 404)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length", "0")))
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()

                def chunk(data: bytes) -> None:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()

                if self.path.startswith("/v1/responses"):  # the Responses API: events, the last with usage
                    created = {"type": "response.created", "response": {"id": RESPONSE_ID, "usage": None}}
                    chunk(b"event: response.created\ndata: " + json.dumps(created).encode() + b"\n\n")
                    chunk(b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
                          b'"delta":"hi"}\n\n')
                    time.sleep(BEFORE_DONE_S)
                    done = {"type": "response.completed", "response": {"id": RESPONSE_ID, "usage": RESPONSES_USAGE}}
                    chunk(b"event: response.completed\ndata: " + json.dumps(done).encode() + b"\n\n")
                else:
                    token = {"id": "c", "object": "chat.completion.chunk",
                             "choices": [{"index": 0, "delta": {"content": "hi"}}]}
                    chunk(b"data: " + json.dumps(token).encode() + b"\n\n")
                    time.sleep(BEFORE_DONE_S)
                    last = {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": USAGE}
                    chunk(b"data: " + json.dumps(last).encode() + b"\n\n")
                    chunk(b"data: [DONE]\n\n")
                time.sleep(END_HELD_S)
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda *_: None
        self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ReceiverProc, GatewayProcesses]]:
    tmp = tmp_path_factory.mktemp("facts-client-closes")
    with ExitStack() as stack:
        rcv = start_receiver(tmp / "telemetry.db")
        stack.callback(rcv.stop)
        server = HeldEndServer()
        stack.callback(server.stop)
        with environ_set({"OTEL_EXPORTER_OTLP_ENDPOINT": rcv.otlp_url, "OTEL_BSP_SCHEDULE_DELAY": "100"}):
            gw = start_facts_gateway(stack, [server.endpoint], tmp)
        yield rcv, gw


def stream_and_close(gw: GatewayProcesses, *, until_marker: bytes, responses: bool = False) -> str:
    """Send a streamed chat (or a Responses stream) over a raw socket, read until `until_marker` arrived, close the
    connection at once; the request's trace id."""
    trace_id = new_trace_id()
    if responses:
        path = b"/v1/responses"
        body = json.dumps({"model": "m", "stream": True, "input": "hello " * 20}).encode()
    else:
        path = b"/v1/chat/completions"
        body = json.dumps({"model": "m", "stream": True, "stream_options": {"include_usage": True},
                           "messages": [{"role": "user", "content": "hello " * 20}]}).encode()
    host, port = gw.url.split("//", 1)[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST " + path + b" HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                 b"traceparent: " + format_traceparent(trace_id, new_span_id()).encode() +
                 b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    got = b""
    while until_marker not in got:
        data = sock.recv(65536)
        assert data, got
        got += data
    assert b" 200 " in got.split(b"\r\n", 1)[0], got
    sock.close()
    return trace_id


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_a_client_closing_at_done_has_its_usage_learned_and_no_error(env, responses: bool) -> None:
    rcv, gw = env
    before = metric_value(router_metrics(gw), "prefixroute_actual_hit_tokens_total")
    trace_id = stream_and_close(gw, until_marker=b'"type": "response.completed"' if responses else b"data: [DONE]",
                                responses=responses)
    rec = wait_records(rcv, [trace_id])[trace_id]
    assert rec["error"] is None, rec
    assert (rec["prompt_tokens"], rec["cached_tokens"]) == (USAGE["prompt_tokens"], CACHED_TOKENS), rec
    until(lambda: metric_value(router_metrics(gw), "prefixroute_actual_hit_tokens_total") - before == CACHED_TOKENS,
          5.0, message=lambda: metric_value(router_metrics(gw), "prefixroute_actual_hit_tokens_total") - before)


def test_a_client_closing_before_done_is_recorded_as_cut_short(env) -> None:
    rcv, gw = env
    trace_id = stream_and_close(gw, until_marker=b'"hi"')
    rec = wait_records(rcv, [trace_id])[trace_id]
    assert rec["error"] == CLIENT_CUT_ERROR and rec["cached_tokens"] is None, rec
