"""OTLP span -> store row mapping (receiver side), using the real OTLP encoder on the router's spans
and on spans of an ordinary SDK tracer."""

from __future__ import annotations

import json

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from prefixroute.telemetry.otlp_decode import request_rows
from prefixroute.telemetry.record_spans import SpanFactory
from prefixroute.telemetry.records import RECORD_FIELDS, RequestRecord

RESOURCE = Resource.create({"service.name": "router-under-test"})


def encode(records):
    factory = SpanFactory(RESOURCE)
    return encode_spans([factory.span(r) for r in records])


@pytest.mark.parametrize("record", [
    RequestRecord(trace_id="0af7651916cd43dd8448eb211c80319c", span_id="00f067aa0ba902b7",
                  parent_span_id="b7ad6b7169203331", start_time=1_800_000_000.5, request_id="req-1", model="m",
                  tenant_hash="ab12", policy="prefix", reason="affinity", endpoint="127.0.0.1:8001",
                  endpoints=("127.0.0.1:8001", "127.0.0.1:8002"), matched_blocks=5, total_blocks=8,
                  predicted_hit_ratio=0.625, decision_us=33.0, ttft_ms=45.5, latency_ms=900.0, prompt_tokens=4096,
                  completion_tokens=128, cached_tokens=2048, stream=True, status=200, path="/v1/chat/completions"),
    RequestRecord(trace_id="1" * 32, span_id="2" * 16, start_time=1_800_000_001.0, request_id="req-2",
                  policy="prefix", reason="failover", endpoint="127.0.0.1:8002",
                  endpoints=("127.0.0.1:8001", "127.0.0.1:8002"), status=503, error="upstream connect error",
                  latency_ms=3.0, path="/v1/completions"),
    RequestRecord(trace_id="3" * 32, span_id="4" * 16, start_time=1_800_000_002.0, status=0, error="reset"),
])
def test_router_span_round_trips_to_a_row(record):
    rows, ignored = request_rows(encode([record]))
    assert ignored == 0
    (row,) = rows
    want = record.to_dict()
    want["endpoints"] = json.dumps(want["endpoints"])
    want["stream"] = int(want["stream"])
    for f in RECORD_FIELDS:
        if f == "request_id" and want[f] == "":
            continue
        assert row[f] == pytest.approx(want[f]) if isinstance(want[f], float) else row[f] == want[f], f
    assert row["end_time"] == pytest.approx(record.end_time)
    assert row["service_name"] == "router-under-test"
    attrs = json.loads(row["attrs"])
    assert attrs["resource.service.name"] == "router-under-test"


def test_other_spans_are_ignored_and_tagged_spans_are_kept():
    exp = InMemorySpanExporter()
    provider = TracerProvider(resource=RESOURCE)
    provider.add_span_processor(SimpleSpanProcessor(exp))
    tracer = provider.get_tracer("someone-else")
    with tracer.start_as_current_span("GET /v1/models"):
        with tracer.start_as_current_span("child"):
            pass
    # A span from another implementation that follows our attribute contract is a request row too.
    with tracer.start_as_current_span("my-gateway route", attributes={
            "prefixroute.request_id": "x1", "prefixroute.endpoint": "e:1", "gen_ai.usage.input_tokens": "oops"}):
        pass
    rows, ignored = request_rows(encode_spans(exp.get_finished_spans()))
    assert ignored == 2
    (row,) = rows
    assert (row["request_id"], row["endpoint"]) == ("x1", "e:1")
    assert row["prompt_tokens"] is None  # wrongly typed attribute -> NULL, not an exception
    assert row["latency_ms"] > 0  # from the span's own duration when the attribute is absent


def test_any_sender_is_capped_at_the_receiver():
    """Finding 7: a forged span's 1 MB attribute must not become a 1 MB row (the receiver caps what it stores
    whatever the sender did; the router caps its own too)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    from prefixroute.telemetry.attributes import MAX_ATTRIBUTE_BYTES, MAX_ATTRIBUTES
    from prefixroute.telemetry.otlp_decode import MAX_ATTRS_JSON_BYTES

    huge = "x" * 1_000_000
    span = Span(trace_id=b"\x01" * 40, span_id=b"\x02" * 20, name="prefixroute.route",
                start_time_unix_nano=1, end_time_unix_nano=2)
    span.attributes.append(KeyValue(key="gen_ai.request.model", value=AnyValue(string_value=huge)))
    span.attributes.append(KeyValue(key="prefixroute.endpoint", value=AnyValue(string_value="e" * 5000)))
    arr = AnyValue()
    for i in range(10_000):
        arr.array_value.values.append(AnyValue(string_value=f"10.0.0.{i}:80" * 50))
    span.attributes.append(KeyValue(key="prefixroute.extproc.endpoints", value=arr))
    for i in range(1000):
        span.attributes.append(KeyValue(key=f"k{i}" * 100, value=AnyValue(string_value=huge[:2000])))
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(KeyValue(key="service.name", value=AnyValue(string_value=huge)))
    rs.scope_spans.add().spans.append(span)
    (row,), _ = request_rows(req)
    assert len(row["model"].encode()) == MAX_ATTRIBUTE_BYTES and len(row["endpoint"]) == MAX_ATTRIBUTE_BYTES
    assert len(row["service_name"]) == MAX_ATTRIBUTE_BYTES
    assert len(json.loads(row["endpoints"])) <= 16
    assert len(row["trace_id"]) == 32 and len(row["span_id"]) == 16
    assert len(row["attrs"]) <= MAX_ATTRS_JSON_BYTES
    assert len(json.loads(row["attrs"])) <= MAX_ATTRIBUTES + 1
    total = sum(len(v) for v in row.values() if isinstance(v, str))
    assert total < 64 * 1024, total
