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

What arrives later than on the observing path: every fact but the first token (reported early, below) comes at
the stream's end plus the flush interval (50 ms); without the early report (its call lost, or
``facts_first_token`` end) the first token comes with them, and the time model's pending prefill of the pick then
ends at its release instead of its first token (it learns Envoy's TTFT later). The in-flight count is unaffected
(released when the routing stream closes, as before); a failover is counted at the response's end.

The early first token report (`FIRST_TOKEN_METHOD`, facts_fields.py): at a streamed response's first token the Lua
filter sends the routing filter's traceparent to the replica that routed the request, in one asynchronous gRPC unary
call (`decode_first_token`: one gRPC frame of ASCII text). `FactsReceiver.first_token` times it on the router's
clock at arrival (as the observing stream times a first chunk) and reports it (``on_first_token``), so flow control
sees the prefill end when it happens (its picks are `Pick.first_token_live` with `early_first_token`); the facts
record then reports no first token again (the record's TTFT still becomes Envoy's figure). A call that fails or
never comes changes nothing else: the record reports the first token at the stream's end, as without it. Like the
records, the call carries no secret of its own: Envoy adds the ext_proc bearer token to both (the cluster's
credential injector), and the port checks it on the call's metadata before it reads the message (`add_to_server`);
even with the token, a call must name a pending pick's span id (from the OS's CSPRNG) to change anything. Counted in
``prefixroute_facts_first_token_total{outcome}``: ``early`` (a pick took it), ``unmatched`` (no pending
facts-path streamed pick: late, unknown or forged), ``ignored`` (`early_first_token` off).

Responses ids, early (`decode_early_report`): a Responses stream's first token report also carries its response id
(its ``response.created`` event precedes any token) and Envoy's served address, and a JSON Responses answer's id
comes alone at once (`RESPONSE_ID_METHOD`); `FactsReceiver` learns it then (``on_response_id``), so a follow-up
sent the moment its previous response ended is pinned, not found by the directory's lookup fan-out. The record's
copy of the id is then not learned again. Counted in ``prefixroute_facts_early_response_id_total{outcome}``.

Bounds (`add_to_server`): an Export message of at most `MAX_EXPORT_BYTES`, an early report of at most
`MAX_EARLY_REPORT_BYTES`; a longer one is refused (RESOURCE_EXHAUSTED) before it is decoded, and a call without the
token (when one is configured) before its message is read.

Runs on the ext_proc event loop (grpc.aio), like the servicer; nothing blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2

from prefixroute.extproc.facts_fields import (A_COMPLETE, A_CONTENT_TYPE, A_DURATION_US, A_FIRST_TOKEN_US, A_FLAGS,
                                              A_RESPONSE_ID, A_ROUTING_US, A_START, A_STATUS, A_TRACEPARENT, A_TTFT_US,
                                              A_UPSTREAM, A_USAGE, CLIENT_CUT_FLAG,
                                              FACTS_MARK, FIRST_TOKEN_METHOD, MAX_USAGE_CHARS,
                                              RESPONSE_ID_METHOD)
from prefixroute.extproc.lifecycle import Pick
from prefixroute.extproc.tracking import RequestTracker
from prefixroute.grpc_auth import CallAuth, unary_after_auth
from prefixroute.telemetry.tracecontext import parse_traceparent
from prefixroute.telemetry.usage import Usage, last_usage_object

log = logging.getLogger(__name__)

OUTCOMES = ("matched", "unmatched", "missing")
FIRST_TOKEN_OUTCOMES = ("early", "unmatched", "ignored")
EARLY_ID_OUTCOMES = ("learned", "unmatched")


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
    routing_ms: float | None = None  # Envoy's routing delay (facts_fields.A_ROUTING_US)
    client_cut: bool = False  # the client closed its connection before the response ended (flag DC)


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
        response_id=response_id[:256] if response_id else None, routing_ms=_micros_ms(a.get(A_ROUTING_US)),
        client_cut=CLIENT_CUT_FLAG in (a.get(A_FLAGS) or "").split(",") and a.get(A_COMPLETE) != "1")


