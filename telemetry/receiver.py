"""The telemetry receiver: an OTLP/gRPC server that stores the router's request spans in SQLite.

It implements the OTLP collector services (TraceService, MetricsService, LogsService) so any
OpenTelemetry SDK or Collector can export to it:

- Traces: a span is a *request span* when it is named ``prefixroute.route`` or carries
  ``prefixroute.request_id``; each becomes one row of the store (otlp_decode.py, store_schema.py). Other spans (e.g.
  the model server's children of the router span) are counted in `num_spans_ignored` and dropped.
- Metrics and logs: accepted and counted, not stored (the router's metrics are scraped from its
  Prometheus endpoint; logs have no place in the store). Answering OK keeps senders from retrying.
  Except Envoy's records of requests (a log record with ``prefixroute.envoy_record``; envoy_config.py
  `records_otlp_address`): each is held `envoy_record_hold_s` and stored as the request's record
  (reason "unrouted", service "envoy") only if the router's own record of the same ``x-request-id`` did not
  arrive meanwhile: requests that ran while the router was down, or was killed, keep a record.

Timing: when both records of a request arrive, in either order, the stored row's ``ttft_ms`` and
``latency_ms`` are Envoy's (its clock: the first upstream body byte holding a token, the last byte sent;
envoy_config/timing.py), ``timing_source`` "envoy", and the router's own figures (taken when its event loop got to
the observing stream's messages: tens of ms late under load) stay in ``router_ttft_ms`` / ``router_latency_ms``.
Without Envoy's record (no `records_otlp_address`, or it came after the router's record left the `MAX_HELD`
window) the row keeps the router's figures, ``timing_source`` "router". The two are the same request when their
``x-request-id`` match and Envoy's record names the router's span in its traceparent (a client reusing a request id
gets no other request's timing). The router's learning (its time model) never reads any of this: it learns from
its own observation, in its own process.

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
sends, a row stays bounded (otlp_decode.py: attribute values capped as the router caps its own, at most
MAX_ATTRIBUTES attributes, the attrs JSON at MAX_ATTRS_JSON_BYTES), a request at `max_message_bytes`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from prefixroute.grpc_auth import BearerTokenInterceptor, server_credentials
from prefixroute.telemetry.http_api import ApiStats, start_http_api
from prefixroute.telemetry.otlp_decode import envoy_rows, join_envoy_timing, request_rows, timing_update
from prefixroute.telemetry.store import DEFAULT_MAX_BYTES, TelemetryStore

log = logging.getLogger(__name__)


class ReceiverStats(ApiStats):
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
        self.num_envoy_timings_joined = 0  # ...whose timing went into the router's record of the request

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
        # records carried lately (-> their row's (trace id, span id)): both bounded (MAX_HELD), oldest out.
        self._held: collections.OrderedDict[str, tuple[float, dict[str, Any]]] = collections.OrderedDict()
        self._seen: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
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
            updates: list[dict[str, Any]] = []  # Envoy's timing for router rows stored in earlier drains
            for item in reqs:
                if item is _STOP:
                    stopping = True
                    continue
                r, num_bytes = item
                with self._bytes_lock:
                    self._pending_bytes -= num_bytes
                try:
                    if isinstance(r, logs_service_pb2.ExportLogsServiceRequest):
                        updates.extend(self._hold(envoy_rows(r)))
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
            if updates:
                try:
                    self.stats.num_envoy_timings_joined += self.store.update_timing(updates)
                except Exception:
                    log.exception("failed to set Envoy's timing on %d request rows", len(updates))
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

    def _hold(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Hold Envoy's records whose router record has not come; return the timing updates of those whose has
        (stored already: module docstring)."""
        due = time.monotonic() + self.envoy_record_hold_s
        updates = []
        for row in rows:
            self.stats.num_envoy_records += 1
            rid = row["request_id"]
            key = self._seen.get(rid)
            if key is not None:  # the router's record is in already: Envoy's timing goes onto it
                if row["router_span"] in (None, key):
                    updates.append(timing_update(row, *key))
                continue
            if rid in self._held:
                continue  # Envoy sent it twice
            self._held[rid] = (due, row)
            if len(self._held) > MAX_HELD:
                self._settle_one(*self._held.popitem(last=False))
        return updates

    def _settle(self, router_rows: list[dict[str, Any]], now: float, flush: bool) -> list[dict[str, Any]]:
        """Note the request ids of the router's rows (Envoy's records of them give them their timing, then are
        dropped); return Envoy's records whose hold is over (all of them when `flush`)."""
        seen, held = self._seen, self._held
        for row in router_rows:
            rid = row.get("request_id")
            if rid:
                envoy = held.pop(rid, None)
                if envoy is not None and join_envoy_timing(row, envoy[1]):
                    self.stats.num_envoy_timings_joined += 1
                seen[rid] = (row["trace_id"], row["span_id"])
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
        self._http: ThreadingHTTPServer | None = None

    async def start(self) -> None:
        """Open the store, start the writer, bind and start the servers; sets the bound ports."""
        creds = self.tls.grpc_credentials() if self.tls is not None else None  # unreadable files: fail first
        store = TelemetryStore(self.db_path, **self._store_args)
        self.writer = StoreWriter(store, self.stats, **self._writer_args)
        interceptors = [BearerTokenInterceptor(self.auth_token, label="telemetry receiver",
                                             on_refused=self.stats.count_unauthenticated)] if self.auth_token else []
        server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", 1 << 20),  # answers are tiny
            # What a caller refused on its metadata may have sent by then is one stream window: a fixed 256 KiB
            # (BDP probing would grow it to several MiB per stream on loopback).
            ("grpc.http2.lookahead_bytes", 256 * 1024), ("grpc.http2.bdp_probe", 0)])
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
