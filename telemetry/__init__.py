"""Telemetry: per-request records -> OTLP spans (recorder), router Prometheus metrics, the OTLP
receiver and its SQLite request store, and the query API the dashboard reads.

Modules: records (RequestRecord), tracecontext (W3C traceparent), usage (token usage from responses),
recorder (TelemetryRecorder), metrics (RouterMetrics), router (RouterTelemetry facade for ext_proc),
receiver (OTLP/gRPC server), store (SQLite schema + StoreReader queries), http_api / client (the
same queries over HTTP), cli (`prefixroute telemetry`).
"""
