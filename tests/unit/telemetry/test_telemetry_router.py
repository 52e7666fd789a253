"""RouterTelemetry: the facade ext_proc holds (settings -> recorder + /metrics)."""

from __future__ import annotations

import urllib.request

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from prefixroute import settings
from prefixroute.types import Decision
from prefixroute.telemetry.metrics import RouterMetrics
from prefixroute.telemetry.recorder import TelemetryRecorder
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.router import RouterTelemetry, RouterTelemetrySettings


def test_from_settings_serves_metrics_and_respects_traces_off(monkeypatch):
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    cfg = settings.from_namespace(RouterTelemetrySettings, None, environ={"PREFIXROUTE_EXTPROC_METRICS_PORT": "0",
                                                                         "PREFIXROUTE_EXTPROC_TRACES": "false"})
    t = RouterTelemetry.from_settings(cfg, in_flight=lambda: {"a:1": 4})
    try:
        assert not t.recorder.enabled
        t.on_decision(Decision(("a:1",), "cold", "prefix"), 12.0)
        t.on_response(RequestRecord(trace_id="1" * 32, span_id="1" * 16, start_time=0.0, endpoint="a:1", status=200))
        port = t.metrics_server.server_address[1]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'prefixroute_decisions_total{endpoint="a:1",policy="prefix",reason="cold"} 1.0' in text
        assert 'prefixroute_endpoint_in_flight{endpoint="a:1"} 4.0' in text
        # traces off: the record counts as dropped, with its reason
        assert 'prefixroute_telemetry_spans_dropped_total{reason="disabled"} 1.0' in text
    finally:
        t.close()


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
