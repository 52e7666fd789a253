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
from prefixroute.telemetry.tracecontext import parse_traceparent

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
    ttft_ms = _float(attrs.get(F["ttft_ms"]))
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
        "ttft_ms": ttft_ms,
        "latency_ms": latency_ms,
        "prompt_tokens": _int(attrs.get(F["prompt_tokens"])),
        "completion_tokens": _int(attrs.get(F["completion_tokens"])),
        "cached_tokens": _int(cached),
        "stream": None if stream is None else int(bool(stream)),
        "status": status,
        "error": error,
        "path": _str(attrs.get(F["path"])),
        "gateway_wait_ms": _float(attrs.get(F["gateway_wait_ms"])),
        "gateway_outcome": _str(attrs.get(F["gateway_outcome"])),
        "routing_ms": _float(attrs.get(F["routing_ms"])),
        "service_name": _str(resource_attrs.get("service.name")),
        "attrs": _attrs_json(resource_attrs, attrs),
        # The sender's own figures; Envoy's record may replace ttft_ms / latency_ms later (`join_envoy_timing`).
        "router_ttft_ms": ttft_ms, "router_latency_ms": latency_ms, "timing_source": "router",
    }


def envoy_log_to_row(record: LogRecord) -> dict[str, Any] | None:
    """A store row for one of Envoy's request records (envoy_config.RECORD_ATTRIBUTES), None for any other log
    record. Ids are derived from the request id (one row per request, whoever sends it twice). TTFT and latency are
    Envoy's (envoy_config/timing.py): the Responses API's first token event when stamped, else the first upstream
    body byte; latency to the last byte sent (microseconds), else Envoy's whole-millisecond ``%DURATION%``. The row
    also holds ``router_span``: the (trace id, span id) of the routing filter's traceparent, or None (not a
    column: `join_envoy_timing` matches it against the router's row)."""
    attrs = attributes_dict(record.attributes)
    if attrs.get("prefixroute.envoy_record") != "1":
        return None
    rid = _str(attrs.get("prefixroute.request_id"))
    if not rid or rid == "-":
        return None
    digest = hashlib.blake2b(rid.encode("utf-8", "replace"), digest_size=24).hexdigest()
    start = _float(attrs.get("prefixroute.start_time"))
    ttft, latency = envoy_timing_ms(attrs, start)
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
        "alternative_ttft_ms": None, "index_source": None, "decision_us": 0.0, "ttft_ms": ttft,
        "latency_ms": latency, "prompt_tokens": None, "completion_tokens": None, "cached_tokens": None,
        "stream": None, "status": status,
        "error": None if not flags or flags == "-" else f"envoy: {A.cap_str(flags)}",
        "path": _str(attrs.get("prefixroute.path")), "service_name": "envoy",
        "attrs": _attrs_json({}, {"prefixroute.route": attrs.get("prefixroute.route"), "source": "envoy"}),
        "router_ttft_ms": None, "router_latency_ms": None, "timing_source": "envoy",
        "router_span": _span_key(attrs.get("prefixroute.traceparent")),
    }


def _micros_ms(v: Any) -> float | None:
    """Envoy's ``%COMMON_DURATION(...:us)%`` (a whole number of microseconds, ``-`` when a time point is missing)
    in milliseconds."""
    us = _int(v) if isinstance(v, str) and v.isdigit() else None
    return None if us is None else us / 1000.0


def envoy_timing_ms(attrs: Mapping[str, Any], start_s: float | None) -> tuple[float | None, float | None]:
    """(TTFT ms, latency ms) of Envoy's record attributes (see `envoy_log_to_row`); None where Envoy had none (no
    response body: no TTFT). A stamped first token time before the start, or after the end, is ignored."""
    latency = _micros_ms(attrs.get("prefixroute.duration_us"))
    if latency is None:
        latency = _float(attrs.get("prefixroute.latency_ms"))
    ttft = _micros_ms(attrs.get("prefixroute.ttft_us"))
    first_us = _micros_ms(attrs.get("prefixroute.first_token_us"))
    if first_us is not None and start_s is not None:
        stamped = first_us - start_s * 1000.0  # both from Envoy's system clock (START_TIME and the Lua stamp)
        if 0.0 <= stamped and (latency is None or stamped <= latency + 1.0):
            ttft = stamped
    return ttft, latency


def _span_key(traceparent: Any) -> tuple[str, str] | None:
    tp = parse_traceparent(traceparent) if isinstance(traceparent, str) else None
    return None if tp is None else (tp.trace_id, tp.span_id)


def join_envoy_timing(router_row: dict[str, Any], envoy_row: Mapping[str, Any]) -> bool:
    """Put Envoy's TTFT and latency (and end time) of a request into the router's row of it, keeping the router's
    own in ``router_ttft_ms`` / ``router_latency_ms``; ``timing_source`` becomes "envoy". Envoy's figure wins where
    it has one; the router's stays where Envoy has none (no body: no TTFT). False (nothing changed) when the two
    are not the same request: Envoy's record names another router span (a client reused an ``x-request-id``)."""
    key = envoy_row.get("router_span")
    if key is not None and key != (router_row.get("trace_id"), router_row.get("span_id")):
        return False
    router_row.update(timing_update(envoy_row, router_row["trace_id"], router_row["span_id"], router_row))
    router_row["timing_source"] = "envoy"
    return True


def timing_update(envoy_row: Mapping[str, Any], trace_id: str, span_id: str,
                  router_row: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The columns Envoy's record sets on the router's row (store_schema.TIMING_UPDATE_SQL's parameters); with
    `router_row`, None values fall back to that row's."""
    out = {"trace_id": trace_id, "span_id": span_id, "ttft_ms": envoy_row.get("ttft_ms"),
           "latency_ms": envoy_row.get("latency_ms"), "end_time": envoy_row.get("end_time")}
    if router_row is not None:
        for k in ("ttft_ms", "latency_ms", "end_time"):
            if out[k] is None:
                out[k] = router_row.get(k)
    return out


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
