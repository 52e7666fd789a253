"""A direct protobuf encoder for the router's spans, and the OTLP exporter that sends its output.

Why: the official encoder builds a Python protobuf object per attribute; run on the export thread it
holds the GIL long enough to delay the asyncio loop that carries the token stream at high request
rates. Writing the wire format directly is much cheaper (figures: docs/benchmarks.md, `python -m
prefixroute.bench.recorder`), and the export thread yields the GIL between spans. The bytes are parsed once by
upb (C) into an ``ExportTraceServiceRequest`` and sent by `RecordSpanExporter`, a subclass of the
official OTLPSpanExporter, so endpoint/TLS/headers/compression/timeout handling and every
OTEL_EXPORTER_OTLP_* variable are the SDK's own; retries (with backoff, into a bounded buffer) and the
splitting of oversized requests are the recorder's (recorder.py), which needs each attempt's status code.

Contract: `encode_span(rec, attrs)` produces exactly the span the SDK would export for the same
ReadableSpan (verified in tests by decoding both); only OTLP field numbers from
opentelemetry/proto/trace/v1/trace.proto and common/v1/common.proto are used.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from prefixroute.telemetry import attributes as A

_MASK64 = (1 << 64) - 1
_pack_d = struct.Struct("<d").pack
_pack_q = struct.Struct("<Q").pack
_pack_i = struct.Struct("<I").pack

SPAN_KIND_SERVER = 2
STATUS_CODE_ERROR = 2
# Span.flags: 0x100 = "is_remote is known"; 0x200 = parent is remote.
_FLAG_HAS_IS_REMOTE, _FLAG_IS_REMOTE = 0x100, 0x200


def varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _ld(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field."""
    return tag + varint(len(payload)) + payload


def any_value(v: Any) -> bytes:
    """An AnyValue message body."""
    if isinstance(v, str):
        return _ld(b"\x0a", v.encode())
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, int):
        return b"\x18" + varint(v & _MASK64)
    if isinstance(v, float):
        return b"\x21" + _pack_d(v)
    if isinstance(v, (tuple, list)):
        return _ld(b"\x2a", b"".join(_ld(b"\x0a", any_value(x)) for x in v))
    if isinstance(v, bytes):
        return _ld(b"\x3a", v)
    return _ld(b"\x0a", str(v).encode())


_key_cache: dict[str, bytes] = {}


def key_value(key: str, v: Any) -> bytes:
    """A KeyValue message body."""
    k = _key_cache.get(key)
    if k is None:
        k = _key_cache[key] = _ld(b"\x0a", key.encode())
    return k + _ld(b"\x12", any_value(v))


# Encoded attributes whose values repeat across requests (policy, reason, endpoint, model, path...):
# encoding them once makes a span several times cheaper. Bounded: cleared when full.
_attr_cache: dict[tuple[bytes, str, Any], bytes] = {}
_ATTR_CACHE_MAX = 4096
_UNCACHED_KEYS = frozenset({A.REQUEST_ID, "error.type"})  # unique per request: would only churn the cache


def attributes(tag: bytes, attrs: Mapping[str, Any]) -> bytes:
    """Repeated KeyValue fields with field tag `tag`."""
    out = []
    for k, v in attrs.items():
        t = type(v)
        if (t is str or t is bool or t is tuple) and k not in _UNCACHED_KEYS:
            ck = (tag, k, v)
            enc = _attr_cache.get(ck)
            if enc is None:
                if len(_attr_cache) >= _ATTR_CACHE_MAX:
                    _attr_cache.clear()
                enc = _attr_cache[ck] = _ld(tag, key_value(k, v))
            out.append(enc)
        else:
            out.append(_ld(tag, key_value(k, v)))
    return b"".join(out)


def encode_span(*, trace_id: str, span_id: str, parent_span_id: str | None, name: str, start_ns: int, end_ns: int,
                attrs: Mapping[str, Any], error: str | None) -> bytes:
    """A Span message body (kind SERVER, sampled)."""
    parts = [b"\x0a\x10", bytes.fromhex(trace_id), b"\x12\x08", bytes.fromhex(span_id)]
    flags = _FLAG_HAS_IS_REMOTE  # as the SDK encoder writes it (trace flags are not repeated here)
    if parent_span_id:
        parts += (b"\x22\x08", bytes.fromhex(parent_span_id))
        flags |= _FLAG_IS_REMOTE
    parts += (_ld(b"\x2a", name.encode()), b"\x30\x02", b"\x39", _pack_q(start_ns), b"\x41", _pack_q(end_ns),
              attributes(b"\x4a", attrs))
    # The SDK always writes a status (empty = UNSET); so do we, so both encoders give equal messages.
    parts.append(b"\x7a\x00" if error is None else _ld(b"\x7a", _ld(b"\x12", error.encode()) + b"\x18\x02"))
    parts += (b"\x85\x01", _pack_i(flags))
    return b"".join(parts)


