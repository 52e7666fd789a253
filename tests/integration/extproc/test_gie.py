"""GIE's endpoint picker protocol (extproc/gie.py) over real gRPC: the messages Envoy sends in FULL_DUPLEX_STREAMED
mode (every message written without waiting for answers), the answers in order.

The router is a small recording `RouterService`: what is under test is the protocol (buffering, answer order and
shape, chunking, refusals, the response pass-through, telemetry through the tracker), not routing. The real
Envoy runs in tests/integration/gateway/test_gie_gateway.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import grpc
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixroute.extproc import wire as pb
from prefixroute.extproc.gie import MAX_CHUNK_BYTES, body_chunks
from prefixroute.extproc.headers import DESTINATION_HEADER, SERVED_HEADER, SUBSET_KEY, SUBSET_NAMESPACE
from prefixroute.extproc.response_directory import NeedsLookup
from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.types import Decision
from prefixroute.extproc.server import ExtprocSettings, start_server
from prefixroute.extproc.tracking import RequestTracker
from prefixroute.openai_errors import OpenAIError
from helpers.picks import make_pick
from helpers.waiting import until_async
from prefixroute.extproc.lifecycle import Pick

pytestmark = pytest.mark.integration  # loopback servers or child processes: not a unit test

EPS = ("10.0.0.1:8000", "10.0.0.2:8000")
POST = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}
FULL_DUPLEX = pb.ProtocolConfiguration(request_body_mode=pb.FULL_DUPLEX_STREAMED,
                                       response_body_mode=pb.FULL_DUPLEX_STREAMED)


def _pick(endpoints: tuple[str, ...], stream: bool = True) -> Pick:
    """A real router pick of a chat request whose decision names a:1 and b:2 (the tracker's endpoint ids)."""
    return make_pick(endpoints, Decision(endpoints=("a:1", "b:2"), reason="cold", policy="prefix"),
                     InferenceRequest(kind="chat", path="/v1/chat/completions", model="m", stream=stream))


class RecordingRouter:
    """Routes to a fixed list; refuses bodies containing "refuse-503"; the first route of a body containing
    "lookup" needs a response-id lookup; records every call."""

    def __init__(self) -> None:
        self.routed: list[tuple[str, str, bytes, object]] = []
        self.served_calls: list[tuple[str | None, int | None]] = []
        self.released: list[Pick] = []
        self.resolved: list[str] = []

    def route(self, method: str, path: str, headers: Mapping[str, str], body: bytes, **kw: object) -> Pick:
        self.routed.append((method, path, body, kw.get("subset")))
        if b"refuse-503" in body:
            raise OpenAIError(503, "no healthy endpoint", retry_after_s=2)
        if b"lookup" in body and not self.resolved:
            raise NeedsLookup("resp_1")
        return _pick(EPS)

    async def resolve(self, response_id: str, headers: Mapping[str, str]) -> None:
        self.resolved.append(response_id)

    def served(self, pick: Pick, served: str | None, status: int | None = None) -> None:
        self.served_calls.append((served, status))

    def release(self, pick: Pick) -> None:
        self.released.append(pick)


def _hm(pairs: dict[str, str]):  # noqa: ANN202 - wire classes are dynamic
    return pb.HeaderMap(headers=[pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])


def _request_headers(pairs: dict[str, str], end_of_stream: bool = False, protocol_config=FULL_DUPLEX):  # noqa: ANN001, ANN202
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_hm(pairs), end_of_stream=end_of_stream))
    if protocol_config is not None:
        msg.protocol_config.CopyFrom(protocol_config)
    return msg


def _request_body(data: bytes, end_of_stream: bool):  # noqa: ANN202
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


def _response_headers(pairs: dict[str, str], served_md: str | None = None):  # noqa: ANN202
    msg = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=_hm(pairs)))
    if served_md is not None:
        msg.metadata_context.filter_metadata["envoy.lb"][SERVED_HEADER] = served_md
    return msg


def _response_body(data: bytes, end_of_stream: bool):  # noqa: ANN202
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


def _set_headers(common) -> dict[str, str]:  # noqa: ANN001
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def _chunked(body: bytes, size: int) -> list:
    parts = [body[i:i + size] for i in range(0, len(body), size)]
    return [_request_body(p, k == len(parts) - 1) for k, p in enumerate(parts)]


async def _run(process: grpc.aio.StreamStreamMultiCallable, msgs: list, *, close: bool = True) -> list:
    """Write every message at once (FULL_DUPLEX_STREAMED: Envoy never waits), half-close, read every answer."""
    call = process()
    for m in msgs:
        await call.write(m)
    if close:
        await call.done_writing()
    out = []
    while True:
        r = await asyncio.wait_for(call.read(), 5.0)
        if r is grpc.aio.EOF:
            return out
        out.append(r)




