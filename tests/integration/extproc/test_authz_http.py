"""The router behind Envoy's ext_authz filter over HTTP (extproc/authz_http.py), over real loopback HTTP/1.1 with
the server the router runs (`start_server` + `start_authz_http`): a check becomes one `route` call and a 200 with
the routing headers; a refusal its OpenAI answer, a 5xx at a transport status Envoy does not take for a failure;
each pick is released by its facts record; the token, the health path, the body limit and malformed requests."""

from __future__ import annotations

import asyncio
import json
import os
import select
import socket
from collections.abc import AsyncIterator, Callable

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2_grpc import LogsServiceStub

import grpc
from helpers.facts_records import export, record
from helpers.picks import make_pick
from helpers.waiting import until_async
from prefixroute.extproc.answers import immediate_response
from prefixroute.extproc.authz_http import (CHECK_PATH_PREFIX, TOKEN_HEADER, AuthzHttpResponses, refusal,
                                            transport_status)
from prefixroute.extproc.exchange import FactsWaits
from prefixroute.extproc.envoy_facts import FactsReceiver
from prefixroute.extproc.facts_fields import OBSERVED_FACTS
from prefixroute.extproc.headers import DESTINATION_HEADER, MAX_FALLBACKS, OBSERVED_METADATA, fallback_header
from prefixroute.extproc.server import ExtprocSettings, start_authz_http, start_server
from prefixroute.extproc.tracking import RequestTracker
from prefixroute.openai_errors import OpenAIError
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.tracecontext import parse_traceparent

pytestmark = pytest.mark.integration  # loopback servers or child processes: not a unit test

EPS = ("10.0.0.1:8000", "10.0.0.2:8000")
FACTS = {OBSERVED_METADATA: OBSERVED_FACTS}


class RecordingRouter:
    """Routes to `EPS`; refuses bodies holding "refuse-400" / "refuse-503"; "slow" parses off the loop first
    (a `NeedsParse`-like wait: `NeedsLookup` with no id); records what it is asked."""

    def __init__(self) -> None:
        self.routed: list[tuple[str, str, dict[str, str], bytes]] = []
        self.served_calls: list[str | None] = []
        self.released: list[object] = []
        self.parsed = asyncio.Event()
        self.after_answer: Callable[[], None] | None = None  # runs where PoolRouter records the pick

    def route(self, method: str, path: str, headers, body, on_endpoints=None):  # noqa: ANN001, ANN201
        from prefixroute.extproc.service import NeedsLookup

        if body == b"slow":
            raise NeedsLookup(None)
        self.routed.append((method, path, dict(headers), body))
        if b"refuse-400" in body:
            raise OpenAIError(400, "bad", param="messages")
        if b"refuse-503" in body:
            raise OpenAIError(503, "no healthy endpoint", retry_after_s=2)
        if on_endpoints is not None:  # as PoolRouter: once the decision is final, before its bookkeeping
            on_endpoints(EPS)
        if self.after_answer is not None:
            self.after_answer()
        return make_pick(EPS)

    async def parse_off_loop(self, method: str, path: str, headers, body):  # noqa: ANN001, ANN201
        await self.parsed.wait()
        return b'{"model": "parsed"}'

    def served(self, pick, served_endpoint: str | None, status: int | None = None) -> None:  # noqa: ANN001
        self.served_calls.append(served_endpoint)

    def release(self, pick) -> None:  # noqa: ANN001
        self.released.append(pick)


