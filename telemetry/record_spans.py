"""A `RequestRecord` as the OpenTelemetry span it is exported as: its attributes (`record_attributes`: the
GenAI and ``prefixroute.*`` keys of attributes.py, capped), its error status (`span_error`) and, for a custom
SDK exporter, the SDK's ReadableSpan (`SpanFactory`; the default exporter encodes the same attributes directly,
otlp_encode.py)."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

from prefixroute.telemetry import attributes as A
from prefixroute.telemetry.records import RequestRecord

if TYPE_CHECKING:  # the SDK is imported when a recorder with a custom exporter starts
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan

_FIELD_KEYS = tuple(A.FIELD_ATTRIBUTES.items())
_FIELD_VALUES = operator.attrgetter(*A.FIELD_ATTRIBUTES)  # the record's values of those fields, in that order


def record_attributes(rec: RequestRecord) -> dict[str, Any]:
    """The span attributes of a record (None values omitted; OTel attributes cannot be None)."""
    attrs: dict[str, Any] = {}
    for (field, key), v in zip(_FIELD_KEYS, _FIELD_VALUES(rec)):
        if v is None:
            continue
        attrs[key] = A.cap_value(tuple(v) if field == "endpoints" else v)
    attrs[A.STATUS] = rec.status
    if rec.cached_tokens is not None:
        attrs[A.CACHE_READ_INPUT_TOKENS] = rec.cached_tokens
    if len(rec.endpoints) > 1:
        attrs[A.FALLBACK_ENDPOINTS] = A.cap_value(tuple(rec.endpoints[1:]))
    op = A.operation_name(rec.path)
    if op:
        attrs[A.OPERATION_NAME] = op
    if rec.endpoint:
        host, sep, port = rec.endpoint.rpartition(":")
        if sep and port.isdigit() and len(port) <= 5:
            attrs[A.SERVER_ADDRESS] = A.cap_str(host)
            attrs[A.SERVER_PORT] = int(port)
        else:
            attrs[A.SERVER_ADDRESS] = A.cap_str(rec.endpoint)
    return attrs


def span_error(rec: RequestRecord) -> str | None:
    """The span's error status message: None unless the record is an error (a 4xx refusal is not)."""
    return A.cap_str(rec.error or f"HTTP {rec.status}") if rec.is_error else None


class SpanFactory:
    """Turns records into SDK ReadableSpans (export thread only)."""

    def __init__(self, resource: Resource) -> None:
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

    def span(self, rec: RequestRecord) -> ReadableSpan:
        api = self._api
        trace_id = int(rec.trace_id, 16)
        ctx = api.SpanContext(trace_id, int(rec.span_id, 16), is_remote=False, trace_flags=self._flags)
        parent = (api.SpanContext(trace_id, int(rec.parent_span_id, 16), is_remote=True, trace_flags=self._flags)
                  if rec.parent_span_id else None)
        start_ns = int(rec.start_time * 1e9)
        end_ns = start_ns + int((rec.latency_ms or 0.0) * 1e6)
        error = span_error(rec)
        status = self._ok if error is None else self._Status(self._error_code, error)
        return self._ReadableSpan(
            name=A.SPAN_NAME, context=ctx, parent=parent, resource=self._resource,
            attributes=record_attributes(rec), kind=api.SpanKind.SERVER, status=status,
            start_time=start_ns, end_time=end_ns, instrumentation_scope=self._scope)