@pytest.fixture
async def picker(request: pytest.FixtureRequest) -> AsyncIterator[tuple[RecordingRouter, object, list]]:
    """(router, Process callable, emitted records) of a server; indirect parameters: ExtprocSettings fields, and
    `propagate` (the tracker's) and `max_body_bytes`."""
    kw = dict(getattr(request, "param", {}))
    propagate = kw.pop("propagate", True)
    max_body_bytes = kw.pop("max_body_bytes", 8 * 1024 * 1024)
    router = RecordingRouter()
    records: list = []
    tracker = RequestTracker(lambda d, us: None, records.append, {EPS[0]: "a:1", EPS[1]: "b:2"}.get,
                             propagate=propagate)
    server, port = await start_server(router, ExtprocSettings(port=0, listen_address="127.0.0.1", **kw), tracker,
                                      max_body_bytes=max_body_bytes)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield router, pb.process_call(channel), records
    finally:
        await channel.close()
        await server.stop(None)


async def test_a_streamed_body_is_decided_whole_then_headers_then_the_body_in_62000_byte_chunks(picker) -> None:  # noqa: ANN001
    router, process, _ = picker
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 150_000}]})
    answers = await _run(process, [_request_headers(POST), *_chunked(body, 16_384)])
    kinds = [a.WhichOneof("response") for a in answers]
    assert kinds == ["request_headers", "request_body", "request_body", "request_body"]
    # One decision, on the whole body (a first chunk alone is not valid JSON).
    assert [r[2] for r in router.routed] == [body]
    common = answers[0].request_headers.response
    assert common.clear_route_cache
    # Only the destination: no fallback headers, no replica header (nothing of ours goes upstream).
    assert _set_headers(common) == {DESTINATION_HEADER: EPS[0], "traceparent": _set_headers(common)["traceparent"]}
    md = answers[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION_HEADER].string_value
    assert md == EPS[0]
    streamed = [a.request_body.response.body_mutation.streamed_response for a in answers[1:]]
    assert [len(s.body) for s in streamed] == [MAX_CHUNK_BYTES, MAX_CHUNK_BYTES, len(body) - 2 * MAX_CHUNK_BYTES]
    assert [s.end_of_stream for s in streamed] == [False, False, True]
    assert b"".join(s.body for s in streamed) == body
    await until_async(lambda: len(router.released) == 1, 2.0)


async def test_without_protocol_config_auto_keeps_prefixroutes_own_protocol(picker) -> None:  # noqa: ANN001
    router, process, _ = picker
    call = process()
    await call.write(_request_headers(POST, protocol_config=None))
    first = await call.read()  # our own mode answers the headers at once (CONTINUE), before any body
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.header_mutation.set_headers
    await call.write(_request_body(b'{"model": "m"}', True))
    routed = await call.read()
    assert routed.WhichOneof("response") == "request_body"
    assert "x-prefixroute-fallback-endpoint-1" in _set_headers(routed.request_body.response)
    call.cancel()


@pytest.mark.parametrize("picker", [dict(protocol="gie")], indirect=True)
async def test_forced_gie_speaks_it_without_protocol_config(picker) -> None:  # noqa: ANN001
    router, process, _ = picker
    answers = await _run(process, [_request_headers(POST, protocol_config=None),
                                   _request_body(b'{"model": "m",', False), _request_body(b'"n": 1}', True)])
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    assert router.routed[0][2] == b'{"model": "m","n": 1}'


@pytest.mark.parametrize("picker", [dict(protocol="prefixroute")], indirect=True)
async def test_forced_prefixroute_ignores_a_full_duplex_protocol_config(picker) -> None:  # noqa: ANN001
    router, process, _ = picker
    call = process()
    await call.write(_request_headers(POST))
    first = await call.read()
    assert not first.request_headers.response.header_mutation.set_headers  # CONTINUE: our own mode
    call.cancel()


async def test_a_request_without_body_is_decided_at_its_headers(picker) -> None:  # noqa: ANN001
    router, process, _ = picker
    answers = await _run(process, [_request_headers({":method": "GET", ":path": "/v1/models"}, end_of_stream=True)])
    assert [a.WhichOneof("response") for a in answers] == ["request_headers"]
    assert _set_headers(answers[0].request_headers.response)[DESTINATION_HEADER] == EPS[0]
    assert router.routed[0][:3] == ("GET", "/v1/models", b"")