class Client:
    """One kept-alive HTTP/1.1 connection, as Envoy's ext_authz client holds."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        lines = [f"{method} {path} HTTP/1.1", "host: gateway", f"content-length: {len(body)}",
                 *(f"{k}: {v}" for k, v in (headers or {}).items())]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        await self.writer.drain()

    async def read(self) -> tuple[int, dict[str, str], bytes]:
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 5)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            if line:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
        body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return int(status_line.split()[1]), headers, body

    async def check(self, body: bytes, path: str = "/v1/chat/completions", method: str = "POST",
                    headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        await self.send(method, CHECK_PATH_PREFIX + path, body, {"content-type": "application/json", **FACTS,
                                                                  **(headers or {})})
        return await self.read()


def test_an_ok_answer_is_the_routing_headers_and_a_traceparent() -> None:
    r = AuthzHttpResponses(replica_index=2)
    raw = r.ok(EPS, "00-" + "a" * 32 + "-" + "b" * 16 + "-01")
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert rest == b"" and head.startswith(b"HTTP/1.1 200 OK\r\n")
    headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
    assert headers == {"content-length": "0", DESTINATION_HEADER: EPS[0], "x-prefixroute-replica": "2",
                       "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
                       **{fallback_header(k): EPS[1] for k in range(1, MAX_FALLBACKS + 1)}}
    assert b"traceparent" not in r.ok(EPS, None)


@pytest.mark.parametrize(("status", "sent"), [(400, 400), (404, 404), (429, 429), (500, 470), (503, 473),
                                              (504, 474), (507, 470)])
def test_a_5xx_refusal_travels_at_a_status_envoy_does_not_take_for_a_failure(status: int, sent: int) -> None:
    """Envoy's HTTP ext_authz client takes any 5xx for a failure of the service and fails the request open; the
    local reply mapping (envoy_config/replies.py) restores the real status from these."""
    assert transport_status(status) == sent
    raw = refusal(immediate_response(OpenAIError(status, "no", retry_after_s=1)))
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % sent)
    assert json.loads(body)["error"]["code"] == status
    assert b"\r\nx-prefixroute-refused: %d\r\n" % status in head + b"\r\n" and b"retry-after: 1" in head
    assert b"content-length: %d" % len(body) in head


@pytest.fixture
async def served() -> AsyncIterator[tuple[RecordingRouter, FactsReceiver, list[RequestRecord], Client, object]]:
    router = RecordingRouter()
    records: list[RequestRecord] = []
    tracker = RequestTracker(lambda d, us: None, records.append, {EPS[0]: "a:1", EPS[1]: "b:2"}.get,
                             obs_grace_s=0.05, propagate=False)
    facts = FactsReceiver(tracker, router.served, unary_picks=FactsWaits(router.release, tracker.routing_closed))
    s = ExtprocSettings(port=0, listen_address="127.0.0.1", authz_http_port=0)
    server, port = await start_server(router, s, tracker, facts=facts)
    started = await start_authz_http(router, s, tracker, facts=facts, ready=lambda: True, max_body_bytes=1 << 20)
    assert started is not None
    http_server, http_port = started
    client = Client(*await asyncio.open_connection("127.0.0.1", http_port))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield router, facts, records, client, channel
    finally:
        client.writer.close()
        await channel.close()
        http_server.close()
        await server.stop(None)


async def test_a_check_routes_once_and_its_facts_record_releases_the_pick(served) -> None:  # noqa: ANN001
    router, facts, records, client, channel = served
    body = b'{"model": "m", "messages": []}'
    status, headers, _ = await client.check(body, headers={"x-session-id": "s1", "authorization": "Bearer client"})
    assert status == 200 and headers[DESTINATION_HEADER] == EPS[0]
    # The client's path and method, its headers (its own authorization included: the Responses API lookups send
    # it on), not the internal ones.
    ((method, path, seen, routed_body),) = router.routed
    assert (method, path, routed_body) == ("POST", "/v1/chat/completions", body)
    assert seen[":path"] == "/v1/chat/completions" and seen["x-session-id"] == "s1"
    assert seen["authorization"] == "Bearer client" and OBSERVED_METADATA not in seen
    tp = headers["traceparent"]
    assert router.released == [] and len(facts.unary_picks) == 1
    await LogsServiceStub(channel).Export(export(record(tp, upstream=EPS[0])))
    assert len(router.released) == 1 and len(facts.unary_picks) == 0
    await until_async(lambda: len(records) == 1, 2.0)
    assert records[0].status == 200 and records[0].span_id == parse_traceparent(tp).span_id
    # The same connection serves the next check (keep-alive).
    status, headers, _ = await client.check(body)
    assert status == 200 and len(router.routed) == 2


async def test_the_answer_leaves_before_the_picks_bookkeeping(served) -> None:  # noqa: ANN001
    """The 200 is written once the decision is final: Envoy has it while the router still records, counts and
    tracks the pick (the work after `on_endpoints`), so that work no longer adds to the request's latency."""
    router, facts, _, client, _ = served
    sock = client.writer.get_extra_info("socket")
    seen: list[bytes] = []

    def bookkeeping() -> None:  # runs on the event loop, where PoolRouter records the pick: the loop is blocked
        # so the client's reader cannot run: peek at its socket directly (a duplicate, closed after)
        with socket.socket(fileno=os.dup(sock.fileno())) as raw:
            if select.select([raw], [], [], 2.0)[0]:
                seen.append(raw.recv(65536, socket.MSG_PEEK))

    router.after_answer = bookkeeping
    status, headers, _ = await client.check(b'{"model": "m", "messages": []}')
    assert status == 200 and headers[DESTINATION_HEADER] == EPS[0]
    assert seen and seen[0].startswith(b"HTTP/1.1 200 OK") and headers["traceparent"].encode() in seen[0]
    assert len(facts.unary_picks) == 1  # and the bookkeeping was done: the pick waits for its record


