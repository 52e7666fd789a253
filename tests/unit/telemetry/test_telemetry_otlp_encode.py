"""The direct span encoder produces the same OTLP messages as the official SDK encoder."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from prefixroute.telemetry.otlp_encode import EncodedBatch, RecordSpanExporter, any_value, varint
from prefixroute.telemetry.recorder import TelemetryRecorder
from prefixroute.telemetry.records import RequestRecord

ids = st.integers(1, 2**128 - 1).map(lambda i: f"{i:032x}")
span_ids = st.integers(1, 2**64 - 1).map(lambda i: f"{i:016x}")
opt_int = st.none() | st.integers(0, 2**40)
opt_float = st.none() | st.floats(0, 1e7, allow_nan=False)
names = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)

records = st.builds(
    RequestRecord, trace_id=ids, span_id=span_ids, parent_span_id=st.none() | span_ids,
    start_time=st.floats(1e9, 4e9, allow_nan=False), request_id=names, model=st.none() | names,
    tenant_hash=st.none() | names, policy=names, reason=st.sampled_from(["affinity", "spill", "cold", "failover"]),
    endpoint=st.none() | st.sampled_from(["127.0.0.1:8001", "host-without-port", "[::1]:9000"]),
    endpoints=st.lists(names, max_size=4).map(tuple), matched_blocks=st.integers(0, 10**6),
    total_blocks=st.integers(0, 10**6), predicted_hit_ratio=st.floats(0, 1), predicted_ttft_ms=opt_float,
    alternative_endpoint=st.none() | names, alternative_ttft_ms=opt_float, decision_us=st.floats(0, 1e6),
    ttft_ms=opt_float, latency_ms=opt_float, prompt_tokens=opt_int, completion_tokens=opt_int,
    cached_tokens=opt_int, stream=st.booleans(), status=st.sampled_from([0, 200, 400, 429, 500, 503]),
    error=st.none() | names, path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/health", ""]))


def both_ways(recs: list[RequestRecord]) -> tuple[ExportTraceServiceRequest, ExportTraceServiceRequest]:
    r = TelemetryRecorder(environ={}, endpoint="http://127.0.0.1:1")  # never exports in this test
    try:
        fast, n = r._encode(recs)
        sdk = encode_spans([r._factory.span(x) for x in recs])
    finally:
        r.shutdown(0.1)
    assert n == len(recs)
    return fast.request, sdk


@settings(max_examples=150, deadline=None)
@given(st.lists(records, min_size=1, max_size=5))
def test_fast_encoder_matches_sdk_encoder(recs):
    fast, sdk = both_ways(recs)
    (f_rs,), (s_rs,) = fast.resource_spans, sdk.resource_spans
    resource = lambda rs: {kv.key: kv.value for kv in rs.resource.attributes}  # noqa: E731
    assert resource(f_rs) == resource(s_rs)
    (f_ss,), (s_ss,) = f_rs.scope_spans, s_rs.scope_spans
    assert f_ss.scope.name == s_ss.scope.name
    assert list(f_ss.spans) == list(s_ss.spans)


@pytest.mark.parametrize(("n", "encoded"), [(0, b"\x00"), (1, b"\x01"), (127, b"\x7f"), (128, b"\x80\x01"),
                                            (300, b"\xac\x02"), (2**64 - 1, b"\xff" * 9 + b"\x01")])
def test_varint(n, encoded):
    assert varint(n) == encoded


@pytest.mark.parametrize("value", [-1, -(2**63), 2**63 - 1, 0.0, -2.5, "", "ü", True, False, ("a", 1, 2.0)])
def test_any_value_round_trips(value):
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

    from prefixroute.telemetry.otlp_decode import any_value as decode

    got = decode(AnyValue.FromString(any_value(value)))
    assert got == (list(value) if isinstance(value, tuple) else value)


def test_exporter_still_accepts_sdk_spans():
    # RecordSpanExporter must stay a drop-in OTLPSpanExporter for ordinary spans.
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext

    exp = RecordSpanExporter(endpoint="http://127.0.0.1:1")
    try:
        req = exp._translate_data([ReadableSpan(name="x", context=SpanContext(1, 2, is_remote=False))])
        assert req.resource_spans[0].scope_spans[0].spans[0].name == "x"
        batch = EncodedBatch(b"", 0)
        assert exp._translate_data(batch) is batch.request
    finally:
        exp.shutdown()