def encode_request(resource_attrs: Mapping[str, Any], spans: Sequence[bytes],
                   scope_name: str = A.INSTRUMENTATION_SCOPE) -> bytes:
    """An ExportTraceServiceRequest body: one resource, one scope, these span bodies."""
    scope = _ld(b"\x0a", _ld(b"\x0a", scope_name.encode())) + b"".join(_ld(b"\x12", s) for s in spans)
    resource_spans = _ld(b"\x0a", attributes(b"\x0a", resource_attrs)) + _ld(b"\x12", scope)
    return _ld(b"\x0a", resource_spans)


class EncodedBatch:
    """Spans already encoded as one ExportTraceServiceRequest (what `RecordSpanExporter` accepts)."""

    __slots__ = ("request", "num_spans")

    def __init__(self, request_bytes: bytes, num_spans: int) -> None:
        self.request = ExportTraceServiceRequest.FromString(request_bytes)  # upb: C parse, no Python per field
        self.num_spans = num_spans

    def __len__(self) -> int:
        return self.num_spans


# gRPC's reconnect backoff grows to 120 s by default: after a long receiver outage the channel would
# stay failed (every export UNAVAILABLE at once) for up to two minutes after the receiver is back.
# Capped at 5 s, spans flow again within seconds; a dead receiver costs one connect attempt per 5 s.
RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 500), ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5000))


class ExportOutcome:
    """One export attempt's answer: the gRPC status code (OK on success), spans the receiver rejected
    in an OK answer (OTLP partial success; not to be retried), and the error or rejection message."""

    __slots__ = ("code", "rejected_spans", "message")

    def __init__(self, code: grpc.StatusCode, rejected_spans: int = 0, message: str = "") -> None:
        self.code, self.rejected_spans, self.message = code, rejected_spans, message

    def __repr__(self) -> str:
        return f"ExportOutcome({self.code.name}, rejected_spans={self.rejected_spans}, {self.message!r})"


class RecordSpanExporter(OTLPSpanExporter):
    """OTLPSpanExporter (same constructor, same OTEL_* handling: endpoint, https:// / CERTIFICATE /
    CLIENT_CERTIFICATE / CLIENT_KEY for TLS and mTLS, HEADERS e.g. a bearer token, TIMEOUT, COMPRESSION,
    each also as OTEL_EXPORTER_OTLP_TRACES_*) that also takes an `EncodedBatch`, and `send`: one attempt
    whose status code the caller sees (the recorder retries and splits itself; see recorder.py)."""

    def __init__(self, *args: Any, channel_options: Sequence[tuple[str, Any]] | None = None, **kwargs: Any) -> None:
        given = {name for name, _ in channel_options or ()}
        options = tuple(channel_options or ()) + tuple(o for o in RECONNECT_OPTIONS if o[0] not in given)
        super().__init__(*args, channel_options=options, **kwargs)

    def _translate_data(self, data: Any) -> ExportTraceServiceRequest:
        if isinstance(data, EncodedBatch):
            return data.request
        return super()._translate_data(data)

    def send(self, request: ExportTraceServiceRequest | bytes) -> ExportOutcome:
        """Export once (no retry), bounded by the exporter timeout; never raises."""
        if self._shutdown or self._client is None:
            return ExportOutcome(grpc.StatusCode.CANCELLED, 0, "exporter shut down")
        if isinstance(request, bytes):
            request = ExportTraceServiceRequest.FromString(request)
        try:
            resp = self._client.Export(request=request, metadata=self._headers, timeout=self._timeout)
        except grpc.RpcError as exc:
            code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
            details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
            return ExportOutcome(code or grpc.StatusCode.UNKNOWN, 0, details or "")
        except Exception as exc:  # noqa: BLE001 - e.g. "Cannot invoke RPC on closed channel!" during shutdown
            return ExportOutcome(grpc.StatusCode.CANCELLED, 0, str(exc))
        ps = resp.partial_success
        return ExportOutcome(grpc.StatusCode.OK, int(ps.rejected_spans), ps.error_message)