async def test_a_failure_after_the_answer_costs_no_second_answer(served) -> None:  # noqa: ANN001
    """A bug in the bookkeeping after an early answer is logged and counted; the check keeps its one 200 and
    the connection serves the next check (a second answer would desynchronize Envoy's connection)."""
    router, facts, _, client, _ = served

    def broken() -> None:
        raise RuntimeError("bookkeeping bug")

    router.after_answer = broken
    status, headers, _ = await client.check(b'{"model": "m", "messages": []}')
    assert status == 200 and headers[DESTINATION_HEADER] == EPS[0]
    router.after_answer = None
    status, headers, _ = await client.check(b'{"model": "second", "messages": []}')
    assert status == 200 and headers[DESTINATION_HEADER] == EPS[0]
    assert [r[3] for r in router.routed][-1] == b'{"model": "second", "messages": []}'
    await asyncio.sleep(0.05)
    assert client.reader.at_eof() is False and len(client.reader._buffer) == 0  # noqa: SLF001 - nothing extra came


async def test_refusals_are_answered_with_the_openai_body_and_hold_no_pick(served) -> None:  # noqa: ANN001
    router, facts, records, client, _ = served
    status, headers, body = await client.check(b"refuse-400")
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["param"] == "messages"
    status, headers, body = await client.check(b"refuse-503")
    assert status == 473 and headers["retry-after"] == "2" and headers["x-prefixroute-refused"] == "503"
    assert json.loads(body)["error"]["message"] == "no healthy endpoint"
    assert len(facts.unary_picks) == 0 and router.released == []
    await until_async(lambda: len(records) == 2, 2.0)
    assert sorted(r.status for r in records) == [400, 503]


async def test_a_decision_that_waits_answers_later_and_the_next_check_waits_its_turn(served) -> None:  # noqa: ANN001
    router, facts, _, client, _ = served
    await client.send("POST", CHECK_PATH_PREFIX + "/v1/completions", b"slow", FACTS)
    await client.send("POST", CHECK_PATH_PREFIX + "/v1/completions", b'{"model": "second"}', FACTS)
    await asyncio.sleep(0.1)
    assert router.routed == []  # the first waits for its parse; the second is queued behind it
    router.parsed.set()
    first, second = await client.read(), await client.read()
    assert first[0] == second[0] == 200
    assert [r[3] for r in router.routed] == [b'{"model": "parsed"}', b'{"model": "second"}']
    assert len(facts.unary_picks) == 2