@pytest.mark.parametrize("picker", [dict(max_body_bytes=100_000)], indirect=True)
async def test_a_body_over_the_limit_gets_an_openai_413_and_is_never_routed(picker) -> None:  # noqa: ANN001
    router, process, records = picker
    answers = await _run(process, [_request_headers(POST), *_chunked(b"x" * 150_000, 40_000)], close=False)
    assert [a.WhichOneof("response") for a in answers] == ["immediate_response"]
    imm = answers[0].immediate_response
    assert imm.status.code == 413
    err = orjson.loads(imm.body)["error"]
    assert (err["code"], err["type"]) == (413, "RequestEntityTooLargeError") and "100000 bytes" in err["message"]
    assert router.routed == []
    # Declared too large: refused at the headers, before any body byte is held.
    answers = await _run(process, [_request_headers({**POST, "content-length": "100001"})], close=False)
    assert answers[0].immediate_response.status.code == 413
    await until_async(lambda: len(records) == 2, 2.0)
    assert [r.status for r in records] == [413, 413]


async def test_a_refusal_is_an_immediate_response_and_ends_the_stream(picker) -> None:  # noqa: ANN001
    router, process, _ = picker
    answers = await _run(process, [_request_headers(POST), _request_body(b'{"x": "refuse-503"}', True)], close=False)
    assert [a.WhichOneof("response") for a in answers] == ["immediate_response"]
    imm = answers[0].immediate_response
    hdrs = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    assert (imm.status.code, hdrs["retry-after"], hdrs["content-type"]) == (503, "2", "application/json")
    assert router.released == []


@pytest.mark.parametrize("picker", [dict(propagate=False, replica_index=1)], indirect=True)
async def test_with_traces_off_nothing_of_ours_but_the_destination_goes_upstream(picker) -> None:  # noqa: ANN001
    router, process, _ = picker
    answers = await _run(process, [_request_headers(POST), _request_body(b'{"model": "m"}', True)])
    assert _set_headers(answers[0].request_headers.response) == {DESTINATION_HEADER: EPS[0]}


@pytest.mark.parametrize("picker", [dict(gie_fallback_list=True)], indirect=True)
async def test_the_fallback_list_is_gies_comma_list_in_header_and_metadata(picker) -> None:  # noqa: ANN001
    router, process, _ = picker
    answers = await _run(process, [_request_headers(POST), _request_body(b'{"model": "m"}', True)])
    value = ",".join(EPS)
    assert _set_headers(answers[0].request_headers.response)[DESTINATION_HEADER] == value
    assert answers[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION_HEADER].string_value == value


async def test_the_subset_hint_reaches_the_router(picker) -> None:  # noqa: ANN001
    router, process, _ = picker
    headers = _request_headers(POST)
    hint = headers.metadata_context.filter_metadata[SUBSET_NAMESPACE]
    hint.get_or_create_list(SUBSET_KEY).extend([EPS[1], 7])  # a non-string entry is ignored
    await _run(process, [headers, _request_body(b'{"model": "m"}', True)])
    # Without a hint the router is asked as in our own mode (no subset argument at all).
    await _run(process, [_request_headers(POST), _request_body(b'{"model": "m"}', True)])
    assert [r[3] for r in router.routed] == [[EPS[1]], None]


async def test_the_response_is_passed_back_unchanged_and_measured(picker) -> None:  # noqa: ANN001
    router, process, records = picker
    chunks = [b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n',
              b'data: {"usage": {"prompt_tokens": 9, "completion_tokens": 2, '
              b'"prompt_tokens_details": {"cached_tokens": 4}}}\n\n', b"data: [DONE]\n\n"]
    answers = await _run(process, [
        _request_headers(POST), _request_body(b'{"model": "m", "stream": true}', True),
        _response_headers({":status": "200", "content-type": "text/event-stream"}, served_md=EPS[1]),
        *[_response_body(c, k == len(chunks) - 1) for k, c in enumerate(chunks)],
        pb.ProcessingRequest(response_trailers=pb.HttpTrailers())])
    kinds = [a.WhichOneof("response") for a in answers]
    assert kinds == ["request_headers", "request_body", "response_headers", "response_body", "response_body",
                     "response_body", "response_trailers"]
    assert not answers[2].response_headers.response.header_mutation.set_headers
    echoed = [a.response_body.response.body_mutation.streamed_response for a in answers[3:6]]
    assert [e.body for e in echoed] == chunks and [e.end_of_stream for e in echoed] == [False, False, True]
    # The served endpoint from metadata_context (envoy.lb), reported once, with the status.
    assert router.served_calls == [(EPS[1], 200)]
    await until_async(lambda: len(records) == 1, 2.0)
    rec = records[0]
    assert (rec.status, rec.endpoint, rec.reason, rec.prompt_tokens, rec.cached_tokens) == (200, "b:2", "failover", 9, 4)
    assert rec.ttft_ms is not None and rec.ttft_ms <= rec.latency_ms
    assert len(router.released) == 1


