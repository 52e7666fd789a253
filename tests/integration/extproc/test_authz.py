"""The router behind Envoy's ext_authz filter (extproc/authz.py) over real gRPC (grpc.aio server and client in
process, upb messages): a Check becomes one `route` call and an ok answer with the routing headers; a refusal a
denied answer in OpenAI format; each pick is released once, by its facts record (an OTLP Export on the same port)
or after `release_after_s`; the bearer token is checked per call."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2_grpc import LogsServiceStub

from helpers.facts_records import export, record
from helpers.picks import make_pick
from helpers.waiting import until_async
from prefixroute.extproc import wire as pb
from prefixroute.extproc.authz import AuthzResponses, UnaryPicks, denied
from prefixroute.extproc.answers import immediate_response
from prefixroute.extproc.envoy_facts import FactsReceiver
from prefixroute.extproc.facts_fields import OBSERVED_FACTS
from prefixroute.extproc.headers import DESTINATION_HEADER, MAX_FALLBACKS, OBSERVED_METADATA, fallback_header
from prefixroute.extproc.server import ExtprocSettings, start_server
from prefixroute.extproc.tracking import RequestTracker
from prefixroute.openai_errors import OpenAIError
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.tracecontext import parse_traceparent

pytestmark = pytest.mark.integration  # loopback servers or child processes: not a unit test

EPS = ("10.0.0.1:8000", "10.0.0.2:8000")


class RecordingRouter:
    """Routes to `EPS`, refuses bodies containing "refuse-400", records what it is asked."""

    def __init__(self) -> None:
        self.routed: list[tuple[str, str, dict[str, str], bytes]] = []
        self.served_calls: list[str | None] = []
        self.released: list[object] = []

    def route(self, method: str, path: str, headers, body: bytes):  # noqa: ANN001, ANN201
        self.routed.append((method, path, dict(headers), body))
        if b"refuse-400" in body:
            raise OpenAIError(400, "bad", param="messages")
        return make_pick(EPS)

    def served(self, pick, served_endpoint: str | None, status: int | None = None) -> None:  # noqa: ANN001
        self.served_calls.append(served_endpoint)

    def release(self, pick) -> None:  # noqa: ANN001
        self.released.append(pick)


TP = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
FACTS_MD = ((OBSERVED_METADATA, OBSERVED_FACTS),)


def _check_request(body: bytes, path: str = "/v1/chat/completions", method: str = "POST") -> object:
    headers = {":method": method, ":path": path, "content-type": "application/json"}
    return pb.CheckRequest(attributes=pb.AttributeContext(request=pb.AttributeContext.Request(
        http=pb.AttributeContext.HttpRequest(method=method, path=path, headers=headers, raw_body=body))))


def _headers(resp) -> dict[str, str]:  # noqa: ANN001
    return {h.header.key: h.header.value for h in resp.ok_response.headers}


def test_an_ok_answer_sets_the_routing_headers_and_a_traceparent_appended_at_the_byte_level() -> None:
    r = AuthzResponses()
    ok = pb.CheckResponse.FromString(r.ok(EPS))
    assert ok.status.code == 0 and ok.WhichOneof("http_response") == "ok_response"
    # Values in HeaderValue.value, the field Envoy's ext_authz reads; padded with the last endpoint.
    assert _headers(ok) == {DESTINATION_HEADER: EPS[0], **{fallback_header(k): EPS[1]
                                                            for k in range(1, MAX_FALLBACKS + 1)}}
    assert all(h.append_action == pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD for h in ok.ok_response.headers)
    # A longer value (a future version's traceparent) takes a two-byte length: placed all the same.
    for tp in (TP, "00-" + "c" * 32 + "-" + "d" * 16 + "-00", "cc-" + "e" * 32 + "-" + "f" * 16 + "-01-extra",
               "cc-" + "e" * 32 + "-" + "f" * 16 + "-01-" + "x" * 100):
        with_tp = pb.CheckResponse.FromString(r.with_traceparent(EPS, tp))
        assert _headers(with_tp) == {**_headers(ok), "traceparent": tp}


def test_a_replica_names_itself_on_every_ok_answer() -> None:
    assert _headers(pb.CheckResponse.FromString(AuthzResponses(3).ok(EPS)))["x-prefixroute-replica"] == "3"


@pytest.mark.parametrize("err", [OpenAIError(400, "bad", param="messages"),
                                 OpenAIError(503, "no healthy endpoint", retry_after_s=2)])
def test_a_refusal_is_a_denied_answer_with_the_openai_body(err: OpenAIError) -> None:
    resp = pb.CheckResponse.FromString(denied(immediate_response(err)))
    assert resp.status.code != 0 and resp.WhichOneof("http_response") == "denied_response"
    d = resp.denied_response
    assert d.status.code == err.status
    body = json.loads(d.body)["error"]
    assert body["code"] == err.status and body["message"] == err.message
    headers = {h.header.key: h.header.value for h in d.headers}
    assert headers["content-type"] == "application/json" and headers["x-prefixroute-refused"] == str(err.status)
    assert headers.get("retry-after") == (str(err.retry_after_s) if err.retry_after_s is not None else None)


async def test_unary_picks_are_released_once_by_their_record_or_their_timeout() -> None:
    released, closed = [], []
    picks = UnaryPicks(released.append, closed.append, release_after_s=0.2)
    picks.add("s1", "st1", "p1")  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    picks.add("s2", "st2", "p2")  # type: ignore[arg-type]
    assert picks.close("s1") and not picks.close("s1") and not picks.close(None) and not picks.close("other")
    assert (released, closed, len(picks)) == (["p1"], ["st1"], 1)
    await until_async(lambda: len(picks) == 0, 2.0)
    assert (released, closed, picks.num_expired) == (["p1", "p2"], ["st1", "st2"], 1)
    assert not picks.close("s2")  # expired: its late record releases nothing again


@pytest.fixture
async def authz() -> AsyncIterator[tuple[RecordingRouter, FactsReceiver, list[RequestRecord], grpc.aio.Channel]]:
    router = RecordingRouter()
    records: list[RequestRecord] = []
    tracker = RequestTracker(lambda d, us: None, records.append, {EPS[0]: "a:1", EPS[1]: "b:2"}.get,
                             obs_grace_s=0.05, propagate=False)
    facts = FactsReceiver(tracker, router.served)
    server, port = await start_server(router, ExtprocSettings(port=0, listen_address="127.0.0.1"), tracker,
                                      facts=facts)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield router, facts, records, channel
    finally:
        await channel.close()
        await server.stop(None)


async def test_a_check_routes_once_and_its_facts_record_releases_the_pick(authz) -> None:  # noqa: ANN001
    router, facts, records, channel = authz
    body = b'{"model": "m", "messages": []}'
    resp = await pb.authz_check_call(channel)(_check_request(body), metadata=FACTS_MD)
    assert router.routed == [("POST", "/v1/chat/completions", {":method": "POST", ":path": "/v1/chat/completions",
                                                               "content-type": "application/json"}, body)]
    headers = _headers(resp)
    assert headers[DESTINATION_HEADER] == EPS[0]
    tp = headers["traceparent"]  # the router's span: the key its facts record carries
    assert router.released == [] and len(facts.unary_picks) == 1
    await LogsServiceStub(channel).Export(export(record(tp, upstream=EPS[0])))
    assert len(router.released) == 1 and len(facts.unary_picks) == 0
    assert router.served_calls == [EPS[0]]
    await until_async(lambda: len(records) == 1, 2.0)
    assert records[0].status == 200 and records[0].error is None and records[0].span_id == parse_traceparent(
        tp).span_id
    # A second copy of the record (a retry of Envoy's export) releases nothing again.
    await LogsServiceStub(channel).Export(export(record(tp, upstream=EPS[0])))
    assert len(router.released) == 1


async def test_a_refused_check_is_denied_and_holds_no_pick(authz) -> None:  # noqa: ANN001
    router, facts, records, channel = authz
    resp = await pb.authz_check_call(channel)(_check_request(b"refuse-400"), metadata=FACTS_MD)
    assert resp.denied_response.status.code == 400
    assert len(facts.unary_picks) == 0 and router.released == []
    await until_async(lambda: len(records) == 1, 2.0)
    assert records[0].status == 400


async def test_a_check_without_the_facts_path_is_released_at_once(authz) -> None:  # noqa: ANN001
    """No facts metadata (an Envoy configuration other than ours): no record will come, so the pick is released
    with its answer rather than held until its timeout."""
    router, facts, _, channel = authz
    resp = await pb.authz_check_call(channel)(_check_request(b'{"model": "m"}'))
    assert _headers(resp)[DESTINATION_HEADER] == EPS[0] and "traceparent" not in _headers(resp)
    assert len(router.released) == 1 and len(facts.unary_picks) == 0


async def test_the_bearer_token_is_checked_on_every_check() -> None:
    router = RecordingRouter()
    tracker = RequestTracker(lambda d, us: None, lambda r: None, lambda a: None, propagate=False)
    server, port = await start_server(router, ExtprocSettings(port=0, listen_address="127.0.0.1",
                                                              auth_token="s3cret"), tracker,
                                      facts=FactsReceiver(tracker, router.served))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = pb.authz_check_call(channel)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await check(_check_request(b"{}"), metadata=FACTS_MD)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED and router.routed == []
            ok = await check(_check_request(b'{"model": "m"}'),
                             metadata=(*FACTS_MD, ("authorization", "Bearer s3cret")))
            assert _headers(ok)[DESTINATION_HEADER] == EPS[0]
    finally:
        await server.stop(None)


async def test_a_check_hands_off_a_body_envoy_sent_in_part_or_cut_at_its_limit(authz) -> None:  # noqa: ANN001
    """With the handoff route (our configuration says it in the call's metadata), a body Envoy marks partial, or
    one as long as the limit the metadata names (Envoy 1.40 marks a body cut exactly there as whole), is answered
    with the handoff header alone: no decision, no pick."""
    router, facts, _, channel = authz
    check = pb.authz_check_call(channel)
    handoff_md = (*FACTS_MD, ("x-prefixroute-handoff", "ext_proc"), ("x-prefixroute-authz-body-bytes", "64"))
    cut = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 8
    partial = _check_request(cut)
    partial.attributes.request.http.headers["x-envoy-auth-partial-body"] = "true"
    at_limit = _check_request(cut + b"x" * (64 - len(cut)))
    for req in (partial, at_limit):
        resp = await check(req, metadata=handoff_md)
        assert _headers(resp) == {"x-prefixroute-handoff": "ext_proc"}
    assert router.routed == [] and len(facts.unary_picks) == 0 and router.released == []
    whole = await check(_check_request(b'{"model": "m"}'), metadata=handoff_md)  # shorter than the limit
    assert _headers(whole)[DESTINATION_HEADER] == EPS[0] and len(router.routed) == 1
