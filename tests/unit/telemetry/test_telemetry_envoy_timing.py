"""Issue 26: a request's TTFT and latency in the store are Envoy's (its record's timing attributes), the router's own
kept beside them; Envoy's record and the router's meet in either order, by request id and the router's span."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2

from helpers.waiting import until
from prefixroute.telemetry import attributes as A
from prefixroute.telemetry.otlp_decode import envoy_rows, envoy_timing_ms
from prefixroute.telemetry.receiver import ReceiverStats, StoreWriter
from prefixroute.telemetry.store import TelemetryStore
from prefixroute.telemetry.store_reader import StoreReader
from prefixroute.dashboard.data import recent_frame

TRACE, SPAN = "ab" * 16, "cd" * 8


def _attrs(**over: str) -> dict[str, str]:
    start = time.time() - 1.0
    base = {"prefixroute.envoy_record": "1", "prefixroute.request_id": "r1", "prefixroute.path": "/v1/completions",
            "prefixroute.status": "200", "prefixroute.latency_ms": "80", "prefixroute.start_time": f"{start:.6f}",
            "prefixroute.endpoint": "127.0.0.1:8001", "prefixroute.response_flags": "-", "prefixroute.route": "r",
            "prefixroute.ttft_us": "31250", "prefixroute.first_token_us": "-", "prefixroute.duration_us": "80420",
            "prefixroute.traceparent": f"00-{TRACE}-{SPAN}-01"}
    return base | over


def _logs(*records: dict[str, str]) -> logs_service_pb2.ExportLogsServiceRequest:
    req = logs_service_pb2.ExportLogsServiceRequest()
    sl = req.resource_logs.add().scope_logs.add()
    for attrs in records:
        lr = sl.log_records.add(time_unix_nano=time.time_ns())
        for k, v in attrs.items():
            lr.attributes.append(common_pb2.KeyValue(key=k, value=common_pb2.AnyValue(string_value=v)))
    return req


def _spans(rid: str, ttft_ms: float, latency_ms: float, trace: str = TRACE,
           span: str = SPAN) -> trace_service_pb2.ExportTraceServiceRequest:
    req = trace_service_pb2.ExportTraceServiceRequest()
    s = req.resource_spans.add().scope_spans.add().spans.add(
        name=A.SPAN_NAME, trace_id=bytes.fromhex(trace), span_id=bytes.fromhex(span),
        start_time_unix_nano=time.time_ns() - 10**9, end_time_unix_nano=time.time_ns())
    F = A.FIELD_ATTRIBUTES  # noqa: N806
    for k, v in ((F["request_id"], common_pb2.AnyValue(string_value=rid)),
                 (F["ttft_ms"], common_pb2.AnyValue(double_value=ttft_ms)),
                 (F["latency_ms"], common_pb2.AnyValue(double_value=latency_ms))):
        s.attributes.append(common_pb2.KeyValue(key=k, value=v))
    return req


def test_envoy_timing_reads_microseconds_and_prefers_a_stamped_first_token() -> None:
    a = _attrs()
    start = float(a["prefixroute.start_time"])
    assert envoy_timing_ms(a, start) == (31.25, 80.42)
    # A Responses stream: the Lua stamp (unix microseconds) wins over the first body byte (its opening events).
    stamped = _attrs(**{"prefixroute.first_token_us": str(round((start + 0.0455) * 1e6))})
    ttft, _ = envoy_timing_ms(stamped, start)
    assert ttft == pytest.approx(45.5, abs=0.01)
    # A stamp outside the request's own time is not believed; "-" (no body, no time point) is no figure.
    late = _attrs(**{"prefixroute.first_token_us": str(round((start + 5) * 1e6))})
    assert envoy_timing_ms(late, start)[0] == 31.25
    assert envoy_timing_ms(_attrs(**{"prefixroute.ttft_us": "-", "prefixroute.duration_us": "-"}), start) == \
        (None, 80.0)  # an older Envoy config: whole milliseconds of %DURATION%


def test_envoy_row_names_the_routers_span_only_from_a_valid_traceparent() -> None:
    (row,) = envoy_rows(_logs(_attrs()))
    assert (row["ttft_ms"], row["latency_ms"], row["router_span"], row["timing_source"]) == \
        (31.25, 80.42, (TRACE, SPAN), "envoy")
    (row,) = envoy_rows(_logs(_attrs(**{"prefixroute.traceparent": "-"})))
    assert row["router_span"] is None


def _writer(tmp_path: Path) -> tuple[StoreWriter, ReceiverStats, Path]:
    db = tmp_path / "t.db"
    stats = ReceiverStats()
    return StoreWriter(TelemetryStore(db), stats, envoy_record_hold_s=0.5), stats, db


def _rows(db: Path) -> list[tuple]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute("SELECT request_id, ttft_ms, latency_ms, router_ttft_ms, router_latency_ms, "
                            "timing_source, service_name FROM requests ORDER BY request_id").fetchall()
    finally:
        conn.close()


@pytest.mark.parametrize("envoy_first", [True, False])
def test_the_stored_row_has_envoys_timing_and_keeps_the_routers(tmp_path: Path, envoy_first: bool) -> None:
    w, stats, db = _writer(tmp_path)
    try:
        parts = [_logs(_attrs()), _spans("r1", ttft_ms=12.0, latency_ms=70.0)]
        for part in parts if envoy_first else parts[::-1]:
            w.submit(part)
            assert w.wait_idle()
        time.sleep(0.7)  # past the hold on purpose: Envoy's record must not come in as a row of its own
        w.submit(_spans("other", ttft_ms=5.0, latency_ms=6.0, span="ef" * 8))  # a drain after the hold
        until(lambda: len(_rows(db)) == 2, 5, message=lambda: _rows(db))
        assert _rows(db) == [("other", 5.0, 6.0, 5.0, 6.0, "router", None),
                             ("r1", 31.25, 80.42, 12.0, 70.0, "envoy", None)]
        assert stats.num_envoy_timings_joined == 1 and stats.num_envoy_records_stored == 0
        # The dashboard's recent-requests table shows whose clock each TTFT is, and the router's own beside it.
        with StoreReader(db) as reader:
            frame = recent_frame(reader.recent_requests(10))
        shown = {(r.ttft_ms, r.timing_source, r.router_ttft_ms) for r in frame.itertuples()}
        assert shown == {(31.25, "envoy", 12.0), (5.0, "router", 5.0)}
    finally:
        w.stop()


@pytest.mark.parametrize("envoy_first", [True, False])
def test_a_reused_request_id_gets_no_other_requests_timing(tmp_path: Path, envoy_first: bool) -> None:
    w, stats, db = _writer(tmp_path)
    try:
        parts = [_logs(_attrs(**{"prefixroute.traceparent": f"00-{TRACE}-{'ee' * 8}-01"})),
                 _spans("r1", ttft_ms=12.0, latency_ms=70.0)]
        for part in parts if envoy_first else parts[::-1]:
            w.submit(part)
            assert w.wait_idle()
        until(lambda: len(_rows(db)) == 1, 5, message=lambda: _rows(db))
        assert _rows(db) == [("r1", 12.0, 70.0, 12.0, 70.0, "router", None)]
        assert stats.num_envoy_timings_joined == 0
    finally:
        w.stop()


def test_an_envoy_only_row_has_envoys_timing(tmp_path: Path) -> None:
    w, stats, db = _writer(tmp_path)
    try:
        w.submit(_logs(_attrs(**{"prefixroute.request_id": "lost"})))
        until(lambda: len(_rows(db)) == 1, 5, message=lambda: _rows(db))
        assert _rows(db) == [("lost", 31.25, 80.42, None, None, "envoy", "envoy")]
    finally:
        w.stop()

