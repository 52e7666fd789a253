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
span with ~25 attributes costs two orders of magnitude more than queueing the record (figures: docs/benchmarks.md,
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
import random
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from prefixroute.telemetry import attributes as A
from prefixroute.telemetry.record_spans import SpanFactory, record_attributes, span_error
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


DEFAULT_RETRY_MAX_SPANS = 32_768
"""Spans held for re-export while the backend is unavailable: ~4 minutes of traffic at 140 requests/s
(the store's sizing rate), so a receiver restart or a short outage loses nothing."""
DEFAULT_RETRY_MAX_BYTES = 32 << 20
"""Bytes of encoded spans held for re-export (32 MiB of router memory at most): ~30,000 typical spans
(~1.1 KB each, measured), or ~1,500 spans whose every attribute is at its cap (~22 KB); the two bounds
meet at typical spans."""
DEFAULT_MAX_EXPORT_BYTES = 4 << 20
"""Largest export request sent: requests over it are split in halves (recursively). 4 MiB is gRPC's
default receive limit, which OpenTelemetry Collectors and most OTLP backends keep."""
RETRY_INITIAL_BACKOFF_S = 0.5
RETRY_MAX_BACKOFF_S = 5.0  # a live dashboard resumes within seconds of the receiver's return

# OTLP/gRPC: retry these (spec: "Failures" of the OTLP protocol); RESOURCE_EXHAUSTED is retried only with
# RetryInfo, which the gRPC message-size error never carries, so it is treated as "too large": split.
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                        grpc.StatusCode.ABORTED, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.DATA_LOSS})

# Reasons a span is lost, the `reason` label of prefixroute_telemetry_spans_dropped_total. The first
# group is counted in `num_dropped` (lost before an export answer), the second in `num_export_failed`.
DROP_BEFORE_EXPORT = ("queue_full", "disabled", "shutdown", "retry_buffer_full")
DROP_BY_EXPORT = ("rejected", "receiver_rejected", "too_large", "malformed", "export_failed")
DROP_REASONS = DROP_BEFORE_EXPORT + DROP_BY_EXPORT


