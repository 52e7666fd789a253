"""`RequestTracker`: one record per request from the routing and observing streams, emitted exactly once."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from prefixroute.extproc import tracking, wire
from prefixroute.extproc.headers import OBSERVED_METADATA, SERVED_HEADER
from prefixroute.extproc.tracking import RequestTracker
from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.types import Decision
from prefixroute.telemetry.records import RequestRecord, tenant_hash
from prefixroute.telemetry.tracecontext import parse_traceparent
from helpers.picks import make_pick
from prefixroute.extproc.lifecycle import Pick as Pick_

ADDR = {"10.0.0.1:80": "a:80", "10.0.0.2:80": "b:80"}
USAGE = {"prompt_tokens": 100, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 64}}


def Pick() -> Pick_:  # noqa: N802 - reads as the record it makes
    """A real router pick (`lifecycle.Pick`) of a streamed chat request routed to a:80 with b:80 as fallback."""
    return make_pick(("a:80", "b:80"), Decision(endpoints=("a:80", "b:80"), reason="affinity", policy="prefix",
                                                 matched_blocks=4, total_blocks=5, predicted_hit_ratio=0.8),
                     InferenceRequest(kind="chat", path="/v1/chat/completions", model="m", tenant="t1", stream=True,
                                      request_id="rid-1"), decision_us=42.0)


def _hv(pairs: dict[str, str]) -> list:
    return [wire.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]


@pytest.fixture
def sink() -> tuple[RequestTracker, list[RequestRecord], list]:
    out: list[RequestRecord] = []
    decisions: list = []
    t = RequestTracker(lambda d, us: decisions.append((d, us)), out.append, ADDR.get, max_body_bytes=1000,
                       obs_grace_s=0.05)
    return t, out, decisions


def _start(t: RequestTracker, headers: dict[str, str] | None = None):  # noqa: ANN202
    st, tp = t.begin({":path": "/v1/chat/completions?x=1", "x-request-id": "env-id", **(headers or {})})
    t.decided(st, Pick())
    obs = t.attach(_hv({"traceparent": tp}))
    return st, tp, obs


def _sse(*events: dict) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("routing_first", [True, False])
async def test_stream_record_is_emitted_once_when_both_streams_are_done(sink, routing_first: bool) -> None:
    t, out, decisions = sink
    st, tp, obs = _start(t, {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"})
    assert obs is st and parse_traceparent(tp).trace_id == "ab" * 16
    t.obs_response_headers(obs, _hv({":status": "200", "content-type": "text/event-stream",
                                     SERVED_HEADER: "10.0.0.1:80"}), False, SERVED_HEADER)
    t.obs_body(obs, _sse({"choices": [{"delta": {"content": "hi"}}]}), False)
    if routing_first:
        t.routing_closed(st)
        assert out == []  # waits for the observing stream's end
    t.obs_body(obs, _sse({"choices": [], "usage": USAGE}), True)
    if not routing_first:
        assert out == []  # waits for the routing stream's end
        t.routing_closed(st)
    t.obs_closed(obs)
    await asyncio.sleep(0.1)  # no late duplicate from a timer
    assert len(out) == 1 and t.pending == {} and len(decisions) == 1
    rec = out[0]
    assert (rec.trace_id, rec.parent_span_id, rec.span_id) == ("ab" * 16, "cd" * 8, parse_traceparent(tp).span_id)
    assert (rec.status, rec.endpoint, rec.reason, rec.endpoints) == (200, "a:80", "affinity", ("a:80", "b:80"))
    assert (rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens) == (100, 7, 64)
    assert (rec.model, rec.tenant_hash, rec.request_id, rec.path) == ("m", tenant_hash("t1"), "rid-1",
                                                                     "/v1/chat/completions")
    assert (rec.matched_blocks, rec.total_blocks, rec.predicted_hit_ratio, rec.decision_us) == (4, 5, 0.8, 42.0)
    assert 0 <= rec.ttft_ms <= rec.latency_ms and rec.error is None


async def test_non_stream_body_usage_and_failover_reason(sink) -> None:
    t, out, _ = sink
    st, _, obs = _start(t)
    assert t.routing_response_headers(st, _hv({":status": "200"}), "10.0.0.2:80")
    t.obs_response_headers(obs, _hv({":status": "200", "content-type": "application/json"}), False, SERVED_HEADER)
    body = orjson.dumps({"choices": [], "usage": USAGE})
    t.obs_body(obs, body[:10], False)
    t.obs_body(obs, body[10:], True)
    t.routing_closed(st)
    assert len(out) == 1
    assert (out[0].reason, out[0].endpoint, out[0].cached_tokens) == ("failover", "b:80", 64)


async def test_router_refusal_is_emitted_at_routing_close_without_endpoint(sink) -> None:
    t, out, decisions = sink
    st, _ = t.begin({":path": "/v1/chat/completions"})
    t.refused(st, 404, "The model `x` does not exist.")
    t.routing_closed(st)
    assert len(out) == 1 and decisions == []
    assert (out[0].status, out[0].endpoint, out[0].error, out[0].ttft_ms) == (
        404, None, "The model `x` does not exist.", None)


@pytest.mark.parametrize(("content_length", "status", "error"), [
    ("5000", 413, "request body too large (answered by Envoy)"),
    ("10", 0, "request ended before the routing decision"),
])
async def test_ended_before_decision(sink, content_length: str, status: int, error: str) -> None:
    t, out, _ = sink
    st, _ = t.begin({":path": "/v1/chat/completions", "content-length": content_length})
    t.routing_closed(st)
    assert [(r.status, r.error) for r in out] == [(status, error)]


async def test_unfinished_observation_is_emitted_after_the_grace_period(sink) -> None:
    t, out, _ = sink
    st, _, obs = _start(t)
    t.obs_response_headers(obs, _hv({":status": "200", "content-type": "text/event-stream"}), False, SERVED_HEADER)
    t.obs_body(obs, b"data: {}\n\n", False)
    t.routing_closed(st)  # client went away mid-stream; Envoy defers closing the observing stream
    assert out == []
    await asyncio.sleep(0.15)
    assert len(out) == 1 and out[0].ttft_ms is not None and out[0].latency_ms is None
    t.obs_closed(obs)  # the late close does not emit again
    assert len(out) == 1


async def test_observing_stream_cut_short_records_an_error(sink) -> None:
    t, out, _ = sink
    st, _, obs = _start(t)
    t.obs_response_headers(obs, _hv({":status": "200", "content-type": "text/event-stream"}), False, SERVED_HEADER)
    t.obs_closed(obs)
    t.routing_closed(st)
    assert [(r.status, r.error) for r in out] == [(200, "response incomplete")]


async def test_observing_stream_closed_after_done_is_a_whole_response(sink) -> None:
    # The OpenAI SDK closes its connection at [DONE], often before Envoy reads the server's end of stream: the
    # observing stream then closes without end of stream, but the client had the whole answer, usage included.
    t, out, _ = sink
    st, _, obs = _start(t)
    t.obs_response_headers(obs, _hv({":status": "200", "content-type": "text/event-stream"}), False, SERVED_HEADER)
    t.obs_body(obs, _sse({"choices": [], "usage": USAGE}), False)
    t.obs_closed(obs)
    t.routing_closed(st)
    assert [(r.status, r.error, r.cached_tokens) for r in out] == [(200, None, 64)]


@pytest.mark.parametrize("headers", [{}, {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"},
                                     {"traceparent": "garbage"}])
async def test_unknown_or_missing_key_is_not_tracked(sink, headers: dict) -> None:
    t, _, _ = sink
    assert t.attach(_hv(headers)) is None


async def test_no_observing_stream_emits_at_routing_close_with_latency(sink) -> None:
    t, out, _ = sink
    st, _ = t.begin({":path": "/v1/models"})
    t.decided(st, Pick())
    assert t.routing_response_headers(st, _hv({":status": "200"}), "10.0.0.1:80")
    t.routing_closed(st)
    assert len(out) == 1 and out[0].status == 200 and out[0].latency_ms is not None and out[0].ttft_ms is None


async def test_late_observing_stream_is_awaited_when_envoy_announced_it(sink) -> None:
    t, out, _ = sink
    st, tp = t.begin({":path": "/v1/chat/completions"}, lambda: [(OBSERVED_METADATA, "1")])
    t.decided(st, Pick())
    t.routing_closed(st)  # under load the observing stream is read after the routing stream's close
    assert out == []
    obs = t.attach(_hv({"traceparent": tp}))
    assert obs is st
    t.obs_response_headers(obs, _hv({":status": "200", "content-type": "application/json",
                                     SERVED_HEADER: "10.0.0.1:80"}), False, SERVED_HEADER)
    t.obs_body(obs, orjson.dumps({"usage": USAGE}), True)
    assert [(r.status, r.endpoint, r.cached_tokens) for r in out] == [(200, "a:80", 64)]


async def test_unrouted_request_is_recorded_once_by_the_observing_stream(sink) -> None:
    t, out, _ = sink
    st, _ = t.begin({":path": "/v1/chat/completions", "content-length": "5000"}, lambda: [(OBSERVED_METADATA, "1")])
    t.routing_closed(st)  # Envoy answered before any decision: left to the observing stream
    assert out == [] and t.pending == {}
    client_tp = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    hv = _hv({"traceparent": client_tp, ":path": "/v1/chat/completions"})
    assert t.attach(hv) is None
    obs = t.attach_unrouted(hv)
    t.obs_response_headers(obs, _hv({":status": "413", "content-type": "application/json"}), False, SERVED_HEADER)
    t.obs_body(obs, b'{"error": {}}', True)
    assert [(r.status, r.reason, r.error, r.endpoint, r.trace_id) for r in out] == [
        (413, "unrouted", "HTTP 413 answered by Envoy", None, "ab" * 16)]


async def test_served_endpoint_is_reported_once_by_whichever_stream_sees_it_first(sink) -> None:
    t, _, _ = sink
    st, _, obs = _start(t)
    headers = _hv({":status": "200", "content-type": "application/json", SERVED_HEADER: "10.0.0.1:80"})
    assert t.routing_response_headers(st, headers, "10.0.0.1:80")
    assert t.obs_response_headers(obs, headers, False, SERVED_HEADER) is None
    st2, _, obs2 = _start(t)
    pick = st2.pick
    # Headers-only response, routing stream already closed: the pick is still handed over for reporting.
    t.routing_closed(st2)
    assert t.obs_response_headers(obs2, headers, True, SERVED_HEADER) is pick
    assert not t.routing_response_headers(st2, headers, "10.0.0.1:80")


async def test_beyond_max_pending_requests_are_routed_untracked(sink, monkeypatch) -> None:  # noqa: ANN001
    t, out, _ = sink
    monkeypatch.setattr(tracking, "MAX_PENDING", 0)
    st, tp = t.begin({":path": "/v1/models"})
    assert parse_traceparent(tp) is not None and t.pending == {} and t.num_untracked == 1
    t.decided(st, Pick())
    assert t.routing_response_headers(st, _hv({":status": "200"}), "10.0.0.1:80")  # the router still hears it
    t.routing_closed(st)
    await asyncio.sleep(0.1)
    assert out == []



# --- the correlation key is unguessable (issue 11, finding 2) --------------------------------------------------
async def test_span_ids_are_not_the_telemetry_mersenne_twister(sink, monkeypatch) -> None:  # noqa: ANN001
    """The router's span id is the key an observing stream must present: it must not come from a seeded PRNG
    whose next outputs follow from outputs an attacker has seen (its own routing streams' traceparents)."""
    import random

    from prefixroute.telemetry import tracecontext

    t, _, _ = sink
    monkeypatch.setattr(tracecontext, "_rand", random.Random(1234))
    twin = random.Random(1234)
    predicted = set()
    for _ in range(50):  # whatever the order the module draws trace and span ids in
        predicted.add(f"{twin.getrandbits(64) or 1:016x}")
        predicted.add(f"{twin.getrandbits(128) or 1:032x}"[:16])
    keys = {t.begin({":path": "/v1/chat/completions"})[0].key for _ in range(20)}
    assert not keys & predicted
    assert all(len(k) == 16 and int(k, 16) != 0 for k in keys) and len(keys) == 20


def test_span_ids_cross_buffer_refills_and_stay_distinct() -> None:
    ids = tracking.SpanIds()
    seen = [ids() for _ in range(3 * 256 + 7)]
    assert len(set(seen)) == len(seen)
    assert all(len(s) == 16 and set(s) <= set("0123456789abcdef") for s in seen)


async def test_a_forged_observing_stream_attaches_to_nothing(sink) -> None:  # noqa: ANN001
    t, _, _ = sink
    st, tp, _ = _start(t)  # a live request, already observed by Envoy's stream
    other, other_tp = t.begin({":path": "/v1/chat/completions"})
    t.decided(other, Pick())
    tpo = parse_traceparent(other_tp)
    # a guess: a valid traceparent with a wrong span id (one hex digit off the real key)
    flipped = tpo.span_id[:-1] + ("0" if tpo.span_id[-1] != "0" else "1")
    forged = t.observe(_hv({"traceparent": f"00-{tpo.trace_id}-{flipped}-01"}))
    assert forged.pick is None and forged.rec.reason == "unrouted"
    assert t.obs_response_headers(forged, _hv({":status": "200", SERVED_HEADER: "10.0.0.2:80"}), False,
                                  SERVED_HEADER) is None  # nothing reaches the router
    assert t.num_unattached_observations == 1
    # the real observing stream of `other` still attaches, once
    assert t.attach(_hv({"traceparent": other_tp})) is other and t.attach(_hv({"traceparent": other_tp})) is None


@pytest.mark.parametrize("usage,expected_usage", [(USAGE, (100, 64)), (None, (None, None))])
async def test_a_streamed_response_reports_its_first_token_then_its_usage_to_the_router(usage, expected_usage):
    calls: list = []
    t = RequestTracker(lambda d, us: None, lambda rec: None, ADDR.get, obs_grace_s=0.05,
                       on_first_token=lambda pick, ttft_s: calls.append(("first", pick, ttft_s)),
                       on_usage=lambda pick, p, c: calls.append(("usage", pick, p, c)))
    st, _tp, obs = _start(t)
    pick = st.pick
    t.obs_response_headers(obs, _hv({":status": "200", "content-type": "text/event-stream"}), False, SERVED_HEADER)
    assert calls == []
    t.obs_body(obs, _sse({"choices": [{"delta": {"content": "hi"}}]}), False)
    t.obs_body(obs, b"data: more\n\n", False)  # later chunks: no second first token
    assert [c[0] for c in calls] == ["first"] and calls[0][1] is pick and 0 <= calls[0][2] < 5
    last = _sse({"choices": [], "usage": usage}) if usage else b"data: [DONE]\n\n"
    t.obs_body(obs, last, True)
    assert calls[1] == ("usage", pick, *expected_usage) and len(calls) == 2
    t.routing_closed(st)


async def test_a_non_streamed_response_reports_no_first_token():
    # its body arrives whole after generation: its first chunk is no first token, and nothing is learned
    calls: list = []
    t = RequestTracker(lambda d, us: None, lambda rec: None, ADDR.get, obs_grace_s=0.05,
                       on_first_token=lambda *a: calls.append(a), on_usage=lambda *a: calls.append(a))
    st, _tp, obs = _start(t)
    t.obs_response_headers(obs, _hv({":status": "200", "content-type": "application/json"}), False, SERVED_HEADER)
    t.obs_body(obs, orjson.dumps({"choices": [], "usage": USAGE}), True)
    t.routing_closed(st)
    assert calls == []


@pytest.mark.parametrize(("propagate", "observed", "sets_traceparent"),
                         [(True, False, True), (True, True, True), (False, True, True), (False, False, False)])
async def test_traceparent_goes_upstream_only_for_exported_traces_or_an_observing_filter(
        propagate: bool, observed: bool, sets_traceparent: bool) -> None:
    """Traces off and no observing filter: the router's span goes nowhere, so no traceparent is set (the model
    server would otherwise see a parent span that does not exist). With the observing filter the header is the
    correlation key and stays. The record is kept either way."""
    out: list[RequestRecord] = []
    t = RequestTracker(lambda d, us: None, out.append, ADDR.get, propagate=propagate)
    metadata = (lambda: [(OBSERVED_METADATA, "1")]) if observed else tuple
    st, tp = t.begin({":path": "/v1/chat/completions"}, metadata)
    assert (tp is not None) == sets_traceparent
    t.decided(st, Pick())
    t.routing_closed(st)
    if not observed:
        assert len(out) == 1 and out[0].span_id == st.key


async def test_an_inline_observation_measures_the_routing_streams_own_response(sink) -> None:
    """GIE's configuration: one stream carries request and response; `inline` attaches it once."""
    t, out, _ = sink
    st, _ = t.begin({":path": "/v1/chat/completions"})
    t.decided(st, Pick())
    obs = t.inline(st)
    assert obs is st and t.inline(st) is None  # a second attachment is refused
    t.obs_response_headers(obs, _hv({":status": "200", "content-type": "text/event-stream"}), False, SERVED_HEADER)
    obs.served_addr = "10.0.0.2:80"
    t.obs_body(obs, _sse({"choices": []}, {"usage": USAGE}), True)
    t.obs_closed(obs)
    t.routing_closed(st)
    assert len(out) == 1
    rec = out[0]
    assert (rec.status, rec.endpoint, rec.prompt_tokens, rec.cached_tokens) == (200, "b:80", 100, 64)
    assert rec.error is None and rec.ttft_ms is not None
    assert tracking.NullTracker().inline(st) is None
