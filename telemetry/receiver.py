"""The telemetry receiver: an OTLP/gRPC server that stores the router's request spans in SQLite.

It implements the OTLP collector services (TraceService, MetricsService, LogsService) so any
OpenTelemetry SDK or Collector can export to it:

- Traces: a span is a *request span* when it is named ``prefixroute.route`` or carries
  ``prefixroute.request_id``; each becomes one row of the store (see store_schema.py). Other spans (e.g.
  the model server's children of the router span) are counted in `num_spans_ignored` and dropped.
- Metrics and logs: accepted and counted, not stored (the router's metrics are scraped from its
  Prometheus endpoint; logs have no place in the store). Answering OK keeps senders from retrying.
  Except Envoy's records of requests (a log record with ``prefixroute.envoy_record``; envoy_config.py
  `records_otlp_address`, issue 27): each is held `envoy_record_hold_s` and stored as the request's record
  (reason "unrouted", service "envoy") only if the router's own record of the same ``x-request-id`` did not
  arrive meanwhile: requests that ran while the router was down, or was killed, keep a record.

The gRPC handler only enqueues the decoded request; one writer thread converts spans to rows,
inserts them in batches (one transaction per drain) and enforces retention every
`retention_interval_s`. When the writer falls behind by `max_pending_batches` requests, new
exports are answered with OTLP partial success (``rejected_spans``) instead of growing memory.

An optional HTTP JSON API (`http_port`) serves the store queries to the dashboard and
`telemetry dump --url` (routes in `http_api.py`).

Security (the port may be reachable by others): `tls` serves OTLP over TLS, and with a client CA
requires a client certificate signed by it (mutual TLS: the handshake fails without one, nothing is
read); `auth_token` requires ``authorization: Bearer <token>`` on every OTLP call (UNAUTHENTICATED
otherwise, before the request is parsed) and on the HTTP API's data routes (401). Whatever a sender
sends, a row stays bounded: attribute values are capped as the router caps its own (attributes.py),
at most MAX_ATTRIBUTES attributes, the attrs JSON at MAX_ATTRS_JSON_BYTES, a request at
`max_message_bytes`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from prefixroute.grpc_auth import BearerTokenInterceptor, server_credentials
from prefixroute.telemetry import attributes as A
from prefixroute.telemetry.store import DEFAULT_MAX_BYTES, TelemetryStore

log = logging.getLogger(__name__)

_STATUS_CODE_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


def any_value(v: Any, depth: int = 0) -> Any:
    """An OTLP AnyValue as a plain Python value (arrays -> list, kvlists -> dict, bytes -> hex), within
    the attribute limits of attributes.py whatever the sender sent: strings capped at
    MAX_ATTRIBUTE_BYTES, arrays and kvlists at MAX_ATTRIBUTE_LIST items, nesting at 4 levels."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "string_value":
        return A.cap_str(v.string_value)
    if kind in ("array_value", "kvlist_value") and depth >= 4:
        return None
    if kind == "array_value":
        return [any_value(x, depth + 1) for x in v.array_value.values[:A.MAX_ATTRIBUTE_LIST]]
    if kind == "kvlist_value":
        return {A.cap_str(kv.key): any_value(kv.value, depth + 1)
                for kv in v.kvlist_value.values[:A.MAX_ATTRIBUTE_LIST]}
    if kind == "bytes_value":
        return v.bytes_value[:A.MAX_ATTRIBUTE_BYTES // 2].hex()
    return getattr(v, kind)


def attributes_dict(kvs: Any) -> dict[str, Any]:
    """At most MAX_ATTRIBUTES attributes, keys and values capped (see `any_value`)."""
    return {A.cap_str(kv.key): any_value(kv.value) for kv in kvs[:A.MAX_ATTRIBUTES]}


MAX_ATTRS_JSON_BYTES = 32 * 1024
"""Largest ``attrs`` JSON kept in a row; beyond it only the attributes the store's columns come from are
kept (the router's own spans, at every attribute's cap, stay under it; a forged span with 128 capped
lists would otherwise write ~1 MB)."""


def _attrs_json(resource_attrs: Mapping[str, Any], attrs: Mapping[str, Any]) -> str:
    doc = {**{f"resource.{k}": v for k, v in resource_attrs.items()}, **attrs}
    out = json.dumps(doc, default=str)
    if len(out) <= MAX_ATTRS_JSON_BYTES:
        return out
    known = set(A.FIELD_ATTRIBUTES.values())
    kept = {k: v for k, v in attrs.items() if k in known}
    kept["prefixroute.attrs_truncated"] = True
    if "service.name" in resource_attrs:
        kept["resource.service.name"] = resource_attrs["service.name"]
    out = json.dumps(kept, default=str)
    return out if len(out) <= MAX_ATTRS_JSON_BYTES else '{"prefixroute.attrs_truncated": true}'


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
    return None if v is None else A.cap_str(str(v))


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
        error = A.cap_str(span.status.message) or "error"
    status = _int(attrs.get(F["status"], attrs.get(A.STATUS)))
    stream = attrs.get(F["stream"])
    return {
        # OTLP ids are 16 and 8 bytes; a sender's longer bytes are cut, not stored whole.
        "trace_id": span.trace_id[:16].hex(),
        "span_id": span.span_id[:8].hex(),
        "parent_span_id": span.parent_span_id[:8].hex() or None,
        "request_id": _str(attrs.get(F["request_id"])),
        "start_time": start_time,
        "end_time": end_time,
        "model": _str(attrs.get(F["model"])),
        "tenant_hash": _str(attrs.get(F["tenant_hash"])),
        "policy": _str(attrs.get(F["policy"])),
        "reason": _str(attrs.get(F["reason"])),
        "endpoint": _str(attrs.get(F["endpoint"], attrs.get(A.SERVER_ADDRESS))),
        "endpoints": json.dumps([A.cap_str(str(e)) for e in endpoints]),
        "matched_blocks": _int(attrs.get(F["matched_blocks"])),
        "total_blocks": _int(attrs.get(F["total_blocks"])),
        "predicted_hit_ratio": _float(attrs.get(F["predicted_hit_ratio"])),
        "predicted_ttft_ms": _float(attrs.get(F["predicted_ttft_ms"])),
        "alternative_endpoint": _str(attrs.get(F["alternative_endpoint"])),
        "alternative_ttft_ms": _float(attrs.get(F["alternative_ttft_ms"])),
        "index_source": _str(attrs.get(F["index_source"])),
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
        "attrs": _attrs_json(resource_attrs, attrs),
    }


def envoy_log_to_row(record: Any) -> dict[str, Any] | None:
    """A store row for one of Envoy's request records (envoy_config.RECORD_ATTRIBUTES), None for any other log
    record. Ids are derived from the request id (one row per request, whoever sends it twice)."""
    attrs = attributes_dict(record.attributes)
    if attrs.get("prefixroute.envoy_record") != "1":
        return None
    rid = _str(attrs.get("prefixroute.request_id"))
    if not rid or rid == "-":
        return None
    digest = hashlib.blake2b(rid.encode("utf-8", "replace"), digest_size=24).hexdigest()
    start = _float(attrs.get("prefixroute.start_time"))
    latency = _float(attrs.get("prefixroute.latency_ms"))
    flags = _str(attrs.get("prefixroute.response_flags"))
    endpoint = _str(attrs.get("prefixroute.endpoint"))
    status = _int(attrs.get("prefixroute.status"))
    return {
        "trace_id": digest[:32], "span_id": digest[32:48], "parent_span_id": None, "request_id": rid,
        "start_time": start if start is not None else record.time_unix_nano / 1e9,
        "end_time": start + latency / 1000.0 if start is not None and latency is not None else None,
        "model": None, "tenant_hash": None, "policy": "", "reason": "unrouted",
        "endpoint": None if endpoint in (None, "-") else endpoint, "endpoints": "[]", "matched_blocks": 0,
        "total_blocks": 0, "predicted_hit_ratio": 0.0, "predicted_ttft_ms": None, "alternative_endpoint": None,
        "alternative_ttft_ms": None, "index_source": None, "decision_us": 0.0, "ttft_ms": None,
        "latency_ms": latency, "prompt_tokens": None, "completion_tokens": None, "cached_tokens": None,
        "stream": None, "status": status,
        "error": None if not flags or flags == "-" else f"envoy: {A.cap_str(flags)}",
        "path": _str(attrs.get("prefixroute.path")), "service_name": "envoy",
        "attrs": _attrs_json({}, {"prefixroute.route": attrs.get("prefixroute.route"), "source": "envoy"}),
    }


def envoy_rows(req: Any) -> list[dict[str, Any]]:
    """Rows for Envoy's request records in an ExportLogsServiceRequest."""
    return [row for rl in req.resource_logs for sl in rl.scope_logs for lr in sl.log_records
            if (row := envoy_log_to_row(lr)) is not None]


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
        self.num_unauthenticated = 0  # export calls refused: no or wrong bearer token (their spans unread)
        self.num_rows_written = 0
        self.num_rows_failed = 0  # batches that failed to insert (logged)
        self.num_rows_deleted = 0  # by retention
        self.num_metric_points = 0
        self.num_log_records = 0
        self.num_envoy_records = 0  # Envoy's request records received
        self.num_envoy_records_stored = 0  # ...stored: the router's own record never came

    def count_unauthenticated(self) -> None:
        self.num_unauthenticated += 1

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


_STOP = object()

ENVOY_RECORD_HOLD_S = 15.0
"""How long Envoy's record of a request waits for the router's own: the router exports its spans in batches
within ~5 s, and sends its record only at the response's end (the observing stream's last message)."""
MAX_HELD = 65536
"""Envoy's records held, and router request ids remembered, at most (oldest out)."""


class StoreWriter:
    """The store's only writer: a thread draining decoded export requests into SQLite."""

    def __init__(self, store: TelemetryStore, stats: ReceiverStats, *, max_pending_batches: int = 1024,
                 max_pending_bytes: int = 256 << 20, retention_interval_s: float = 10.0,
                 envoy_record_hold_s: float = ENVOY_RECORD_HOLD_S) -> None:
        self.store = store
        self.stats = stats
        self.envoy_record_hold_s = envoy_record_hold_s
        # Envoy's records waiting for the router's (request id -> (due, row)), and the request ids the router's
        # records carried lately: both bounded (MAX_HELD), oldest out.
        self._held: collections.OrderedDict[str, tuple[float, dict[str, Any]]] = collections.OrderedDict()
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.retention_interval_s = retention_interval_s
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0  # wire size of the queued requests (updated under _bytes_lock)
        self._bytes_lock = threading.Lock()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending_batches)
        self._thread = threading.Thread(target=self._run, name="prefixroute-telemetry-writer", daemon=True)
        self._idle = threading.Event()
        self._thread.start()

    def submit(self, req: Any, num_bytes: int = 0) -> bool:
        """Queue one ExportTraceServiceRequest, or an ExportLogsServiceRequest of Envoy's records (`num_bytes`:
        its wire size); False (nothing queued) when the writer is behind by max_pending_batches requests or
        max_pending_bytes bytes."""
        with self._bytes_lock:
            if self._pending_bytes and self._pending_bytes + num_bytes > self.max_pending_bytes:
                return False
            self._pending_bytes += num_bytes
        try:
            self._queue.put_nowait((req, num_bytes))
        except queue.Full:
            with self._bytes_lock:
                self._pending_bytes -= num_bytes
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
            for item in reqs:
                if item is _STOP:
                    stopping = True
                    continue
                r, num_bytes = item
                with self._bytes_lock:
                    self._pending_bytes -= num_bytes
                try:
                    if isinstance(r, logs_service_pb2.ExportLogsServiceRequest):
                        self._hold(envoy_rows(r))
                        continue
                    got, ignored = request_rows(r)
                except Exception:  # one odd export must not stop the writer
                    log.exception("could not convert an OTLP export request")
                    continue
                rows.extend(got)
                self.stats.num_spans_ignored += ignored
            rows.extend(self._settle(rows, time.monotonic(), stopping))
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

    def _hold(self, rows: list[dict[str, Any]]) -> None:
        due = time.monotonic() + self.envoy_record_hold_s
        for row in rows:
            self.stats.num_envoy_records += 1
            rid = row["request_id"]
            if rid in self._seen or rid in self._held:
                continue  # the router's record is in already (or Envoy sent it twice)
            self._held[rid] = (due, row)
            if len(self._held) > MAX_HELD:
                self._settle_one(*self._held.popitem(last=False))

    def _settle(self, router_rows: list[dict[str, Any]], now: float, flush: bool) -> list[dict[str, Any]]:
        """Note the request ids of the router's rows (their Envoy records are dropped); return Envoy's records
        whose hold is over (all of them when `flush`)."""
        seen, held = self._seen, self._held
        for row in router_rows:
            rid = row.get("request_id")
            if rid:
                held.pop(rid, None)
                seen[rid] = None
                seen.move_to_end(rid)
        while len(seen) > MAX_HELD:
            seen.popitem(last=False)
        out = []
        while held:
            rid, (due, row) = next(iter(held.items()))
            if due > now and not flush:
                break
            del held[rid]
            out.append(row)
        self.stats.num_envoy_records_stored += len(out)
        return out

    def _settle_one(self, rid: str, item: tuple[float, dict[str, Any]]) -> None:
        try:
            self.stats.num_rows_written += self.store.insert_rows([item[1]])
            self.stats.num_envoy_records_stored += 1
        except Exception:
            log.exception("failed to store Envoy's record of %s", rid)

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
        if not self.writer.submit(request, request.ByteSize()):
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
    def __init__(self, stats: ReceiverStats, writer: StoreWriter | None = None) -> None:
        self.stats = stats
        self.writer = writer

    async def Export(self, request, context):  # noqa: N802
        n = sum(len(sl.log_records) for rl in request.resource_logs for sl in rl.scope_logs)
        self.stats.num_log_records += n
        resp = logs_service_pb2.ExportLogsServiceResponse()
        # Envoy's request records (module docstring) go to the writer; other logs are only counted.
        if self.writer is not None and any(
                kv.key == "prefixroute.envoy_record"
                for rl in request.resource_logs for sl in rl.scope_logs for lr in sl.log_records[:1]
                for kv in lr.attributes):
            if not self.writer.submit(request, request.ByteSize()):
                resp.partial_success.rejected_log_records = n
                resp.partial_success.error_message = "prefixroute telemetry receiver: store writer is behind"
        return resp


DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""Largest OTLP export request accepted (gRPC answers RESOURCE_EXHAUSTED beyond it; the router then splits
the request in halves). 16 MiB: four times the 4 MiB that OTLP exporters and Collectors send at most by
default, and a bound on the memory one request can take."""


@dataclasses.dataclass(frozen=True)
class ServerTls:
    """PEM files of the receiver's TLS: its certificate chain and key, and, for mutual TLS, the CA whose
    client certificates are accepted (then required: a sender without one fails the handshake)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """ValueError when a file cannot be read."""
        return server_credentials(self.cert_file, self.key_file, self.client_ca_file or "")  # type: ignore[return-value]


class Receiver:
    """OTLP/gRPC server + store writer (+ optional HTTP query API). Start/stop from one asyncio loop.

    `tls`: serve OTLP over TLS (mutual TLS when it names a client CA); `auth_token`: require
    ``authorization: Bearer <token>`` on every OTLP call and on the HTTP API's data routes."""

    def __init__(self, db_path: str, *, host: str = "127.0.0.1", port: int = 4317, http_port: int | None = None,
                 http_host: str | None = None, max_age_s: float = 86400.0, max_rows: int = 500_000,
                 max_bytes: int = DEFAULT_MAX_BYTES, retention_interval_s: float = 10.0,
                 max_pending_batches: int = 1024, max_pending_bytes: int = 256 << 20,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tls: ServerTls | None = None,
                 auth_token: str | None = None, run_id: str | None = None,
                 envoy_record_hold_s: float = ENVOY_RECORD_HOLD_S) -> None:
        self.db_path = db_path
        self.host, self.port = host, port
        self.http_host, self.http_port = http_host or host, http_port
        self.stats = ReceiverStats()
        self.max_message_bytes = max_message_bytes
        self.tls = tls
        self.auth_token = auth_token or None
        # run_id: stamped on every stored request (store_schema.py: the runs table).
        self._store_args = {"max_age_s": max_age_s, "max_rows": max_rows, "max_bytes": max_bytes, "run_id": run_id}
        self._writer_args = {"retention_interval_s": retention_interval_s, "max_pending_batches": max_pending_batches,
                             "max_pending_bytes": max_pending_bytes, "envoy_record_hold_s": envoy_record_hold_s}
        self.writer: StoreWriter | None = None
        self._server: grpc.aio.Server | None = None
        self._http: Any = None

    async def start(self) -> None:
        """Open the store, start the writer, bind and start the servers; sets the bound ports."""
        creds = self.tls.grpc_credentials() if self.tls is not None else None  # unreadable files: fail first
        store = TelemetryStore(self.db_path, **self._store_args)
        self.writer = StoreWriter(store, self.stats, **self._writer_args)
        interceptors = [BearerTokenInterceptor(self.auth_token, label="telemetry receiver",
                                             on_refused=self.stats.count_unauthenticated)] if self.auth_token else []
        server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", 1 << 20)])  # answers are tiny
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(self.writer, self.stats), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(MetricsService(self.stats), server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(LogsService(self.stats, self.writer), server)
        address = f"{self.host}:{self.port}"
        try:
            self.port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc raises RuntimeError when it cannot bind
            self.port = 0
            log.debug("bind %s: %s", address, exc)
        if not self.port:
            await self.stop(0)
            raise OSError(f"cannot bind OTLP port {address}")
        await server.start()
        self._server = server
        if self.http_port is not None:
            from prefixroute.telemetry.http_api import start_http_api

            try:
                self._http = start_http_api(self.db_path, self.http_host, self.http_port, stats=self.stats,
                                            auth_token=self.auth_token)
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
