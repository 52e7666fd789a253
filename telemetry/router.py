"""`RouterTelemetry`: what the ext_proc service holds — the span recorder and the Prometheus metrics
behind two calls, plus the settings that configure them.

Wiring in the servicer (per request)::

    ctx = tracecontext.child_context(headers.get("traceparent"))   # at request headers
    rec = RequestRecord(trace_id=ctx.trace_id, span_id=ctx.span_id, parent_span_id=ctx.parent_span_id,
                        start_time=time.time(), ...)
    # set header "traceparent: ctx.traceparent" on the request to the model server
    telemetry.on_decision(decision, decision_us)                      # after the scheduler answers
    ... fill rec (endpoint served, status, ttft_ms, latency_ms, usage) as responses arrive ...
    telemetry.on_response(rec)                                        # once, at response end

Both calls are synchronous, O(microseconds) and never raise (a telemetry bug must not fail a request).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

from prefixroute.types import Decision
from prefixroute.settings import Settings, setting
from prefixroute.telemetry.metrics import RouterMetrics, start_metrics_server
from prefixroute.telemetry.recorder import (DEFAULT_MAX_EXPORT_BYTES, DEFAULT_RETRY_MAX_BYTES,
                                             DEFAULT_RETRY_MAX_SPANS, OTLP_IMPORT_ERROR, TelemetryRecorder)
from prefixroute.telemetry.records import RequestRecord

log = logging.getLogger(__name__)

OTLP_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
"""Where the OpenTelemetry SDKs read the span endpoint; with neither (nor --otlp-endpoint) the router exports none."""


@dataclasses.dataclass(frozen=True)
class RouterTelemetrySettings(Settings):
    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_EXTPROC_"
    TITLE: ClassVar[str] = "Router telemetry (traces via the standard OTEL_* variables)"

    metrics_port: int = setting(9464, "Port of the router's Prometheus /metrics (9464: the OpenTelemetry "
                                      "Prometheus exporter's customary port); -1 disables it, 0 picks a free one.")
    metrics_host: str = setting("127.0.0.1", "Address for /metrics (loopback unless a scraper elsewhere needs it).")
    traces: bool = setting(True, "Export one OTLP span per routed request (also off with OTEL_SDK_DISABLED=true "
                                 "or OTEL_TRACES_EXPORTER=none).")
    otlp_endpoint: str | None = setting(None, "OTLP/gRPC endpoint for the spans, e.g. http://127.0.0.1:4317; "
                                              "unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT; "
                                              "none of the three set: no span is exported (traces off, said in the "
                                              "ready line), never to a localhost:4317 this process did not start "
                                              "(`prefixroute up` sets its own receiver's). "
                                              "https:// for TLS (OTEL_EXPORTER_OTLP_CERTIFICATE: the CA; "
                                              "_CLIENT_CERTIFICATE / _CLIENT_KEY: mTLS; _HEADERS: "
                                              "authorization=Bearer%20TOKEN).")
    otlp_retry_max_spans: int = setting(DEFAULT_RETRY_MAX_SPANS, "Spans held for re-export while the OTLP "
                                        "backend is unavailable (retried with backoff; beyond it the oldest are "
                                        "dropped and counted): ~4 min at 140 requests/s.")
    otlp_retry_max_bytes: int = setting(DEFAULT_RETRY_MAX_BYTES, "Bytes of encoded spans held for re-export (32 MiB: "
                                        "~30,000 typical spans of ~1.1 KB, ~1,500 at every attribute's size cap).")
    otlp_max_export_bytes: int = setting(DEFAULT_MAX_EXPORT_BYTES, "Largest OTLP export request; bigger ones, and "
                                         "any the backend refuses as too large, are split in halves (4 MiB: gRPC's "
                                         "default receive limit, which Collectors keep).")


class RouterTelemetry:
    def __init__(self, recorder: TelemetryRecorder, metrics: RouterMetrics, metrics_server: Any | None = None):
        self.recorder = recorder
        self.metrics = metrics
        self.metrics_server = metrics_server

    @classmethod
    def from_settings(cls, cfg: RouterTelemetrySettings, *,
                      in_flight: Callable[[], Mapping[str, int]] | None = None,
                      index_size: Callable[[], int | Mapping[str, int]] | None = None,
                      endpoint_states: Callable[[], Iterable[Any]] | None = None,
                      time_model: Callable[[], Mapping[str, tuple[float, float, float, int]]] | None = None,
                      index_info: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None,
                      ) -> RouterTelemetry:
        """Build the recorder and metrics and start /metrics. Raises OSError only when the metrics port
        cannot be bound (a configuration error worth failing startup for); a broken OTLP configuration
        logs and disables tracing instead."""
        # Unconfigured: off, unless the exporter cannot even be imported (the recorder then says that, the
        # more fundamental reason).
        unconfigured = (cfg.traces and OTLP_IMPORT_ERROR is None
                        and not (cfg.otlp_endpoint or any(os.environ.get(k) for k in OTLP_ENDPOINT_VARIABLES)))
        try:
            recorder = TelemetryRecorder(enabled=None if cfg.traces and not unconfigured else False,
                                         endpoint=cfg.otlp_endpoint,
                                         retry_max_spans=cfg.otlp_retry_max_spans,
                                         retry_max_bytes=cfg.otlp_retry_max_bytes,
                                         max_export_bytes=cfg.otlp_max_export_bytes)
        except Exception:  # e.g. a bad OTEL_EXPORTER_OTLP_COMPRESSION value
            log.exception("tracing disabled: could not build the OTLP exporter")
            recorder = TelemetryRecorder(enabled=False)
        if unconfigured:
            # The SDKs' default (http://localhost:4317) would send every request's span to whatever listens
            # there: on a shared host, another user's receiver; with none, a failed export per batch.
            recorder.disabled_reason = ("no OTLP endpoint configured (--otlp-endpoint or "
                                        "OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT)")
        metrics = RouterMetrics(in_flight=in_flight, index_size=index_size, endpoint_states=endpoint_states,
                                recorder=recorder, time_model=time_model, index_info=index_info)
        server = None
        if cfg.metrics_port >= 0:
            server = start_metrics_server(metrics, cfg.metrics_port, cfg.metrics_host)
        return cls(recorder, metrics, server)

    def on_decision(self, decision: Decision, decision_us: float) -> None:
        try:
            self.metrics.observe_decision(decision, decision_us)
        except Exception:  # never fail a request for telemetry
            log.exception("metrics: observe_decision failed")

    def on_response(self, rec: RequestRecord) -> None:
        try:
            self.metrics.observe_response(rec)
        except Exception:
            log.exception("metrics: observe_response failed")
        self.recorder.record(rec)

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush queued spans (up to `timeout_s`) and stop /metrics."""
        self.recorder.shutdown(timeout_s)
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
