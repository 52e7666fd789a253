"""The receiver accepts OTLP from any OpenTelemetry SDK, and the recorder honours the OTEL_* variables."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from helpers.waiting import until

pytestmark = pytest.mark.integration


def test_plain_sdk_traces_metrics_and_logs(receiver):
    resource = Resource.create({"service.name": "some-other-service"})
    tp = TracerProvider(resource=resource)
    tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=receiver.otlp_url)))
    tracer = tp.get_tracer("other")
    with tracer.start_as_current_span("handle request"):
        with tracer.start_as_current_span("db query"):
            pass
    # A third-party gateway that follows the attribute contract (prefixroute.request_id) is stored too.
    with tracer.start_as_current_span("gateway route", attributes={
            "prefixroute.request_id": "ext-1", "prefixroute.endpoint": "10.1.1.1:8000",
            "gen_ai.usage.input_tokens": 100, "prefixroute.cached_tokens": 25}):
        pass
    tp.shutdown()

    mp = MeterProvider(resource=resource, metric_readers=[
        PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=receiver.otlp_url), export_interval_millis=60_000)])
    mp.get_meter("other").create_counter("hits").add(3)
    mp.shutdown()

    lp = LoggerProvider(resource=resource)
    lp.add_log_record_processor(SimpleLogRecordProcessor(OTLPLogExporter(endpoint=receiver.otlp_url)))
    lp.get_logger("other").emit(LogRecord(body="hello from another service", severity_number=SeverityNumber.WARN))
    lp.shutdown()

    receiver.wait_rows(1)

    def everything_in() -> dict | None:
        stats = receiver.api("/api/stats")[1]
        return stats if stats["num_spans_ignored"] >= 2 and stats["num_log_records"] >= 1 else None

    stats = until(everything_in, 10, message=lambda: receiver.api("/api/stats")[1])
    assert stats["num_spans_received"] == 3 and stats["num_spans_ignored"] == 2 and stats["num_requests"] == 1
    assert stats["num_metric_points"] >= 1 and stats["num_log_records"] >= 1
    _, rows = receiver.api("/api/recent")
    (row,) = rows
    assert (row["request_id"], row["endpoint"], row["prompt_tokens"], row["cached_tokens"]) == (
        "ext-1", "10.1.1.1:8000", 100, 25)


def test_recorder_reads_standard_env(receiver):
    script = textwrap.dedent("""
        import time
        from prefixroute.telemetry.recorder import TelemetryRecorder
        from prefixroute.telemetry.records import RequestRecord
        r = TelemetryRecorder()
        assert r.max_queue_size == 77 and r.schedule_delay_s == 0.03, (r.max_queue_size, r.schedule_delay_s)
        r.record(RequestRecord(trace_id="ab" * 16, span_id="cd" * 8, start_time=time.time(), request_id="env-1",
                               status=200))
        r.shutdown(10)
        assert r.num_exported == 1, r.stats()
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=receiver.otlp_url, OTEL_SERVICE_NAME="router-a",
               OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test", OTEL_BSP_MAX_QUEUE_SIZE="77",
               OTEL_BSP_SCHEDULE_DELAY="30", OTEL_EXPORTER_OTLP_COMPRESSION="gzip",
               OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:1")  # the traces-specific variable wins
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    receiver.wait_rows(1)
    _, one = receiver.api("/api/request?trace_id=" + "ab" * 16)
    assert one["attrs"]["resource.service.name"] == "router-a"
    assert one["attrs"]["resource.deployment.environment"] == "test"
