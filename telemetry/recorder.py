"""`TelemetryRecorder`: hand a finished request's record to OpenTelemetry without slowing the request.

Hot path (`record`, called on the ext_proc asyncio loop at response end): a length check and a
``deque.append``. Everything else happens on one daemon export thread: it wakes every
schedule delay (or as soon as a full batch is queued), encodes each record as one SERVER span
``prefixroute.route`` (the record's own trace/span ids, explicit start/end times, so the span the
model server sees as its parent is this one) and exports the batch with the official OTLP/gRPC
exporter. The encoding is written directly in protobuf wire format (otlp_encode.py) and yields the
GIL every few spans, so the export thread does not stall the event loop that carries the token
stream; a custom `exporter` (any SDK SpanExporter) gets SDK ReadableSpans instead.

Why not the SDK's tracer + BatchSpanProcessor on the hot path: creating, filling and ending an SDK
span with ~25 attributes costs two orders of magnitude more than queueing the record (figures: README,
``python -m prefixroute.bench.recorder``).

Failure behaviour (each tested):
- Exporter slow, hung or down: `record` is unaffected; the queue fills to `max_queue_size` and
  further records are dropped and counted (`num_dropped`), so memory stays bounded. Export
  attempts are bounded by the exporter timeout (OTEL_EXPORTER_OTLP[_TRACES]_TIMEOUT).
- `record` never raises and never blocks; it is safe from the asyncio loop and from other threads
  (``deque`` operations are atomic; the counters are exact when one thread records, as ext_proc does).
- `shutdown` flushes what is queued within its timeout, then drops the rest.

Configuration: the standard OpenTelemetry environment variables, read when the recorder is built:
OTEL_SDK_DISABLED (true: `record` only counts drops), OTEL_TRACES_EXPORTER (``none`` disables;
any other value means OTLP, the only exporter built in), OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT / _HEADERS / _TIMEOUT /
_COMPRESSION / _INSECURE / _CERTIFICATE (handled by the OTLP exporter itself), OTEL_SERVICE_NAME and
OTEL_RESOURCE_ATTRIBUTES (resource), OTEL_BSP_MAX_QUEUE_SIZE (2048), OTEL_BSP_MAX_EXPORT_BATCH_SIZE
(512), OTEL_BSP_SCHEDULE_DELAY (ms; default 500 here instead of the spec's 5000, so a live dashboard
lags by half a second, not five), OTEL_BSP_EXPORT_TIMEOUT (ms, 30000: the default bound of force_flush).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from prefixroute.telemetry import attributes as A
from prefixroute.telemetry.records import RequestRecord

try:
    from prefixroute.telemetry.otlp_encode import EncodedBatch, RecordSpanExporter, encode_request, encode_span
except ImportError as exc:
    # The OTLP exporter's protobuf modules can be broken by another package of the environment (xds-protos,
    # installed after opentelemetry-proto, overwrites its files). Routing must not depend on tracing: the
    # recorder then starts disabled and says why (`disabled_reason`).
    RecordSpanExporter = None  # type: ignore[assignment,misc]
    OTLP_IMPORT_ERROR: str | None = f"the OTLP exporter cannot be imported: {exc}"
else:
    OTLP_IMPORT_ERROR = None

log = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "prefixroute-router"
DEFAULT_SCHEDULE_DELAY_MS = 500
_TRUE = ("1", "true", "yes", "on")
_YIELD_EVERY = 4  # spans encoded between GIL hand-offs: short enough that the loop thread never waits long
_FAST_EXPORT_CHUNK = 64  # spans per gRPC export request (~64 KB; parsed and serialized in C under the GIL)


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(float(raw))
    except ValueError:
        log.warning("ignoring %s=%r: not a number", name, raw)
        return default
    return value if value > 0 else default


def record_attributes(rec: RequestRecord) -> dict[str, Any]:
    """The span attributes of a record (None values omitted; OTel attributes cannot be None)."""
    attrs: dict[str, Any] = {}
    for field, key in A.FIELD_ATTRIBUTES.items():
        v = getattr(rec, field)
        if v is None:
            continue
        if field == "endpoints":
            v = tuple(v)
        attrs[key] = v
    attrs[A.STATUS] = rec.status
    if rec.cached_tokens is not None:
        attrs[A.CACHE_READ_INPUT_TOKENS] = rec.cached_tokens
    if len(rec.endpoints) > 1:
        attrs[A.FALLBACK_ENDPOINTS] = tuple(rec.endpoints[1:])
    op = A.operation_name(rec.path)
    if op:
        attrs[A.OPERATION_NAME] = op
    if rec.endpoint:
        host, sep, port = rec.endpoint.rpartition(":")
        if sep and port.isdigit():
            attrs[A.SERVER_ADDRESS] = host
            attrs[A.SERVER_PORT] = int(port)
        else:
            attrs[A.SERVER_ADDRESS] = rec.endpoint
    return attrs


class _SpanFactory:
    """Turns records into SDK ReadableSpans (export thread only)."""

    def __init__(self, resource: Any) -> None:
        from opentelemetry import trace as trace_api
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace.status import Status, StatusCode

        self._api = trace_api
        self._ReadableSpan = ReadableSpan
        self._scope = InstrumentationScope(A.INSTRUMENTATION_SCOPE)
        self._resource = resource
        self._ok = Status(StatusCode.UNSET)
        self._Status = Status
        self._error_code = StatusCode.ERROR
        self._flags = trace_api.TraceFlags(trace_api.TraceFlags.SAMPLED)

    def span(self, rec: RequestRecord) -> Any:
        api = self._api
        trace_id = int(rec.trace_id, 16)
        ctx = api.SpanContext(trace_id, int(rec.span_id, 16), is_remote=False, trace_flags=self._flags)
        parent = (api.SpanContext(trace_id, int(rec.parent_span_id, 16), is_remote=True, trace_flags=self._flags)
                  if rec.parent_span_id else None)
        start_ns = int(rec.start_time * 1e9)
        end_ns = start_ns + int((rec.latency_ms or 0.0) * 1e6)
        status = (self._Status(self._error_code, rec.error or f"HTTP {rec.status}") if rec.is_error else self._ok)
        return self._ReadableSpan(
            name=A.SPAN_NAME, context=ctx, parent=parent, resource=self._resource,
            attributes=record_attributes(rec), kind=api.SpanKind.SERVER, status=status,
            start_time=start_ns, end_time=end_ns, instrumentation_scope=self._scope)


class TelemetryRecorder:
    """Queue records on the request path; convert and export them as OTLP spans on a worker thread.

    `exporter`: default `RecordSpanExporter(endpoint=endpoint, timeout=timeout_s)` (the official
    OTLP/gRPC exporter + the fast encoder; None arguments mean the OTEL_* environment decides); any
    other `opentelemetry.sdk.trace.export.SpanExporter` gets SDK ReadableSpans (slower, for tests
    and custom backends). `environ` defaults to os.environ (tests pass their own mapping).
    Explicit `max_queue_size` / `max_export_batch_size` / `schedule_delay_ms` / `export_timeout_ms`
    override the OTEL_BSP_* variables.
    """

    def __init__(self, *, exporter: Any | None = None, environ: Mapping[str, str] | None = None,
                 service_name: str | None = None, max_queue_size: int | None = None,
                 max_export_batch_size: int | None = None, schedule_delay_ms: int | None = None,
                 export_timeout_ms: int | None = None, enabled: bool | None = None,
                 endpoint: str | None = None, timeout_s: float | None = None) -> None:
        env = os.environ if environ is None else environ
        if enabled is None:
            enabled = (env.get("OTEL_SDK_DISABLED", "").strip().lower() not in _TRUE
                       and env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() != "none")
        self.disabled_reason: str | None = None
        if enabled and exporter is None and OTLP_IMPORT_ERROR is not None:
            enabled = False
            self.disabled_reason = OTLP_IMPORT_ERROR
            log.error("traces are off: %s (reinstall opentelemetry-proto, or remove xds-protos from this "
                      "environment)", OTLP_IMPORT_ERROR)
        self.enabled = enabled
        self.max_queue_size = max_queue_size or _env_int(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self.max_export_batch_size = min(max_export_batch_size or _env_int(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
                                                                           512), self.max_queue_size)
        self.schedule_delay_s = (schedule_delay_ms or _env_int(env, "OTEL_BSP_SCHEDULE_DELAY",
                                                               DEFAULT_SCHEDULE_DELAY_MS)) / 1000.0
        self.export_timeout_s = (export_timeout_ms or _env_int(env, "OTEL_BSP_EXPORT_TIMEOUT", 30000)) / 1000.0
        self._queue: collections.deque[RequestRecord] = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self.num_recorded = 0  # accepted into the queue
        self.num_dropped = 0  # refused: queue full, or recorder disabled / shut down
        self.num_exported = 0  # spans the exporter acknowledged
        self.num_export_failed = 0  # spans in batches the exporter reported failed (not retried further)
        self._exporter = None
        self._thread: threading.Thread | None = None
        if not enabled:
            return
        from opentelemetry.sdk.resources import Resource

        attrs = {}
        if not env.get("OTEL_SERVICE_NAME"):
            attrs["service.name"] = service_name or DEFAULT_SERVICE_NAME
        # Resource.create reads OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES from os.environ.
        resource = Resource.create(attrs)
        self._factory = _SpanFactory(resource)
        self._resource_attrs = dict(resource.attributes)
        if exporter is None:
            exporter = RecordSpanExporter(endpoint=endpoint, timeout=timeout_s)
        self._exporter = exporter
        self._thread = threading.Thread(target=self._run, name="prefixroute-telemetry-export", daemon=True)
        self._thread.start()

    # -- hot path -------------------------------------------------------------------------------
    def record(self, rec: RequestRecord) -> None:
        """Queue one finished request for export. O(1), never blocks, never raises."""
        q = self._queue
        if self._stop or self._exporter is None or len(q) >= self.max_queue_size:
            self.num_dropped += 1
            return
        q.append(rec)
        self.num_recorded += 1
        # Wake the exporter early only for a full batch; Event.set takes a lock, so not on every record.
        if len(q) == self.max_export_batch_size:
            self._wake.set()

    # -- export thread --------------------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        return len(self._queue)

    def _take_batch(self) -> list[RequestRecord]:
        q, batch = self._queue, []
        try:
            for _ in range(self.max_export_batch_size):
                batch.append(q.popleft())
        except IndexError:
            pass
        return batch

    def _export_batch(self, batch: Sequence[RequestRecord]) -> None:
        if RecordSpanExporter is not None and isinstance(self._exporter, RecordSpanExporter):
            # Several small gRPC requests rather than one big one: the protobuf parse/serialize of a
            # request runs in C holding the GIL, so its size bounds how long the event loop can wait.
            for i in range(0, len(batch), _FAST_EXPORT_CHUNK):
                payload, n = self._encode(batch[i:i + _FAST_EXPORT_CHUNK])
                if not self._send(payload, n):
                    # Backend down or slow: fail the rest of this batch now instead of waiting out
                    # one timeout per chunk; later batches try again.
                    self.num_export_failed += max(0, len(batch) - i - _FAST_EXPORT_CHUNK)
                    return
            return
        payload = []
        for rec in batch:
            try:
                payload.append(self._factory.span(rec))
            except Exception:  # a malformed record (bad id) must not take the others down
                log.exception("dropping a malformed telemetry record")
                self.num_export_failed += 1
        self._send(payload, len(payload))

    def _send(self, payload: Any, n: int) -> bool:
        """Export one payload of n spans; False when the exporter failed."""
        from opentelemetry.sdk.trace.export import SpanExportResult

        if not n:
            return True
        try:
            result = self._exporter.export(payload)
        except Exception:
            log.exception("span export raised")
            result = None
        if result == SpanExportResult.SUCCESS:
            self.num_exported += n
            return True
        self.num_export_failed += n
        return False

    def _encode(self, batch: Sequence[RequestRecord]) -> tuple[EncodedBatch | None, int]:
        spans = []
        for i, rec in enumerate(batch):
            try:
                start_ns = int(rec.start_time * 1e9)
                spans.append(encode_span(
                    trace_id=rec.trace_id, span_id=rec.span_id, parent_span_id=rec.parent_span_id,
                    name=A.SPAN_NAME, start_ns=start_ns, end_ns=start_ns + int((rec.latency_ms or 0.0) * 1e6),
                    attrs=record_attributes(rec),
                    error=(rec.error or f"HTTP {rec.status}") if rec.is_error else None))
            except Exception:
                log.exception("dropping a malformed telemetry record")
                self.num_export_failed += 1
            if i % _YIELD_EVERY == _YIELD_EVERY - 1:
                time.sleep(0)  # hand the GIL to the event loop if it is waiting (see otlp_encode.py)
        if not spans:
            return None, 0
        return EncodedBatch(encode_request(self._resource_attrs, spans), len(spans)), len(spans)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.schedule_delay_s)
            self._wake.clear()
            while self._queue and not (self._stop and self._flush_deadline_passed()):
                self._export_batch(self._take_batch())
                if len(self._queue) < self.max_export_batch_size and not self._stop:
                    break
            if self._stop:
                return

    def _flush_deadline_passed(self) -> bool:
        return time.monotonic() > self._flush_deadline

    def force_flush(self, timeout_s: float | None = None) -> bool:
        """Export everything queued now (blocking the caller, not the worker; default bound
        OTEL_BSP_EXPORT_TIMEOUT); True when the queue emptied."""
        deadline = time.monotonic() + (self.export_timeout_s if timeout_s is None else timeout_s)
        while self._queue and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.005)
        return not self._queue

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop accepting records, export what is queued within `timeout_s`, then stop the exporter.

        Records still queued at the deadline are dropped (counted). Idempotent. Afterwards every
        record given to `record` is in exactly one of num_exported, num_export_failed, num_dropped
        (unless the exporter ignored its shutdown).
        """
        if self._stop:
            return
        self._flush_deadline = time.monotonic() + timeout_s
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s + 0.5)
        left = len(self._queue)
        if left:
            self._queue.clear()
            self.num_dropped += left
        if self._exporter is not None:
            try:
                self._exporter.shutdown()  # also aborts an export still stuck on a hung backend
            except Exception:
                log.exception("exporter shutdown failed")
        if self._thread is not None:
            self._thread.join(0.5)  # let that aborted export be counted

    def stats(self) -> dict[str, int]:
        return {"num_recorded": self.num_recorded, "num_dropped": self.num_dropped,
                "num_exported": self.num_exported, "num_export_failed": self.num_export_failed,
                "queue_length": len(self._queue)}


def make_recorder(**kwargs: Any) -> TelemetryRecorder:
    """A recorder from the environment; never raises (a broken config logs and yields a disabled recorder)."""
    try:
        return TelemetryRecorder(**kwargs)
    except Exception:
        log.exception("telemetry disabled: could not build the OTLP exporter")
        return TelemetryRecorder(enabled=False)
