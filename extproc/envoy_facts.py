"""The facts path, the router's side: Envoy's once-per-request facts records reach the router's picks.

Envoy's facts logger (envoy_config/facts.py) sends one OTLP log record per routed request (`FACTS_ATTRIBUTES`,
facts_fields.py) to the ext_proc replica that routed it; that replica's gRPC port serves OTLP
``LogsService.Export`` beside ext_proc (`FactsLogsService`, registered by `add_to_server`). Each record:

- is decoded (`facts_of`: pure, no I/O) into `ResponseFacts`: status, served ``ip:port``, content type, TTFT and
  latency on Envoy's clock (a Responses API stream's TTFT is its first token event, stamped by the Lua filter;
  without a stamp it has none, as its first bytes precede any token), usage (the last ``"usage"`` object the Lua
  filter found, parsed with the same rules as the observing path: chat and Responses names) and the response id;
- is correlated (`FactsReceiver.apply`) with its pick by the router's span id in the record's traceparent (the
  routing filter's own ``traceparent``: the key the observing stream uses, from the OS's CSPRNG, so a forged record
  finds nothing), and reported through the tracker's and router's calls the observing stream uses: served endpoint
  (`PoolRouter.served`), first token (a streamed response's), usage, response id, then the record is completed and
  emitted (`RequestTracker.finish`);
- counts in ``prefixroute_response_facts_total{outcome}``: ``matched`` (a pick took it), ``unmatched`` (no pending
  pick has its key: a record after its pick's timeout, a request whose tracker state was dropped, a forged one;
  counted, not an error), ``missing`` (a pick whose record never came: the tracker emits it after ``obs_grace_s``,
  2 s after the routing stream closed, which is when Envoy ended the HTTP stream, with the error "response facts
  missing").

What arrives later than on the observing path: every fact comes at the stream's end plus the flush interval
(50 ms), not at the first token. The in-flight count is unaffected (released when the routing stream closes, as
before); the time model's pending prefill of a pick ends at its release instead of its first token (it learns the
same TTFT, Envoy's clock, later); a failover is counted at the response's end.

Runs on the ext_proc event loop (grpc.aio), like the servicer; nothing blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc

from prefixroute.extproc.facts_fields import (A_CONTENT_TYPE, A_DURATION_US, A_FIRST_TOKEN_US, A_RESPONSE_ID, A_START,
                                              A_STATUS, A_TRACEPARENT, A_TTFT_US, A_UPSTREAM, A_USAGE, FACTS_MARK,
                                              MAX_USAGE_CHARS)
from prefixroute.extproc.lifecycle import Pick
from prefixroute.extproc.tracking import RequestTracker
from prefixroute.telemetry.tracecontext import parse_traceparent
from prefixroute.telemetry.usage import Usage, last_usage_object

log = logging.getLogger(__name__)

OUTCOMES = ("matched", "unmatched", "missing")


@dataclass(frozen=True, slots=True)
class ResponseFacts:
    """One request's facts from Envoy's record (module docstring). None: Envoy had no such figure."""

    span_id: str
    status: int | None
    upstream: str | None
    streamed: bool
    ttft_ms: float | None
    first_token_ms: float | None  # a Responses stream's first token event, from the request's start
    latency_ms: float | None
    usage: Usage | None
    response_id: str | None


def _str_attrs(record: Any) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in record.attributes}


def _micros_ms(v: str | None) -> float | None:
    return int(v) / 1000.0 if v and v.isdigit() else None


def _value(v: str | None) -> str | None:
    """An access-log value: "-" (Envoy's "none") and empty mean absent."""
    return None if not v or v == "-" else v


def facts_of(record: Any) -> ResponseFacts | None:
    """`ResponseFacts` of an OTLP LogRecord from Envoy's facts logger; None for any other record, or one without
    a valid traceparent (nothing to correlate)."""
    a = _str_attrs(record)
    if a.get(FACTS_MARK) != "1":
        return None
    tp = parse_traceparent(_value(a.get(A_TRACEPARENT)))
    if tp is None:
        return None
    status = a.get(A_STATUS, "")
    latency = _micros_ms(a.get(A_DURATION_US))
    first_token = None
    first_us, start = _micros_ms(a.get(A_FIRST_TOKEN_US)), _value(a.get(A_START))
    if first_us is not None and start is not None:
        try:
            stamped = first_us - float(start) * 1000.0  # both Envoy's system clock
        except ValueError:
            stamped = -1.0
        if 0.0 <= stamped and (latency is None or stamped <= latency + 1.0):
            first_token = stamped
    usage_text = _value(a.get(A_USAGE))
    usage = last_usage_object(usage_text[:MAX_USAGE_CHARS].encode()) if usage_text else None
    response_id = _value(a.get(A_RESPONSE_ID))
    return ResponseFacts(
        span_id=tp.span_id, status=int(status) if status.isdigit() else None, upstream=_value(a.get(A_UPSTREAM)),
        streamed=(a.get(A_CONTENT_TYPE) or "").startswith("text/event-stream"),
        ttft_ms=_micros_ms(a.get(A_TTFT_US)), first_token_ms=first_token, latency_ms=latency, usage=usage,
        response_id=response_id[:256] if response_id else None)


def facts_in(request: Any) -> Iterable[ResponseFacts]:
    """The facts records of an ExportLogsServiceRequest."""
    for rl in request.resource_logs:
        for sl in rl.scope_logs:
            for lr in sl.log_records:
                f = facts_of(lr)
                if f is not None:
                    yield f


class FactsReceiver:
    """Correlates facts with the tracker's pending picks and reports them (module docstring).
    `served(pick, address, status)`: the router's `PoolRouter.served`."""

    def __init__(self, tracker: RequestTracker, served: Callable[[Pick, str | None, int | None], None]) -> None:
        self.tracker = tracker
        self.served = served
        self.num_matched = 0
        self.num_unmatched = 0

    def counts(self) -> dict[str, int]:
        """Records per outcome (`OUTCOMES`), for ``prefixroute_response_facts_total``."""
        return {"matched": self.num_matched, "unmatched": self.num_unmatched,
                "missing": self.tracker.num_facts_missing}

    def export(self, request: Any) -> None:
        for f in facts_in(request):
            self.apply(f)

    def apply(self, f: ResponseFacts) -> bool:
        """Report `f` for its pick; False (counted unmatched) when no pending facts-path pick has its key."""
        tracker = self.tracker
        st = tracker.pending.get(f.span_id)
        if st is None or not st.facts or st.obs_attached or st.emitted:
            self.num_unmatched += 1
            return False
        self.num_matched += 1
        st.obs_attached = True
        rec = st.rec
        if f.status is not None:
            rec.status = f.status
        if f.upstream is not None:
            st.served_addr = f.upstream
        pick = st.pick
        if pick is not None and not st.served_reported:
            st.served_reported = True
            self.served(pick, st.served_addr, f.status)
        responses = pick is not None and pick.request.kind == "responses"
        # A Responses stream's first bytes precede any token: its TTFT is the stamped first token event, or none.
        ttft_ms = f.first_token_ms if f.first_token_ms is not None else (
            None if responses and f.streamed else f.ttft_ms)
        if ttft_ms is not None:
            rec.ttft_ms = ttft_ms
            if f.streamed and pick is not None and tracker.on_first_token is not None:
                tracker.on_first_token(pick, ttft_ms / 1000.0)
        if responses and f.status == 200 and f.response_id and f.response_id.startswith("resp") and \
                tracker.on_response_id is not None:
            tracker.on_response_id(pick, f.response_id, st.served_addr)  # type: ignore[arg-type]
        latency = f.latency_ms if f.latency_ms is not None else rec.latency_ms
        tracker.finish(st, latency if latency is not None else 0.0, f.usage, f.streamed)
        return True


class FactsLogsService(logs_service_pb2_grpc.LogsServiceServicer):
    """OTLP ``LogsService.Export`` on the ext_proc port: Envoy's facts records. Answers at once (an empty
    response: every record accepted; a record that matches nothing is counted, not refused)."""

    def __init__(self, receiver: FactsReceiver) -> None:
        self.receiver = receiver

    async def Export(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802 (gRPC name)
        try:
            self.receiver.export(request)
        except Exception:  # a bad record must not fail the others' batch; Envoy would only retry it
            log.exception("response facts: a record could not be applied")
        return logs_service_pb2.ExportLogsServiceResponse()


def add_to_server(server: grpc.aio.Server, receiver: FactsReceiver) -> None:
    """Serve `FactsLogsService` on `server` (before it starts)."""
    logs_service_pb2_grpc.add_LogsServiceServicer_to_server(FactsLogsService(receiver), server)


class FactsCollector:
    """``prefixroute_response_facts_total{outcome}`` for /metrics (a prometheus_client custom collector)."""

    def __init__(self, receiver: FactsReceiver) -> None:
        self.receiver = receiver

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily("prefixroute_response_facts", "Envoy's response facts records by outcome: "
                                     "matched (a pick took it), unmatched (no pending pick: late or unknown), "
                                     "missing (a pick whose record never came)", labels=["outcome"])
        for outcome, n in self.receiver.counts().items():
            family.add_metric([outcome], n)
        yield family
