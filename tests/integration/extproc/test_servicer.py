"""The ext_proc servicer's translation, over real gRPC (grpc.aio server + client in-process, upb messages).

The router behind it is a small recording implementation of the `RouterService` protocol: what is under
test is the translation (ProcessingRequest -> router calls -> ProcessingResponse), not routing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import grpc
import orjson
import pytest

from prefixroute.extproc import wire as pb
from prefixroute.extproc.headers import DESTINATION_HEADER, MAX_FALLBACKS, SERVED_HEADER, fallback_header
from prefixroute.extproc.server import ExtprocSettings, start_server
from prefixroute.extproc.service import NeedsParse
from prefixroute.extproc.servicer import PARSE_EXTENSION_S
from prefixroute.extproc.tracking import RequestTracker
from prefixroute.openai_errors import OpenAIError
from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.types import Decision
from prefixroute.telemetry.tracecontext import parse_traceparent
from helpers.extproc_calls import exchange as _exchange
from helpers.picks import make_pick
from helpers.waiting import until_async
from prefixroute.extproc.lifecycle import Pick

pytestmark = pytest.mark.integration  # loopback servers or child processes: not a unit test


class RecordingRouter:
    """Routes to a fixed list, refuses bodies containing "refuse", records every call."""

    def __init__(self, endpoints: tuple[str, ...]) -> None:
        self.endpoints = endpoints
        self.routed: list[tuple[str, str, dict[str, str], bytes]] = []
        self.served_calls: list[str | None] = []
        self.released: list[Pick] = []

    def route(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Pick:
        self.routed.append((method, path, dict(headers), body))
        if b"refuse-503" in body:
            raise OpenAIError(503, "no healthy endpoint", retry_after_s=2)
        if b"refuse-400" in body:
            raise OpenAIError(400, "bad", param="messages")
        return make_pick(self.endpoints)

    def served(self, pick: Pick, served_endpoint: str | None, status: int | None = None) -> None:
        self.served_calls.append(served_endpoint)

    def release(self, pick: Pick) -> None:
        self.released.append(pick)


def _headers(pairs: dict[str, str], end_of_stream: bool):  # noqa: ANN202 - wire classes are dynamic
    hm = pb.HeaderMap(headers=[pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=end_of_stream))


def _body(data: bytes):  # noqa: ANN202
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=True))


def _response_headers(pairs: dict[str, str]):  # noqa: ANN202
    hm = pb.HeaderMap(headers=[pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm, end_of_stream=False))


def _set_headers(common) -> dict[str, str]:  # noqa: ANN001
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


POST = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}
GET = {":method": "GET", ":path": "/v1/models"}
EPS = ("10.0.0.1:8000", "10.0.0.2:8000")


@pytest.fixture
async def served() -> AsyncIterator[tuple[RecordingRouter, grpc.aio.StreamStreamMultiCallable]]:
    router = RecordingRouter(EPS)
    server, port = await start_server(router, ExtprocSettings(port=0, listen_address="127.0.0.1"))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield router, pb.process_call(channel)
    finally:
        await channel.close()
        await server.stop(None)




async def test_body_request_continues_at_headers_then_routes_on_the_body(served) -> None:  # noqa: ANN001
    router, process = served
    body = orjson.dumps({"model": "m", "messages": []})
    r_headers, r_body, r_resp = await _exchange(process, [
        _headers(POST, end_of_stream=False), _body(body), _response_headers({SERVED_HEADER: EPS[0]})])
    assert r_headers.WhichOneof("response") == "request_headers"
    assert not r_headers.request_headers.response.header_mutation.set_headers  # CONTINUE, no decision yet
    assert r_body.WhichOneof("response") == "request_body"
    common = r_body.request_body.response
    assert common.clear_route_cache
    # Padded with the last endpoint: every possible attempt has its header.
    assert _set_headers(common) == {DESTINATION_HEADER: EPS[0], **{fallback_header(k): EPS[1]
                                                                   for k in range(1, MAX_FALLBACKS + 1)}}
    md = r_body.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION_HEADER].string_value
    assert md == EPS[0]  # same value as the header (GIE: header and metadata must not disagree)
    assert r_resp.WhichOneof("response") == "response_headers"
    assert router.routed == [("POST", "/v1/chat/completions", POST, body)]
    assert router.served_calls == [EPS[0]]
    await until_async(lambda: len(router.released) == 1, 2.0)


class ParsingRouter(RecordingRouter):
    """Hands every body to `parse_off_loop` (as PoolRouter does a large one), which refuses or parses it."""

    def route(self, method: str, path: str, headers: Mapping[str, str], body) -> Pick:  # noqa: ANN001
        if isinstance(body, bytes):
            raise NeedsParse
        return make_pick(self.endpoints)

    async def parse_off_loop(self, method: str, path: str, headers: Mapping[str, str], body: bytes):  # noqa: ANN201
        await asyncio.sleep(0.05)
        if b"refuse-400" in body:
            raise OpenAIError(400, "'messages' has too many items (max_messages)", param="messages")
        return InferenceRequest(kind="chat", path=path)


@pytest.mark.parametrize("marker, last", [(b"refuse-400", "immediate_response"), (b"ok", "request_body")])
async def test_a_body_parsed_off_the_loop_first_asks_envoy_to_wait(marker: bytes, last: str) -> None:
    """Before awaiting a worker's parse, the servicer extends Envoy's answer timeout (PARSE_EXTENSION_S): a parse
    past the 500 ms default on a loaded host must not fail the request open. Then the answer itself."""
    router = ParsingRouter(EPS)
    server, port = await start_server(router, ExtprocSettings(port=0, listen_address="127.0.0.1"))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        call = pb.process_call(channel)()
        await call.write(_headers(POST, end_of_stream=False))
        assert (await call.read()).WhichOneof("response") == "request_headers"
        await call.write(_body(orjson.dumps({"model": "m", "x": marker.decode()})))
        wait = await call.read()
        assert wait.WhichOneof("response") is None
        assert wait.override_message_timeout.ToMilliseconds() == int(PARSE_EXTENSION_S * 1000) > 500
        answer = await call.read()
        assert answer.WhichOneof("response") == last
        await call.done_writing()
    finally:
        await channel.close()
        await server.stop(None)


async def test_body_larger_than_grpc_default_message_limit_is_routed(served) -> None:  # noqa: ANN001
    router, process = served
    body = b'{"prompt": "' + b"x" * (6 * 1024 * 1024) + b'"}'  # over gRPC's default 4 MiB receive limit
    _, r_body = await _exchange(process, [_headers(POST, end_of_stream=False), _body(body)])
    assert r_body.WhichOneof("response") == "request_body"
    assert len(router.routed[0][3]) == len(body)


async def test_request_without_body_is_decided_at_headers(served) -> None:  # noqa: ANN001
    router, process = served
    (r,) = await _exchange(process, [_headers(GET, end_of_stream=True)])
    assert r.WhichOneof("response") == "request_headers"
    assert _set_headers(r.request_headers.response)[DESTINATION_HEADER] == EPS[0]
    assert r.request_headers.response.clear_route_cache
    assert router.routed[0][:2] == ("GET", "/v1/models") and router.routed[0][3] == b""
    await until_async(lambda: len(router.released) == 1, 2.0)


@pytest.mark.parametrize(("marker", "status", "retry_after"), [(b"refuse-503", 503, "2"), (b"refuse-400", 400, None)])
async def test_refusal_becomes_an_immediate_openai_error(served, marker: bytes, status: int,  # noqa: ANN001
                                                         retry_after: str | None) -> None:
    router, process = served
    _, r = await _exchange(process, [_headers(POST, end_of_stream=False), _body(b'{"x":"' + marker + b'"}')])
    assert r.WhichOneof("response") == "immediate_response"
    imm = r.immediate_response
    assert imm.status.code == status
    hdrs = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    assert hdrs["content-type"] == "application/json"
    assert hdrs.get("retry-after") == retry_after
    assert orjson.loads(imm.body)["error"]["code"] == status
    await asyncio.sleep(0.1)
    assert router.released == []  # nothing was picked, so nothing is released


async def test_release_happens_once_when_envoy_resets_the_stream(served) -> None:  # noqa: ANN001
    router, process = served
    call = process()
    await call.write(_headers(POST, end_of_stream=False))
    await call.read()
    await call.write(_body(b"{}"))
    await call.read()
    assert router.released == []  # still in flight: the response has not ended
    call.cancel()  # what Envoy does when the client goes away
    await until_async(lambda: len(router.released) == 1, 2.0)
    await asyncio.sleep(0.1)
    assert len(router.released) == 1


class TrackedRouter(RecordingRouter):
    """`RecordingRouter` whose picks carry a decision naming a:1 and b:2 (the tracker's endpoint ids)."""

    def route(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Pick:
        pick = super().route(method, path, headers, body)
        return make_pick(pick.endpoints, Decision(endpoints=("a:1", "b:2"), reason="cold", policy="prefix"))


async def test_routing_sets_traceparent_and_the_observing_stream_completes_the_record() -> None:
    router = TrackedRouter(EPS)
    records: list = []
    tracker = RequestTracker(lambda d, us: None, records.append, {EPS[0]: "a:1", EPS[1]: "b:2"}.get)
    server, port = await start_server(router, ExtprocSettings(port=0, listen_address="127.0.0.1"), tracker)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        process = pb.process_call(channel)
        routing = process()
        await routing.write(_headers(POST, end_of_stream=False))
        await routing.read()
        await routing.write(_body(b'{"model": "m"}'))
        tp = _set_headers((await routing.read()).request_body.response)["traceparent"]
        assert parse_traceparent(tp) is not None
        # The observing stream (observability mode): Envoy sends, the service never answers.
        obs = process()
        hm = pb.HeaderMap(headers=[pb.HeaderValue(key="traceparent", raw_value=tp.encode())])
        await obs.write(pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm), observability_mode=True))
        rh = pb.HeaderMap(headers=[pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in {
            ":status": "200", "content-type": "text/event-stream", SERVED_HEADER: EPS[1]}.items()])
        await obs.write(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=rh), observability_mode=True))
        usage = b'data: {"usage": {"prompt_tokens": 9, "completion_tokens": 2}}\n\ndata: [DONE]\n\n'
        await obs.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=usage, end_of_stream=True),
                                             observability_mode=True))
        await obs.done_writing()
        assert await obs.read() is grpc.aio.EOF  # nothing answered
        await routing.done_writing()
        assert await routing.read() is grpc.aio.EOF
        await until_async(lambda: len(records) == 1, 2.0)
        rec = records[0]
        assert rec.span_id == parse_traceparent(tp).span_id
        assert (rec.status, rec.endpoint, rec.reason, rec.prompt_tokens) == (200, "b:2", "failover", 9)
        assert router.routed and len(router.released) == 1
        # The routing filter saw no response headers: the observing stream reported the served endpoint.
        assert router.served_calls == [EPS[1]]
    finally:
        await channel.close()
        await server.stop(None)


async def test_without_telemetry_an_observing_stream_ends_at_once(served) -> None:  # noqa: ANN001
    router, process = served
    obs = process()
    hm = pb.HeaderMap(headers=[pb.HeaderValue(key=":path", raw_value=b"/v1/models")])
    await obs.write(pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm), observability_mode=True))
    # Nothing to measure: the service ends the RPC without waiting for the client to finish writing.
    assert await asyncio.wait_for(obs.read(), 2.0) is grpc.aio.EOF
    assert await obs.code() == grpc.StatusCode.OK
    assert router.routed == [] and router.served_calls == []


async def test_trailers_and_response_body_are_answered_with_continue(served) -> None:  # noqa: ANN001
    router, process = served
    replies = await _exchange(process, [
        _headers(GET, end_of_stream=True), pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x")),
        pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
        pb.ProcessingRequest(response_trailers=pb.HttpTrailers())])
    assert [r.WhichOneof("response") for r in replies] == [
        "request_headers", "response_body", "request_trailers", "response_trailers"]
    assert not replies[1].response_body.response.header_mutation.set_headers
    await until_async(lambda: len(router.released) == 1, 2.0)