def facts_in(request: Any) -> Iterable[ResponseFacts]:
    """The facts records of an ExportLogsServiceRequest."""
    for rl in request.resource_logs:
        for sl in rl.scope_logs:
            for lr in sl.log_records:
                f = facts_of(lr)
                if f is not None:
                    yield f


CLIENT_CUT_ERROR = "the client closed the connection before the response ended"
"""A record's error when Envoy flagged it DC (facts_fields.CLIENT_CUT_FLAG): counted as a failed response, as a
cut observing stream's "response incomplete" is."""

EXPORT_SLICE_RECORDS = 8
"""Records applied between two yields to the event loop (`FactsReceiver.export_sliced`): ~0.2-0.4 ms of work at
64 KB prompts (a record with its pick's release), so a routing decision waits at most that long behind a batch."""
MAX_EARLY_REPORT_BYTES = 128 + 1 + 128 + 1 + 64
"""Largest early report message: a traceparent (the Lua filter sends none over 128 bytes), a response id (at most
128) and a served address (cut at 64), newline-separated."""
MAX_EXPORT_BYTES = 1024 * 1024
"""Largest facts batch (one ``ExportLogsServiceRequest``) the port decodes. Envoy's OTLP logger sends its buffer
when it passes buffer_size_bytes (16 KiB, Envoy's default, which the facts logger keeps) or at each flush interval,
and a record is at most a few KiB (usage cut at MAX_USAGE_CHARS, ids at 128): 64 times the largest batch Envoy
sends. A longer message is refused (RESOURCE_EXHAUSTED) before it is decoded."""
EXPORT_PATH = "/opentelemetry.proto.collector.logs.v1.LogsService/Export"


@dataclass(frozen=True, slots=True)
class EarlyReport:
    """An early report's message (facts_fields.py, `FIRST_TOKEN_METHOD`): the pick's span id and, for a
    Responses answer, its response id and Envoy's served address (None: not sent, or empty). A decoded message
    always has a span id; `_NO_REPORT` (none) stands for one that did not decode."""

    span_id: str | None
    response_id: str | None = None
    served: str | None = None


def decode_early_report(message: bytes) -> EarlyReport | None:
    """An early report's message: ``traceparent`` or ``traceparent\nresponse_id\nserved`` (ASCII); None when it
    is longer than `MAX_EARLY_REPORT_BYTES`, not ASCII, or its first line is no valid traceparent. A response id
    that does not start with ``resp`` (the OpenAI form, which the record's id must also have) is dropped."""
    if len(message) > MAX_EARLY_REPORT_BYTES:
        return None
    try:
        text = message.decode("ascii")
    except UnicodeDecodeError:
        return None
    first, _, rest = text.partition("\n")
    tp = parse_traceparent(first)
    if tp is None:
        return None
    rid, _, served = rest.partition("\n")
    return EarlyReport(tp.span_id, rid if rid.startswith("resp") and "\n" not in served else None, served or None)


_NO_REPORT = EarlyReport(span_id=None)
"""What an undecodable message reports: no pick, no id (counted unmatched by the receiver)."""


def decode_first_token(message: bytes) -> str | None:
    """The span id of an early report's message (`decode_early_report`); None when it is not one."""
    report = decode_early_report(message)
    return report.span_id if report is not None else None


