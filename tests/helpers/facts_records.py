"""Envoy's facts records as its facts logger sends them (OTLP log records, envoy_config/facts.py), for tests of the
router's receiver (envoy_facts.py) and of what those records release (authz.py)."""

from __future__ import annotations

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs

CHAT_USAGE = '"usage":{"prompt_tokens":100,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":64}}}'


def record(traceparent: str, **attrs: str) -> LogRecord:
    """A streamed chat response's record for the pick keyed by `traceparent`; `attrs` override its attributes."""
    values = {"prefixroute.facts": "1", "tp": traceparent, "status": "200", "upstream": "10.0.0.1:80",
              "ctype": "text/event-stream", "ttft_us": "12500", "duration_us": "80000", "start": "1700000000.000000",
              "first_token_us": "-", "usage": CHAT_USAGE, "response_id": "-", "routing_us": "850", **attrs}
    return LogRecord(attributes=[KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in values.items()])


def export(*records: LogRecord) -> ExportLogsServiceRequest:
    return ExportLogsServiceRequest(resource_logs=[ResourceLogs(scope_logs=[ScopeLogs(log_records=list(records))])])
