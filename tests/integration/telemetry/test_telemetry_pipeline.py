"""recorder -> OTLP/gRPC -> receiver process -> SQLite -> `telemetry dump` / HTTP API, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

from prefixroute.telemetry.client import HttpStoreClient
from prefixroute.telemetry.recorder import TelemetryRecorder
from prefixroute.telemetry.records import RECORD_FIELDS, RequestRecord
from prefixroute.telemetry.store_reader import StoreReader
from prefixroute.telemetry.tracecontext import child_context
from helpers.waiting import until

PREFIXROUTE = [sys.executable, "-m", "prefixroute"]

pytestmark = pytest.mark.integration

DUMP_KEYS = {"trace_id", "request_id", "start_time", "endpoint", "policy", "reason", "ttft_ms", "latency_ms",
             "prompt_tokens", "cached_tokens", "predicted_hit_ratio", "decision_us", "status"}


def make_records(now: float) -> list[RequestRecord]:
    incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    specs = [
        # The time model's predictions (a policy with one): set on three, none on the cold one (omitted).
        dict(traceparent=incoming, stream=True, status=200, ttft_ms=35.5, cached_tokens=768, reason="affinity",
             predicted_ttft_ms=40.0, alternative_endpoint="127.0.0.1:9002", alternative_ttft_ms=610.0),
        dict(stream=False, status=200, ttft_ms=410.0, cached_tokens=0, reason="cold"),
        dict(stream=True, status=503, ttft_ms=None, cached_tokens=None, prompt_tokens=None, completion_tokens=None,
             error="upstream connect error", reason="spill", predicted_ttft_ms=120.0),
        dict(stream=True, status=200, ttft_ms=50.0, cached_tokens=512, reason="failover",
             endpoint="127.0.0.1:9002", predicted_ttft_ms=0.0, alternative_endpoint="127.0.0.1:9002",
             alternative_ttft_ms=45.25),
    ]
    out = []
    for i, spec in enumerate(specs):
        ctx = child_context(spec.pop("traceparent", None))
        base = dict(trace_id=ctx.trace_id, span_id=ctx.span_id, parent_span_id=ctx.parent_span_id,
                    start_time=now - 5 + i, request_id=f"req-{i}", model="sim-llama", tenant_hash="t1",
                    policy="prefix", endpoint="127.0.0.1:9001", endpoints=("127.0.0.1:9001", "127.0.0.1:9002"),
                    matched_blocks=3, total_blocks=4, predicted_hit_ratio=0.75, decision_us=41.0 + i,
                    latency_ms=900.0 + i, prompt_tokens=1024, completion_tokens=64, path="/v1/chat/completions")
        base.update(spec)
        out.append(RequestRecord(**base))
    return out


def dump(*args: str) -> list[dict]:
    res = subprocess.run([*PREFIXROUTE, "telemetry", "dump", *args], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines()]


@pytest.mark.parametrize("encoder", ["fast", "sdk"])
def test_records_reach_dump_with_matching_ids_and_fields(receiver, encoder):
    recs = make_records(time.time())
    exporter = {"fast": None, "sdk": OTLPSpanExporter(endpoint=receiver.otlp_url)}[encoder]
    recorder = TelemetryRecorder(exporter=exporter, endpoint=receiver.otlp_url, environ={}, schedule_delay_ms=50)
    for r in recs:
        recorder.record(r)
    recorder.shutdown(10)
    assert recorder.num_exported == len(recs) and recorder.num_dropped == 0
    receiver.wait_rows(len(recs))

    from_db = dump("--since", "60", "--db", str(receiver.db))
    from_url = dump("--since", "60", "--url", receiver.http_url)
    assert from_db == from_url
    assert [d["request_id"] for d in from_db] == [r.request_id for r in recs]  # oldest first
    for got, want in zip(from_db, recs):
        assert DUMP_KEYS <= got.keys()
        for f in RECORD_FIELDS:
            w = getattr(want, f)
            if isinstance(w, tuple):
                w = list(w)
            assert got[f] == (pytest.approx(w) if isinstance(w, float) else w), f
    # The joined trace: same trace id as the client's traceparent, the client's span as parent.
    assert from_db[0]["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert from_db[0]["parent_span_id"] == "00f067aa0ba902b7"

    status, one = receiver.api(f"/api/request?trace_id={recs[3].trace_id}")
    assert status == 200
    attrs = one["attrs"]
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "sim-llama"
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == 512
    assert attrs["prefixroute.fallback_endpoints"] == ["127.0.0.1:9002"]
    assert attrs["resource.service.name"] == "prefixroute-router"
    assert (attrs["prefixroute.predicted_ttft_ms"], attrs["prefixroute.alternative_endpoint"],
            attrs["prefixroute.alternative_ttft_ms"]) == (0.0, "127.0.0.1:9002", 45.25)
    cold = receiver.api(f"/api/request?trace_id={recs[1].trace_id}")[1]
    assert not {k for k in cold["attrs"] if "predicted_ttft" in k or "alternative" in k}  # omitted when None
    assert cold["predicted_ttft_ms"] is None

    # Dashboard queries agree whether read from the file or over HTTP.
    now = time.time()
    with StoreReader(receiver.db) as reader, HttpStoreClient(receiver.http_url) as client:
        for name, args in [("summary", (60,)), ("endpoints", (60,)), ("reasons", (60,)),
                           ("timeseries", (60, 2.0)), ("ttft_predictions", (60,))]:
            assert getattr(reader, name)(*args, now=now) == getattr(client, name)(*args, now=now), name
    summary = receiver.api(f"/api/summary?window_s=60&now={now}")[1]
    with_usage = [r for r in recs if r.cached_tokens is not None]
    assert summary["actual_hit_ratio"] == pytest.approx(sum(r.cached_tokens for r in with_usage)
                                                        / sum(r.prompt_tokens for r in with_usage))
    assert summary["num_errors"] == 1
    # Predicted vs actual: three decisions carried a prediction; only the first is scored (the 503 failed,
    # the last was served by its fallback, not the primary the prediction was for).
    pred = receiver.api(f"/api/ttft_predictions?window_s=60&now={now}")[1]
    assert pred["num_predicted"] == 3
    (ep,) = pred["endpoints"]
    assert (ep["endpoint"], ep["num_requests"], ep["predicted_ttft_ms_p50"], ep["actual_ttft_ms_p50"]) == \
        ("127.0.0.1:9001", 1, 40.0, 35.5)
    assert ep["ape_ratio_p50"] == pytest.approx(4.5 / 35.5) and ep["alternative_ttft_ms_p50"] == 610.0


@pytest.mark.parametrize(("route", "status", "param"), [
    ("/api/summary?window_s=abc", 400, "window_s"),
    ("/api/summary?window_s=-5", 400, None),
    ("/api/timeseries?bucket_s=0", 400, None),
    ("/api/breakdown?by=attrs", 400, None),
    ("/api/recent?limit=0", 400, "limit"),
    ("/api/request", 400, "trace_id"),
    ("/api/request?trace_id=ffff", 404, None),
    ("/api/nothing", 404, None),
])
def test_http_api_errors_are_openai_shaped(receiver, route, status, param):
    got_status, body = receiver.api(route)
    assert got_status == status
    assert body["error"]["code"] == status and body["error"]["message"]
    assert body["error"]["param"] == param


def test_dump_failures(tmp_path, receiver):
    res = subprocess.run([*PREFIXROUTE, "telemetry", "dump", "--since", "60", "--db", str(tmp_path / "none.db")],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 1 and "no telemetry store" in res.stderr
    receiver.stop()
    res = subprocess.run([*PREFIXROUTE, "telemetry", "dump", "--since", "60", "--url", receiver.http_url],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 1 and receiver.http_url in res.stderr


def test_receiver_exits_cleanly_on_sigterm_and_keeps_data(receiver):
    recorder = TelemetryRecorder(endpoint=receiver.otlp_url, environ={}, schedule_delay_ms=20)
    for r in make_records(time.time()):
        recorder.record(r)
    recorder.shutdown(10)
    receiver.wait_rows(4)
    assert receiver.stop() == 0
    with StoreReader(receiver.db) as reader:
        assert reader.num_requests() == 4


def test_receiver_enforces_retention_periodically(receiver_factory):
    r = receiver_factory("--max-rows", "3", "--retention-interval-s", "0.2")
    recorder = TelemetryRecorder(endpoint=r.otlp_url, environ={}, schedule_delay_ms=20)
    now = time.time()
    for i in range(10):
        ctx = child_context(None)
        recorder.record(RequestRecord(trace_id=ctx.trace_id, span_id=ctx.span_id, start_time=now - 10 + i,
                                      request_id=f"ret-{i}", status=200))
    recorder.shutdown(10)
    def retained() -> dict | None:
        # The rows leave the store (num_requests, a count of the table) a moment before the writer thread adds
        # what it deleted to num_rows_deleted, so /api/stats may show 3 rows and 0 deleted in between: wait for
        # all three counters, not the first.
        stats = r.api("/api/stats")[1]
        return stats if (stats["num_rows_written"], stats["num_requests"], stats["num_rows_deleted"]) \
            == (10, 3, 7) else None

    stats = until(retained, 10, interval_s=0.1, message=lambda: r.api("/api/stats")[1])
    assert (stats["num_rows_written"], stats["num_requests"], stats["num_rows_deleted"]) == (10, 3, 7)
    kept = [d["request_id"] for d in dump("--since", "60", "--db", str(r.db))]
    assert kept == ["ret-7", "ret-8", "ret-9"]  # the newest survive


def test_receiver_fails_cleanly_when_a_port_is_taken(tmp_path):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        res = subprocess.run([*PREFIXROUTE, "telemetry", "--port", "0", "--http-port", str(taken.getsockname()[1]),
                              "--db", str(tmp_path / "t.db")], capture_output=True, text=True, timeout=30)
    finally:
        taken.close()
    assert res.returncode == 1 and "cannot start" in res.stderr
