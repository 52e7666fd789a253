"""OTLP export requests decoded into rows of the request store (store_schema.py): the router's request spans
(`request_rows`: a span named ``prefixroute.route`` or carrying ``prefixroute.request_id``) and Envoy's records of
requests (`envoy_rows`: log records with ``prefixroute.envoy_record``). Pure functions, never raising on odd values
(a wrongly typed attribute becomes NULL); whatever a sender sends, a row stays bounded: attribute values are capped
as the router caps its own (attributes.py), at most MAX_ATTRIBUTES attributes, the attrs JSON at
MAX_ATTRS_JSON_BYTES.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from prefixroute.telemetry import attributes as A

_STATUS_CODE_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


def any_value(v: AnyValue, depth: int = 0) -> Any:
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
    if kind == "bool_value":
        return v.bool_value
    if kind == "int_value":
        return v.int_value
    return v.double_value


def attributes_dict(kvs: Sequence[KeyValue]) -> dict[str, Any]:
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


def span_to_row(span: Span, resource_attrs: Mapping[str, Any]) -> dict[str, Any] | None:
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


def envoy_log_to_row(record: LogRecord) -> dict[str, Any] | None:
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


def envoy_rows(req: ExportLogsServiceRequest) -> list[dict[str, Any]]:
    """Rows for Envoy's request records in an ExportLogsServiceRequest."""
    return [row for rl in req.resource_logs for sl in rl.scope_logs for lr in sl.log_records
            if (row := envoy_log_to_row(lr)) is not None]


def request_rows(req: ExportTraceServiceRequest) -> tuple[list[dict[str, Any]], int]:
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