class FactsReceiver:
    """Correlates facts with the tracker's pending picks and reports them (module docstring).
    `served(pick, address, status)`: the router's `PoolRouter.served`. `early_first_token`: take the early first
    token reports (the router's picks on the facts path are then `Pick.first_token_live`); off, they are counted
    ``ignored`` and the first token comes with the facts record."""

    def __init__(self, tracker: RequestTracker, served: Callable[[Pick, str | None, int | None], None], *,
                 early_first_token: bool = True, unary_picks: Any = None, ended_picks: Any = None) -> None:
        """`unary_picks`: exchange.FactsWaits, when Envoy may route by its ext_authz check (the router serves the HTTP
        check): each record (matched or not) closes its pick there, after `apply` reported it; its figures are on
        /metrics. `ended_picks`: the same for picks whose ext_proc routing stream ended before their record came
        (servicer.py): the record, not the stream's end, is their end, so what it brings (the first token of a
        short stream, its usage) is learned before the pick is released. None: records close nothing."""
        self.tracker = tracker
        self.served = served
        self.early_first_token = early_first_token
        self.num_matched = 0
        self.num_unmatched = 0
        self.first_token_counts = dict.fromkeys(FIRST_TOKEN_OUTCOMES, 0)
        self.early_id_counts = dict.fromkeys(EARLY_ID_OUTCOMES, 0)
        self.unary_picks = unary_picks
        self.ended_picks = ended_picks

    def counts(self) -> dict[str, int]:
        """Records per outcome (`OUTCOMES`), for ``prefixroute_response_facts_total``."""
        return {"matched": self.num_matched, "unmatched": self.num_unmatched,
                "missing": self.tracker.num_facts_missing}

    def first_token(self, span_id: str | None, now: float | None = None, response_id: str | None = None,
                    served: str | None = None) -> bool:
        """An early first token report for the pick keyed `span_id`, arrived at `now` (time.perf_counter());
        True when it was reported. At most once per pick: a repeat, like a report for a pick that is not a pending
        streamed facts-path pick, is counted unmatched. `response_id` (a Responses stream's, with Envoy's `served`
        address): learned at once (`response_id`), whether or not the first token is taken."""
        tracker = self.tracker
        st = tracker.pending.get(span_id) if span_id is not None else None
        if response_id is not None:
            self._learn_id(st, response_id, served)
        if not self.early_first_token:
            self.first_token_counts["ignored"] += 1
            return False
        pick = st.pick if st is not None else None
        if pick is None or not st.facts or st.emitted or not pick.request.stream or st.rec.ttft_ms is not None:
            self.first_token_counts["unmatched"] += 1
            return False
        ttft_s = (time.perf_counter() if now is None else now) - st.t0
        st.rec.ttft_ms = ttft_s * 1000.0  # the router's figure until the record brings Envoy's
        self.first_token_counts["early"] += 1
        if tracker.on_first_token is not None:
            tracker.on_first_token(pick, ttft_s)
        return True

    def response_id(self, span_id: str | None, response_id: str | None, served: str | None = None) -> bool:
        """An early response id report (a JSON Responses answer's id, `RESPONSE_ID_METHOD`) for the pick keyed
        `span_id`: True when the id was learned."""
        if response_id is None:
            self.early_id_counts["unmatched"] += 1
            return False
        return self._learn_id(self.tracker.pending.get(span_id) if span_id is not None else None, response_id, served)

    def _learn_id(self, st: Any, response_id: str, served: str | None) -> bool:
        """Learn `response_id` for the pending facts-path Responses pick of `st` (once: the record's copy of the id
        is then not learned again). Counted in `early_id_counts`."""
        pick = st.pick if st is not None else None
        if pick is None or not st.facts or st.emitted or pick.request.kind != "responses" or \
                pick.response_id is not None or self.tracker.on_response_id is None:
            self.early_id_counts["unmatched"] += 1
            return False
        if served is not None:
            st.served_addr = served  # Envoy's: a failover's id is the fallback's (the record's address agrees)
        if self.tracker.on_response_id(pick, response_id, st.served_addr) is False:
            # A claim that does not fit (PoolRouter.learn_response: an id held at another endpoint): refused there.
            self.early_id_counts["unmatched"] += 1
            return False
        self.early_id_counts["learned"] += 1
        return True

    def export(self, request: Any) -> None:
        for f in facts_in(request):
            self._one(f)

    async def export_sliced(self, request: Any, slice_records: int = EXPORT_SLICE_RECORDS) -> None:
        """`export`, yielding to the event loop after every `slice_records` records: a batch of a flush interval
        (50 ms: ~50 records at 1,000 req/s, each also releasing its pick behind ext_authz) would otherwise hold the
        loop ~1-2 ms at once, and every request arriving meanwhile would wait for it (the p99 at 64 KB)."""
        n = 0
        for f in facts_in(request):
            self._one(f)
            n += 1
            if n % slice_records == 0:
                await asyncio.sleep(0)

    def _one(self, f: ResponseFacts) -> None:
        try:
            self.apply(f)
        finally:
            picks = self.unary_picks
            if picks is not None:  # a unary pick (ext_authz, authz.py): its record is its end
                picks.close(f.span_id)
            ended = self.ended_picks
            if ended is not None:  # an ext_proc pick whose stream ended first (servicer.py)
                ended.close(f.span_id)

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
        if f.client_cut and rec.error is None:
            # Its status is what its headers said (a stream's 200), but the client never got all of it.
            rec.error = CLIENT_CUT_ERROR
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
        early = rec.ttft_ms is not None  # the early report came: its first token is reported already
        if ttft_ms is not None:
            rec.ttft_ms = ttft_ms
            if f.streamed and pick is not None and not early and tracker.on_first_token is not None:
                tracker.on_first_token(pick, ttft_ms / 1000.0)
        if responses and f.status == 200 and f.response_id and f.response_id.startswith("resp") and \
                tracker.on_response_id is not None and pick.response_id != f.response_id:  # early: learned
            tracker.on_response_id(pick, f.response_id, st.served_addr)  # type: ignore[arg-type]
        latency = f.latency_ms if f.latency_ms is not None else rec.latency_ms
        rec.routing_ms = f.routing_ms
        tracker.finish(st, latency if latency is not None else 0.0, f.usage, f.streamed)
        return True


