"""Telemetry: per-request records -> OTLP spans (recorder), router Prometheus metrics, the OTLP
receiver and its SQLite request store, and the query API the dashboard reads.

Modules: records (RequestRecord), tracecontext (W3C traceparent), usage (token usage from responses),
record_spans (a record as its span's attributes), recorder (TelemetryRecorder: queue and export),
otlp_encode (the fast span encoder and exporter), metrics (RouterMetrics), router (RouterTelemetry facade for
ext_proc), receiver (OTLP/gRPC server and its writer thread), otlp_decode (OTLP requests -> store rows),
store_schema (the request table and its definitions), store (TelemetryStore: the single writer, retention),
store_reader (StoreReader queries; StoreQueries, the interface the HTTP client shares), http_api / client (the
same queries over HTTP), cli (`prefixroute telemetry`).
"""