async def test_a_partial_body_is_handed_off_at_once_and_refused_without_the_handoff_route(served) -> None:  # noqa: ANN001
    """Envoy sends a body above its max_request_bytes in part: the router cannot route on it, so it hands the
    request off without parsing it (no decision, no state); a configuration without the handoff route gets 413."""
    router, facts, _, client, _ = served
    partial = {"x-envoy-auth-partial-body": "true", "x-prefixroute-handoff": "ext_proc"}
    status, headers, _ = await client.check(b'{"model": "m", "messages": [{"role": "us', headers=partial)
    assert status == 200 and headers["x-prefixroute-handoff"] == "ext_proc"
    assert DESTINATION_HEADER not in headers and router.routed == [] and len(facts.unary_picks) == 0
    status, headers, body = await client.check(b'{"model": "m", "messages": [{"role": "us',
                                               headers={"x-envoy-auth-partial-body": "true"})
    assert status == 413 and json.loads(body)["error"]["code"] == 413 and router.routed == []
    status, headers, _ = await client.check(b'{"model": "m"}', headers={"x-envoy-auth-partial-body": "false",
                                                                        "x-prefixroute-handoff": "ext_proc"})
    assert status == 200 and headers[DESTINATION_HEADER] == EPS[0]
    # Envoy 1.40 marks a body cut at exactly its max_request_bytes as whole when its buffer held exactly that much:
    # a body as long as the limit the check names is handed off all the same.
    cut = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 40
    status, headers, _ = await client.check(cut, headers={"x-envoy-auth-partial-body": "false",
                                                          "x-prefixroute-handoff": "ext_proc",
                                                          "x-prefixroute-authz-body-bytes": str(len(cut))})
    assert status == 200 and headers["x-prefixroute-handoff"] == "ext_proc" and len(router.routed) == 1


async def test_a_check_without_the_facts_header_is_released_at_once(served) -> None:  # noqa: ANN001
    router, facts, _, client, _ = served
    await client.send("POST", CHECK_PATH_PREFIX + "/v1/completions", b'{"model": "m"}')
    status, headers, _ = await client.read()
    assert status == 200 and "traceparent" not in headers
    assert len(router.released) == 1 and len(facts.unary_picks) == 0


async def test_health_other_paths_and_malformed_requests(served) -> None:  # noqa: ANN001
    router, _, _, client, _ = served
    await client.send("GET", "/health")
    assert (await client.read())[0] == 200
    await client.send("GET", "/v1/models")  # not under the check prefix
    assert (await client.read())[0] == 404
    client.writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    status, headers, _ = await client.read()
    assert status == 400 and headers.get("connection") == "close"
    assert await asyncio.wait_for(client.reader.read(), 5) == b""  # closed
    assert router.routed == []


async def test_the_token_the_body_limit_and_tls_completeness() -> None:
    router = RecordingRouter()
    tracker = RequestTracker(lambda d, us: None, lambda r: None, lambda a: None, propagate=False)
    s = ExtprocSettings(port=0, listen_address="127.0.0.1", auth_token="s3cret", authz_http_port=0)
    facts = FactsReceiver(tracker, router.served, unary_picks=FactsWaits(router.release, tracker.routing_closed))
    server, _ = await start_server(router, s, tracker, facts=facts)
    started = await start_authz_http(router, s, tracker, facts=facts, ready=lambda: False, max_body_bytes=64)
    assert started is not None
    http_server, http_port = started
    try:
        for token in (None, "Bearer wrong"):
            client = Client(*await asyncio.open_connection("127.0.0.1", http_port))
            status, headers, body = await client.check(b'{"model": "m"}',
                                                       headers={TOKEN_HEADER: token} if token else None)
            # 500: Envoy's failure mode applies (as a gRPC UNAUTHENTICATED would), never a client-facing 401; the
            # connection is closed, the rest of the request unread.
            assert status == 500 and b"bearer token" in body and router.routed == []
            assert headers.get("connection") == "close" and await client.reader.read() == b""
            client.writer.close()
        client = Client(*await asyncio.open_connection("127.0.0.1", http_port))
        status, headers, _ = await client.check(b'{"model": "m"}', headers={TOKEN_HEADER: "Bearer s3cret"})
        assert status == 200 and headers[DESTINATION_HEADER] == EPS[0]
        await client.send("GET", "/health")  # no token needed; not ready here
        assert (await client.read())[0] == 503
        status, _, _ = await client.check(b"x" * 100, headers={TOKEN_HEADER: "Bearer s3cret"})
        assert status == 413
        client.writer.close()
    finally:
        http_server.close()
        await server.stop(None)
    with pytest.raises(ValueError, match="facts receiver"):
        await start_authz_http(router, s, tracker, facts=None, ready=lambda: True, max_body_bytes=64)
    with pytest.raises(ValueError, match="facts receiver"):  # a receiver without the check's pick table
        await start_authz_http(router, s, tracker, facts=FactsReceiver(tracker, router.served), ready=lambda: True,
                               max_body_bytes=64)