class TelemetryRecorder:
    """Queue records on the request path; convert and export them as OTLP spans on a worker thread.

    `exporter`: default `RecordSpanExporter(endpoint=endpoint, timeout=timeout_s)` (the official
    OTLP/gRPC exporter + the fast encoder; None arguments mean the OTEL_* environment decides); any
    other `opentelemetry.sdk.trace.export.SpanExporter` gets SDK ReadableSpans (slower, for tests
    and custom backends; no retry buffer: such an exporter retries as it likes). `environ` defaults to
    os.environ (tests pass their own mapping). Explicit `max_queue_size` / `max_export_batch_size` /
    `schedule_delay_ms` / `export_timeout_ms` override the OTEL_BSP_* variables.

    Export (default exporter), per request of at most 64 spans:
    - OK: exported; spans the receiver rejected in its answer (OTLP partial success) are lost, counted
      (``receiver_rejected``), never retried (as the spec says).
    - UNAVAILABLE, DEADLINE_EXCEEDED (and the spec's other transient codes): the request goes to the
      retry buffer, retried with exponential backoff (0.5 s doubling to 5 s, +-20 % jitter); while the
      buffer is not empty, new spans queue behind it (order kept, no attempt per batch on a dead backend).
      The buffer holds at most `retry_max_spans` spans and `retry_max_bytes` encoded bytes; beyond
      that the oldest requests are dropped, counted (``retry_buffer_full``).
    - RESOURCE_EXHAUSTED (over the receiver's message limit), or a request over `max_export_bytes`:
      split in halves, recursively; a single span still too large is counted (``too_large``).
    - any other code (UNAUTHENTICATED, PERMISSION_DENIED, INVALID_ARGUMENT...): lost, counted
      (``rejected``): retrying cannot help. Logged once per code.
    Accounting: every record given to `record` ends in exactly one of `num_exported`, `num_dropped`,
    `num_export_failed` (per reason in `dropped_by_reason`), or is still held (`num_pending`).
    """

    def __init__(self, *, exporter: Any | None = None, environ: Mapping[str, str] | None = None,
                 service_name: str | None = None, max_queue_size: int | None = None,
                 max_export_batch_size: int | None = None, schedule_delay_ms: int | None = None,
                 export_timeout_ms: int | None = None, enabled: bool | None = None,
                 endpoint: str | None = None, timeout_s: float | None = None,
                 retry_max_spans: int = DEFAULT_RETRY_MAX_SPANS, retry_max_bytes: int = DEFAULT_RETRY_MAX_BYTES,
                 max_export_bytes: int = DEFAULT_MAX_EXPORT_BYTES) -> None:
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
        self.retry_max_spans = max(1, retry_max_spans)
        self.retry_max_bytes = max(1, retry_max_bytes)
        self.max_export_bytes = max(1024, max_export_bytes)
        self._queue: collections.deque[RequestRecord] = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._flush_deadline = float("inf")
        self.num_recorded = 0  # accepted into the queue
        self.num_exported = 0  # spans the exporter acknowledged (and the receiver did not reject)
        self.dropped_by_reason: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        # Retry buffer: encoded span bodies, one list per export request, oldest first (export thread only,
        # except the sizes, read by metrics and tests).
        self._retry: collections.deque[list[bytes]] = collections.deque()
        self._retry_spans = 0
        self._retry_bytes = 0
        self._in_hand = 0  # spans taken from the queue by the export thread and not yet accounted
        self._backoff_s = RETRY_INITIAL_BACKOFF_S
        self._next_attempt = 0.0
        self._logged_codes: set[Any] = set()
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
        self._factory = SpanFactory(resource)
        self._resource_attrs = {A.cap_str(str(k)): A.cap_value(v) for k, v in resource.attributes.items()}
        if exporter is None:
            exporter = RecordSpanExporter(endpoint=endpoint, timeout=timeout_s)
        self._exporter = exporter
        self._fast = RecordSpanExporter is not None and isinstance(exporter, RecordSpanExporter)
        self._thread = threading.Thread(target=self._run, name="prefixroute-telemetry-export", daemon=True)
        self._thread.start()

    # -- counters -------------------------------------------------------------------------------
    @property
    def num_dropped(self) -> int:
        """Spans lost before any export answer: queue full, disabled, shut down, retry buffer full."""
        d = self.dropped_by_reason
        return sum(d[r] for r in DROP_BEFORE_EXPORT)

    @property
    def num_export_failed(self) -> int:
        """Spans lost because of an export answer (rejected, too large, malformed, a failing exporter)."""
        d = self.dropped_by_reason
        return sum(d[r] for r in DROP_BY_EXPORT)

    @property
    def num_lost(self) -> int:
        return sum(self.dropped_by_reason.values())

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def retry_length(self) -> int:
        """Spans in the retry buffer."""
        return self._retry_spans

    @property
    def retry_bytes(self) -> int:
        return self._retry_bytes

    @property
    def num_pending(self) -> int:
        """Spans recorded and not yet exported or lost (queue + in the export thread's hands + retry buffer)."""
        return len(self._queue) + self._in_hand + self._retry_spans

    def _lose(self, reason: str, n: int) -> None:
        if n > 0:
            self.dropped_by_reason[reason] += n

    # -- hot path -------------------------------------------------------------------------------
    def record(self, rec: RequestRecord) -> None:
        """Queue one finished request for export. O(1), never blocks, never raises."""
        q = self._queue
        if self._stop or self._exporter is None or len(q) >= self.max_queue_size:
            reason = ("shutdown" if self._stop else "disabled" if self._exporter is None else "queue_full")
            self.dropped_by_reason[reason] += 1
            return
        q.append(rec)
        self.num_recorded += 1
        # Wake the exporter early only for a full batch; Event.set takes a lock, so not on every record.
        if len(q) == self.max_export_batch_size:
            self._wake.set()

    # -- export thread --------------------------------------------------------------------------
    def _take_batch(self) -> list[RequestRecord]:
        q, batch = self._queue, []
        try:
            for _ in range(self.max_export_batch_size):
                batch.append(q.popleft())
        except IndexError:
            pass
        self._in_hand = len(batch)
        return batch

    def _export_batch(self, batch: Sequence[RequestRecord]) -> None:
        try:
            if self._fast:
                # Several small gRPC requests rather than one big one: the protobuf parse/serialize of a
                # request runs in C holding the GIL, so its size bounds how long the event loop can wait.
                for i in range(0, len(batch), _FAST_EXPORT_CHUNK):
                    records = batch[i:i + _FAST_EXPORT_CHUNK]
                    spans = self._encode_spans(records)
                    if spans and self._retry:  # the backend is failing: queue behind the backlog, in order
                        self._buffer(spans)
                    elif spans:
                        left = self._attempt(spans)
                        for chunk in left:
                            self._buffer(chunk)
                        if left:
                            self._schedule_backoff()
                    self._in_hand -= len(records)  # now exported, lost (counted) or in the retry buffer
                return
            payload = []
            for rec in batch:
                try:
                    payload.append(self._factory.span(rec))
                except Exception:  # a malformed record (bad id) must not take the others down
                    log.exception("dropping a malformed telemetry record")
                    self._lose("malformed", 1)
            self._send_sdk(payload)
        finally:
            self._in_hand = 0

    def _send_sdk(self, payload: list[Any]) -> None:
        """Export SDK spans with a custom exporter (which retries as it likes); a failure is counted."""
        from opentelemetry.sdk.trace.export import SpanExportResult

        if not payload:
            return
        try:
            result = self._exporter.export(payload)
        except Exception:
            log.exception("span export raised")
            result = None
        if result == SpanExportResult.SUCCESS:
            self.num_exported += len(payload)
        else:
            self._lose("export_failed", len(payload))

    def _encode_spans(self, batch: Sequence[RequestRecord]) -> list[bytes]:
        spans = []
        for i, rec in enumerate(batch):
            try:
                start_ns = int(rec.start_time * 1e9)
                spans.append(encode_span(
                    trace_id=rec.trace_id, span_id=rec.span_id, parent_span_id=rec.parent_span_id,
                    name=A.SPAN_NAME, start_ns=start_ns, end_ns=start_ns + int((rec.latency_ms or 0.0) * 1e6),
                    attrs=record_attributes(rec), error=span_error(rec)))
            except Exception:
                log.exception("dropping a malformed telemetry record")
                self._lose("malformed", 1)
            if i % _YIELD_EVERY == _YIELD_EVERY - 1:
                time.sleep(0)  # hand the GIL to the event loop if it is waiting (see otlp_encode.py)
        return spans

    def _encode(self, batch: Sequence[RequestRecord]) -> tuple[EncodedBatch | None, int]:
        """The batch as one parsed export request (benchmarks and the encoder-equivalence tests)."""
        spans = self._encode_spans(batch)
        if not spans:
            return None, 0
        return EncodedBatch(encode_request(self._resource_attrs, spans), len(spans)), len(spans)

    def _attempt(self, spans: list[bytes]) -> list[list[bytes]]:
        """Send `spans` as one request (split when too large); returns the parts to retry later, in order
        (empty when every span was exported or lost and counted)."""
        request = encode_request(self._resource_attrs, spans)
        if len(request) > self.max_export_bytes and len(spans) > 1:
            return self._split(spans)
        if len(request) > self.max_export_bytes:
            self._lose("too_large", 1)
            return []
        outcome = self._exporter.send(request)
        code = outcome.code
        if code == grpc.StatusCode.OK:
            rejected = min(len(spans), max(0, outcome.rejected_spans))
            if rejected:
                self._log_once(("partial", outcome.message), "the receiver rejected %d spans: %s", rejected,
                               outcome.message)
            self._lose("receiver_rejected", rejected)
            self.num_exported += len(spans) - rejected
            self._backoff_s = RETRY_INITIAL_BACKOFF_S
            return []
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            if len(spans) > 1:
                return self._split(spans)
            self._log_once(code, "a span over the receiver's message limit was dropped: %s", outcome.message)
            self._lose("too_large", 1)
            return []
        if code in _RETRYABLE:
            self._log_once(code, "span export failed (%s: %s); retrying with backoff", code.name, outcome.message)
            return [spans]
        self._log_once(code, "span export rejected (%s: %s); these spans are dropped", code.name, outcome.message)
        self._lose("rejected", len(spans))
        return []

    def _split(self, spans: list[bytes]) -> list[list[bytes]]:
        mid = len(spans) // 2
        left = self._attempt(spans[:mid])
        if left:  # the backend became unavailable: do not try the second half now
            return left + [spans[mid:]]
        return self._attempt(spans[mid:])

    def _log_once(self, key: Any, msg: str, *args: Any) -> None:
        if key not in self._logged_codes:
            self._logged_codes.add(key)
            log.warning(msg, *args)

    def _buffer(self, spans: list[bytes], *, front: bool = False) -> None:
        """Hold a request for retry; beyond the bounds drop the oldest requests, counted."""
        size = sum(len(s) for s in spans)
        if front:
            self._retry.appendleft(spans)
        else:
            self._retry.append(spans)
        self._retry_spans += len(spans)
        self._retry_bytes += size
        while self._retry and (self._retry_spans > self.retry_max_spans or self._retry_bytes > self.retry_max_bytes):
            old = self._retry.popleft()
            self._retry_spans -= len(old)
            self._retry_bytes -= sum(len(s) for s in old)
            self._lose("retry_buffer_full", len(old))

    def _schedule_backoff(self) -> None:
        self._next_attempt = time.monotonic() + self._backoff_s * random.uniform(0.8, 1.2)
        self._backoff_s = min(RETRY_MAX_BACKOFF_S, self._backoff_s * 2)

    def _drain_retry(self) -> None:
        """Re-send held requests, oldest first, until one fails again (then back off) or none is left."""
        while self._retry and not (self._stop and self._flush_deadline_passed()):
            spans = self._retry.popleft()
            self._in_hand = len(spans)  # still pending while the attempt runs
            self._retry_spans -= len(spans)
            self._retry_bytes -= sum(len(s) for s in spans)
            try:
                left = self._attempt(spans)
            except BaseException:
                self._buffer(spans, front=True)
                raise
            finally:
                self._in_hand = 0
            if left:
                for chunk in reversed(left):
                    self._buffer(chunk, front=True)
                self._schedule_backoff()
                return

    def _wait_s(self) -> float:
        if self._retry:
            return max(0.0, min(self.schedule_delay_s, self._next_attempt - time.monotonic()))
        return self.schedule_delay_s

    def _run(self) -> None:
        while True:
            self._wake.wait(self._wait_s())
            self._wake.clear()
            stopping = self._stop
            try:
                if self._retry and (stopping or time.monotonic() >= self._next_attempt):
                    self._drain_retry()
                while self._queue and not (self._stop and self._flush_deadline_passed()):
                    self._export_batch(self._take_batch())
                    if len(self._queue) < self.max_export_batch_size and not self._stop:
                        break
                if stopping and self._retry and not self._flush_deadline_passed():
                    self._drain_retry()  # what the last batches left, once more before giving up
            except Exception:  # noqa: BLE001 - the export thread must survive any bug
                log.exception("telemetry export loop")
            if stopping:
                return

    def _flush_deadline_passed(self) -> bool:
        return time.monotonic() > self._flush_deadline

    def force_flush(self, timeout_s: float | None = None) -> bool:
        """Export everything queued or held for retry now (blocking the caller, not the worker; default
        bound OTEL_BSP_EXPORT_TIMEOUT); True when nothing is left pending."""
        deadline = time.monotonic() + (self.export_timeout_s if timeout_s is None else timeout_s)
        while self.num_pending and time.monotonic() < deadline:
            self._next_attempt = 0.0
            self._wake.set()
            time.sleep(0.005)
        return not self.num_pending

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop accepting records, export what is queued or held within `timeout_s`, then stop the exporter.

        Spans still pending at the deadline are dropped (counted, reason ``shutdown``). Idempotent.
        Afterwards every record given to `record` is in exactly one of num_exported, num_export_failed,
        num_dropped (unless the exporter ignored its shutdown).
        """
        if self._stop:
            return
        self._flush_deadline = time.monotonic() + timeout_s
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s + 0.5)
        if self._exporter is not None:
            try:
                self._exporter.shutdown()  # also aborts an export still stuck on a hung backend
            except Exception:
                log.exception("exporter shutdown failed")
        if self._thread is not None:
            self._thread.join(0.5)  # let that aborted export be counted
        left = len(self._queue)
        if left:
            self._queue.clear()
            self._lose("shutdown", left)
        if self._retry and (self._thread is None or not self._thread.is_alive()):
            self._lose("shutdown", self._retry_spans)
            self._retry.clear()
            self._retry_spans = self._retry_bytes = 0

    def stats(self) -> dict[str, Any]:
        return {"num_recorded": self.num_recorded, "num_dropped": self.num_dropped,
                "num_exported": self.num_exported, "num_export_failed": self.num_export_failed,
                "queue_length": len(self._queue), "retry_length": self._retry_spans,
                "retry_bytes": self._retry_bytes, "dropped_by_reason": dict(self.dropped_by_reason)}