async def test_without_a_served_report_the_record_names_the_primary_and_the_router_hears_nothing(picker) -> None:  # noqa: ANN001
    router, process, records = picker
    await _run(process, [_request_headers(POST), _request_body(b'{"model": "m"}', True),
                         _response_headers({":status": "200", "content-type": "application/json"}),
                         _response_body(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 1}}', True)])
    assert router.served_calls == [(None, 200)]
    await until_async(lambda: len(records) == 1, 2.0)
    assert (records[0].endpoint, records[0].reason, records[0].prompt_tokens) == ("a:1", "cold", 3)


async def test_our_own_served_header_is_the_fallback(picker) -> None:  # noqa: ANN001
    router, process, _ = picker
    await _run(process, [_request_headers(POST), _request_body(b'{"model": "m"}', True),
                         _response_headers({":status": "502", SERVED_HEADER: EPS[1]})])
    assert router.served_calls == [(EPS[1], 502)]


async def test_a_response_body_mode_other_than_full_duplex_is_continued(picker) -> None:  # noqa: ANN001
    router, process, _ = picker
    config = pb.ProtocolConfiguration(request_body_mode=pb.FULL_DUPLEX_STREAMED, response_body_mode=1)  # STREAMED
    answers = await _run(process, [_request_headers(POST, protocol_config=config),
                                   _request_body(b'{"model": "m"}', True), _response_body(b"abc", True)])
    assert answers[-1].WhichOneof("response") == "response_body"
    assert not answers[-1].response_body.response.HasField("body_mutation")


async def test_request_trailers_end_the_body_and_are_answered_after_it(picker) -> None:  # noqa: ANN001
    router, process, _ = picker
    answers = await _run(process, [_request_headers(POST), _request_body(b'{"model": "m"}', False),
                                   pb.ProcessingRequest(request_trailers=pb.HttpTrailers())])
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body", "request_trailers"]
    assert not answers[1].request_body.response.body_mutation.streamed_response.end_of_stream
    assert router.routed[0][2] == b'{"model": "m"}'


async def test_a_responses_follow_up_waits_for_its_lookup(picker) -> None:  # noqa: ANN001
    router, process, _ = picker
    answers = await _run(process, [_request_headers(POST), _request_body(b'{"lookup": 1}', True)])
    assert router.resolved == ["resp_1"] and len(router.routed) == 2
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]


async def test_a_reset_stream_releases_its_pick_once(picker) -> None:  # noqa: ANN001
    router, process, _ = picker
    call = process()
    await call.write(_request_headers(POST))
    await call.write(_request_body(b'{"model": "m"}', True))
    await call.read()
    await call.read()
    assert router.released == []
    call.cancel()
    await until_async(lambda: len(router.released) == 1, 2.0)
    await asyncio.sleep(0.1)
    assert len(router.released) == 1


@given(body=st.binary(max_size=3 * MAX_CHUNK_BYTES + 10), end_of_stream=st.booleans())
def test_body_chunks_cover_the_body_in_order_within_the_limit(body: bytes, end_of_stream: bool) -> None:
    answers = body_chunks(body, end_of_stream)
    streamed = [a.request_body.response.body_mutation.streamed_response for a in answers]
    assert b"".join(s.body for s in streamed) == body
    assert all(len(s.body) <= MAX_CHUNK_BYTES for s in streamed) and len(streamed) >= 1
    assert [s.end_of_stream for s in streamed] == [False] * (len(streamed) - 1) + [end_of_stream]


async def test_a_chunked_body_on_our_own_protocol_is_said_in_the_log(picker, caplog) -> None:  # noqa: ANN001
    """A gateway that streams bodies without saying so (no protocol_config) meets our own protocol: the decision on
    a partial body fails as before (400), and the log says why and what to do, once."""
    from prefixroute.extproc import servicer

    servicer._warned_partial_body.clear()
    router, process, _ = picker
    for _ in range(2):
        call = process()
        await call.write(_request_headers(POST, protocol_config=None))
        await call.read()
        await call.write(_request_body(b'{"model": "m",', False))
        await call.read()
        call.cancel()
    said = [r for r in caplog.records if "--protocol gie" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING"
