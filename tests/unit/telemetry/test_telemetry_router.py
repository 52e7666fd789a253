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


@pytest.mark.parametrize("variable", [None, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"])
def test_spans_go_only_to_an_endpoint_the_user_configured(monkeypatch, variable):
    """No --otlp-endpoint and no OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT: no export at all (the SDKs' default,
    localhost:4317, may be another user's receiver on a shared host), and the ready line says why."""
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED",
                 "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    if variable:
        monkeypatch.setenv(variable, "http://127.0.0.1:1")
    t = RouterTelemetry.from_settings(RouterTelemetrySettings(metrics_port=-1))
    try:
        assert t.recorder.enabled is bool(variable)
        assert (t.recorder.disabled_reason is None) is bool(variable)
        if not variable:
            assert "no OTLP endpoint configured" in t.recorder.disabled_reason
    finally:
        t.close(0.1)
    explicit = RouterTelemetry.from_settings(RouterTelemetrySettings(metrics_port=-1,
                                                                     otlp_endpoint="http://127.0.0.1:1"))
    try:
        assert explicit.recorder.enabled and explicit.recorder.disabled_reason is None
    finally:
        explicit.close(0.1)
    off = RouterTelemetry.from_settings(RouterTelemetrySettings(metrics_port=-1, traces=False))
    assert not off.recorder.enabled and off.recorder.disabled_reason is None
    off.close(0.1)
