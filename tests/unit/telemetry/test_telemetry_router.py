"""RouterTelemetry: the facade ext_proc holds (settings -> recorder + /metrics; its /metrics served over HTTP:
tests/integration/telemetry/test_telemetry_router_metrics.py)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from prefixroute import settings
from prefixroute.telemetry.metrics import RouterMetrics
from prefixroute.telemetry.recorder import TelemetryRecorder
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.router import RouterTelemetry, RouterTelemetrySettings


def test_on_response_survives_a_metrics_failure_and_still_records():
    exp = InMemorySpanExporter()
    recorder = TelemetryRecorder(exporter=exp, environ={}, schedule_delay_ms=10)
    t = RouterTelemetry(recorder, RouterMetrics(in_flight=lambda: 1 / 0))  # broken callback: only on scrape
    bad = RequestRecord(trace_id="1" * 32, span_id="1" * 16, start_time=0.0, status=200, prompt_tokens=10,
                        cached_tokens=5, predicted_hit_ratio=None)  # None * int raises inside metrics
    t.on_response(bad)
    t.on_decision(None, 1.0)  # type: ignore[arg-type]  # must log, not raise
    t.close()
    assert len(exp.get_finished_spans()) == 1


@pytest.mark.parametrize("flag", ["--metrics-port", "--otlp-endpoint", "--traces", "--no-traces",
                                  "--otlp-retry-max-spans", "--otlp-retry-max-bytes", "--otlp-max-export-bytes"])
def test_settings_reachable_by_flag(flag):
    import argparse

    p = argparse.ArgumentParser()
    settings.add_arguments(p, RouterTelemetrySettings)
    assert flag in p.format_help()
