"""The router's telemetry built from its settings serves /metrics over HTTP (decisions, in-flight counts) and,
with traces off, counts each record as dropped with its reason."""

from __future__ import annotations

import urllib.request

import pytest

from prefixroute import settings
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.router import RouterTelemetry, RouterTelemetrySettings
from prefixroute.types import Decision

pytestmark = pytest.mark.integration


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
