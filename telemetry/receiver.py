"""The telemetry receiver: an OTLP/gRPC server that stores the router's request spans in SQLite.

It implements the OTLP collector services (TraceService, MetricsService, LogsService) so any
OpenTelemetry SDK or Collector can export to it:

- Traces: a span is a *request span* when it is named ``prefixroute.route`` or carries
  ``prefixroute.request_id``; each becomes one row of the store (see store.py). Other spans (e.g.
  the model server's children of the router span) are counted in `num_spans_ignored` and dropped.
- Metrics and logs: accepted and counted, not stored (the router's metrics are scraped from its
  Prometheus endpoint; logs have no place in the store). Answering OK keeps senders from retrying.

The gRPC handler only enqueues the decoded request; one writer thread converts spans to rows,
inserts them in batches (one transaction per drain) and enforces retention every
`retention_interval_s`. When the writer falls behind by `max_pending_batches` requests, new
exports are answered with OTLP partial success (``rejected_spans``) instead of growing memory.

An optional HTTP JSON API (`http_port`) serves the store queries to the dashboard and
`telemetry dump --url` (routes in `http_api.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from prefixroute.telemetry import attributes as A
from prefixroute.telemetry.store import TelemetryStore

log = logging.getLogger(__name__)

_STATUS_CODE_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


def any_value(v: Any) -> Any:
    """An OTLP AnyValue as a plain Python value (arrays -> list, kvlists -> dict, bytes -> hex)."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind)


def attributes_dict(kvs: Iterable[Any]) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


def _int(v: Any) -> int | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _float(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _str(v: Any) -> str | None:
    return None if v is None else str(v)


def is_request_span(name: str, attrs: Mapping[str, Any]) -> bool:
    return name == A.SPAN_NAME or A.REQUEST_ID in attrs


def span_to_row(span: Any, resource_attrs: Mapping[str, Any]) -> dict[str, Any] | None:
    """A store row for an OTLP request span, None for any other span. Pure; never raises on odd values
    (a wrongly typed attribute becomes NULL)."""
    attrs = attributes_dict(span.attributes)
    if not is_request_span(span.name, attrs):
        return None
    F = A.FIELD_ATTRIBUTES  # noqa: N806
    start_time = span.start_time_unix_nano / 1e9
    end_time = span.end_time_unix_nano / 1e9 if span.end_time_unix_nano else None
    latency_ms = _float(attrs.get(F["latency_ms"]))
    # The router writes latency_ms whenever it knows it; other senders get their span's duration.
    if latency_ms is None and end_time is not None and span.name != A.SPAN_NAME:
        latency_ms = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6
    endpoints = attrs.get(F["endpoints"])
    if isinstance(endpoints, str):
        endpoints = [endpoints]
    elif not isinstance(endpoints, list):
        endpoints = []
    cached = attrs.get(F["cached_tokens"], attrs.get(A.CACHE_READ_INPUT_TOKENS))
    error = _str(attrs.get(F["error"]))
    if error is None and span.status.code == _STATUS_CODE_ERROR:
        error = span.status.message or "error"
    status = _int(attrs.get(F["status"], attrs.get(A.STATUS)))
    stream = attrs.get(F["stream"])
    return {
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex() or None,
        "request_id": _str(attrs.get(F["request_id"])),
        "start_time": start_time,
        "end_time": end_time,
        "model": _str(attrs.get(F["model"])),
        "tenant_hash": _str(attrs.get(F["tenant_hash"])),
        "policy": _str(attrs.get(F["policy"])),
        "reason": _str(attrs.get(F["reason"])),
        "endpoint": _str(attrs.get(F["endpoint"], attrs.get(A.SERVER_ADDRESS))),
        "endpoints": json.dumps([str(e) for e in endpoints]),
        "matched_blocks": _int(attrs.get(F["matched_blocks"])),
        "total_blocks": _int(attrs.get(F["total_blocks"])),
        "predicted_hit_ratio": _float(attrs.get(F["predicted_hit_ratio"])),
        "decision_us": _float(attrs.get(F["decision_us"])),
        "ttft_ms": _float(attrs.get(F["ttft_ms"])),
        "latency_ms": latency_ms,
        "prompt_tokens": _int(attrs.get(F["prompt_tokens"])),
        "completion_tokens": _int(attrs.get(F["completion_tokens"])),
        "cached_tokens": _int(cached),
        "stream": None if stream is None else int(bool(stream)),
        "status": status,
        "error": error,
        "path": _str(attrs.get(F["path"])),
        "service_name": _str(resource_attrs.get("service.name")),
        "attrs": json.dumps({**{f"resource.{k}": v for k, v in resource_attrs.items()}, **attrs}, default=str),
    }


def request_rows(req: Any) -> tuple[list[dict[str, Any]], int]:
    """(rows for the request spans, number of other spans) of an ExportTraceServiceRequest."""
    rows, ignored = [], 0
    for rs in req.resource_spans:
        res_attrs = attributes_dict(rs.resource.attributes)
        for ss in rs.scope_spans:
            for span in ss.spans:
                row = span_to_row(span, res_attrs)
                if row is None:
                    ignored += 1
                else:
                    rows.append(row)
    return rows, ignored


class ReceiverStats:
    """Counters (written by the handler and writer threads; read for /api/stats and logs)."""

    def __init__(self) -> None:
        self.num_trace_exports = 0
        self.num_spans_received = 0
        self.num_spans_ignored = 0
        self.num_spans_rejected = 0  # refused because the writer was behind
        self.num_rows_written = 0
        self.num_rows_failed = 0  # batches that failed to insert (logged)
        self.num_rows_deleted = 0  # by retention
        self.num_metric_points = 0
        self.num_log_records = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


_STOP = object()


class StoreWriter:
    """The store's only writer: a thread draining decoded export requests into SQLite."""

    def __init__(self, store: TelemetryStore, stats: ReceiverStats, *, max_pending_batches: int = 1024,
                 retention_interval_s: float = 10.0) -> None:
        self.store = store
        self.stats = stats
        self.retention_interval_s = retention_interval_s
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending_batches)
        self._thread = threading.Thread(target=self._run, name="prefixroute-telemetry-writer", daemon=True)
        self._idle = threading.Event()
        self._thread.start()

    def submit(self, req: Any) -> bool:
        """Queue one ExportTraceServiceRequest; False (nothing queued) when the writer is behind."""
        try:
            self._queue.put_nowait(req)
        except queue.Full:
            return False
        self._idle.clear()
        return True

    def _run(self) -> None:
        next_retention = time.monotonic()
        stopping = False
        while not stopping:
            reqs = []
            try:
                reqs.append(self._queue.get(timeout=min(1.0, self.retention_interval_s)))
                while len(reqs) < 256:  # one transaction per drain, bounded so a flood still commits regularly
                    reqs.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            rows: list[dict[str, Any]] = []
            for r in reqs:
                if r is _STOP:
                    stopping = True
                    continue
                try:
                    got, ignored = request_rows(r)
                except Exception:  # one odd export must not stop the writer
                    log.exception("could not convert an OTLP export request")
                    continue
                rows.extend(got)
                self.stats.num_spans_ignored += ignored
            if rows:
                try:
                    self.stats.num_rows_written += self.store.insert_rows(rows)
                except Exception:
                    log.exception("failed to store %d request rows", len(rows))
                    self.stats.num_rows_failed += len(rows)
            now = time.monotonic()
            if now >= next_retention or stopping:
                try:
                    self.stats.num_rows_deleted += self.store.enforce_retention()
                except Exception:
                    log.exception("retention failed")
                next_retention = now + self.retention_interval_s
            if self._queue.empty():
                self._idle.set()
        self.store.close()

    def wait_idle(self, timeout_s: float = 5.0) -> bool:
        """Block until everything submitted so far is committed (tests, shutdown)."""
        return self._idle.wait(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Commit what is queued, run retention once, close the store."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)


class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, writer: StoreWriter, stats: ReceiverStats) -> None:
        self.writer, self.stats = writer, stats

    async def Export(self, request, context):  # noqa: N802 (gRPC method name)
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        self.stats.num_trace_exports += 1
        self.stats.num_spans_received += n
        resp = trace_service_pb2.ExportTraceServiceResponse()
        if not self.writer.submit(request):
            self.stats.num_spans_rejected += n
            resp.partial_success.rejected_spans = n
            resp.partial_success.error_message = "prefixroute telemetry receiver: store writer is behind"
        return resp


class MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, stats: ReceiverStats) -> None:
        self.stats = stats

    async def Export(self, request, context):  # noqa: N802
        n = 0
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    if kind is not None:
                        n += len(getattr(m, kind).data_points)
        self.stats.num_metric_points += n
        return metrics_service_pb2.ExportMetricsServiceResponse()


class LogsService(logs_service_pb2_grpc.LogsServiceServicer):
    def __init__(self, stats: ReceiverStats) -> None:
        self.stats = stats

    async def Export(self, request, context):  # noqa: N802
        self.stats.num_log_records += sum(len(sl.log_records) for rl in request.resource_logs
                                          for sl in rl.scope_logs)
        return logs_service_pb2.ExportLogsServiceResponse()


# OTLP exporters send up to 4 MiB by default; a Collector's batches can be larger.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class Receiver:
    """OTLP/gRPC server + store writer (+ optional HTTP query API). Start/stop from one asyncio loop."""

    def __init__(self, db_path: str, *, host: str = "127.0.0.1", port: int = 4317, http_port: int | None = None,
                 http_host: str | None = None, max_age_s: float = 86400.0, max_rows: int = 500_000,
                 retention_interval_s: float = 10.0, max_pending_batches: int = 1024) -> None:
        self.db_path = db_path
        self.host, self.port = host, port
        self.http_host, self.http_port = http_host or host, http_port
        self.stats = ReceiverStats()
        self._store_args = {"max_age_s": max_age_s, "max_rows": max_rows}
        self._writer_args = {"retention_interval_s": retention_interval_s, "max_pending_batches": max_pending_batches}
        self.writer: StoreWriter | None = None
        self._server: grpc.aio.Server | None = None
        self._http: Any = None

    async def start(self) -> None:
        """Open the store, start the writer, bind and start the servers; sets the bound ports."""
        store = TelemetryStore(self.db_path, **self._store_args)
        self.writer = StoreWriter(store, self.stats, **self._writer_args)
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES)])
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(self.writer, self.stats), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(MetricsService(self.stats), server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(LogsService(self.stats), server)
        self.port = server.add_insecure_port(f"{self.host}:{self.port}")
        if not self.port:
            raise OSError(f"cannot bind OTLP port on {self.host}")
        await server.start()
        self._server = server
        if self.http_port is not None:
            from prefixroute.telemetry.http_api import start_http_api

            try:
                self._http = start_http_api(self.db_path, self.http_host, self.http_port, stats=self.stats)
            except OSError:
                await self.stop(0)  # do not leave the gRPC server and the writer running half-started
                raise
            self.http_port = self._http.server_address[1]

    async def stop(self, grace_s: float = 2.0) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self.writer is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.writer.stop)