class FactsLogsService:
    """OTLP ``LogsService.Export`` on the ext_proc port: Envoy's facts records. Answers at once (an empty
    response: every record accepted; a record that matches nothing is counted, not refused)."""

    def __init__(self, receiver: FactsReceiver) -> None:
        self.receiver = receiver

    async def Export(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802 (gRPC name)
        try:
            await self.receiver.export_sliced(request)
        except Exception:  # a bad record must not fail the others' batch; Envoy would only retry it
            log.exception("response facts: a record could not be applied")
        return logs_service_pb2.ExportLogsServiceResponse()


def first_token_handler(receiver: FactsReceiver, auth: CallAuth | None = None) -> grpc.GenericRpcHandler:
    """`FIRST_TOKEN_METHOD` and `RESPONSE_ID_METHOD` (unary, raw bytes in and out): `receiver.first_token` and
    `receiver.response_id`; each answers an empty message at once, whatever it found (Envoy reads no answer).
    The caller is checked (`auth`) before the message is read, and a message over `MAX_EARLY_REPORT_BYTES`
    refused (grpc_auth.unary_after_auth)."""

    async def first_token(message: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            r = decode_early_report(message) or _NO_REPORT
            receiver.first_token(r.span_id, None, r.response_id, r.served)
        except Exception:  # a report must not fail the call; the record reports the first token anyway
            log.exception("response facts: an early first token report could not be applied")
        return b""

    async def response_id(message: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            r = decode_early_report(message) or _NO_REPORT
            receiver.response_id(r.span_id, r.response_id, r.served)
        except Exception:  # the record brings the id anyway
            log.exception("response facts: an early response id report could not be applied")
        return b""

    service, _, method = FIRST_TOKEN_METHOD[1:].partition("/")
    id_service, _, id_method = RESPONSE_ID_METHOD[1:].partition("/")
    assert id_service == service  # one generic handler serves both methods
    return grpc.method_handlers_generic_handler(service, {
        method: unary_after_auth(first_token, auth=auth, max_message_bytes=MAX_EARLY_REPORT_BYTES),
        id_method: unary_after_auth(response_id, auth=auth, max_message_bytes=MAX_EARLY_REPORT_BYTES)})


def add_to_server(server: grpc.aio.Server, receiver: FactsReceiver, *, auth: CallAuth | None = None) -> None:
    """Serve `FactsLogsService` and the early first token report (`first_token_handler`) on `server` (before it
    starts), each call checked by `auth` (None: no token configured) before its message is read, and bounded
    (`MAX_EXPORT_BYTES`, `MAX_EARLY_REPORT_BYTES`) before it is decoded."""
    service, _, method = EXPORT_PATH[1:].partition("/")
    export = unary_after_auth(FactsLogsService(receiver).Export, auth=auth, max_message_bytes=MAX_EXPORT_BYTES,
                              request_deserializer=logs_service_pb2.ExportLogsServiceRequest.FromString,
                              response_serializer=logs_service_pb2.ExportLogsServiceResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {method: export}),
                                     first_token_handler(receiver, auth)))


class FactsCollector:
    """``prefixroute_response_facts_total{outcome}``, ``prefixroute_facts_first_token_total{outcome}`` and
    ``prefixroute_facts_early_response_id_total{outcome}`` for /metrics (a prometheus_client custom collector)."""

    def __init__(self, receiver: FactsReceiver) -> None:
        self.receiver = receiver

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily

        r = self.receiver
        for name, doc, counts in (
                ("prefixroute_response_facts", "Envoy's response facts records by outcome: matched (a pick took it), "
                 "unmatched (no pending pick: late or unknown), missing (a pick whose record never came)", r.counts()),
                ("prefixroute_facts_first_token", "Envoy's early first token reports by outcome: early (a pick took "
                 "it), unmatched (no pending streamed pick: late, repeated or unknown), ignored (early_first_token "
                 "off)", r.first_token_counts),
                ("prefixroute_facts_early_response_id", "Responses ids carried by Envoy's early reports, by outcome: "
                 "learned (a pending Responses pick took it before its record), unmatched (no such pick, or its id "
                 "known already)", r.early_id_counts)):
            family = CounterMetricFamily(name, doc, labels=["outcome"])
            for outcome, n in counts.items():
                family.add_metric([outcome], n)
            yield family
        ended = r.ended_picks
        if ended is not None:
            yield CounterMetricFamily("prefixroute_facts_picks_expired", "Picks whose routing stream ended and "
                                      "whose facts record never came, released after the stream's end plus 5 s "
                                      "(exchange.STREAM_END_RELEASE_AFTER_S): the record was lost",
                                      value=ended.num_expired)
        picks = r.unary_picks
        if picks is not None:
            from prometheus_client.core import GaugeMetricFamily
            yield GaugeMetricFamily("prefixroute_authz_picks_pending", "Picks made by Envoy's ext_authz check "
                                    "over HTTP (routing_processing 'authz-http') waiting for their facts record, which releases "
                                    "them", value=len(picks))
            yield CounterMetricFamily("prefixroute_authz_picks_expired", "ext_authz picks released without their "
                                      "facts record, release_after_s after their decision (the record was lost)",
                                      value=picks.num_expired)
            handoffs = CounterMetricFamily("prefixroute_authz_handoffs", "ext_authz checks handed to the ext_proc "
                                           "routing filter (the handoff route), by reason: hold (flow control would "
                                           "hold the request), parse (a large body parsed off the loop)",
                                           labels=["reason"])
            for reason, n in picks.num_handoffs.items():
                handoffs.add_metric([reason], n)
            yield handoffs
