"""`RequestTracker`: one `RequestRecord` per routed request, built from the gateway's two ext_proc streams.

Envoy runs two ext_proc filters per request, both talking to this process (envoy_config.py):

1. the *routing* filter (ext_proc, blocking): its stream starts the record at request headers (arrival
   time, trace context), the routing decision fills it, and it sets ``traceparent: 00-<trace>-<router
   span>-<flags>`` on the request to the model server (router span = child of any incoming traceparent);
2. the *observing* filter (ext_proc with ``observability_mode: true``: Envoy sends and never waits, so the
   token stream is not slowed): it sees the response headers, with the request's ``traceparent`` *after*
   the routing filter's mutation (and its id and path) as attributes instead of a request headers message,
   and every response body chunk. Its stream therefore opens only when a response starts: a routed
   request that ends before any response header (client reset, upstream timeout) has no observing stream,
   and its record is emitted after `obs_grace_s` with error "response incomplete".

Correlation: the observing stream's request headers (or those attributes) carry the router's own
``traceparent``; its span id
is the key of the pending record (the routing filter always overwrites a client's traceparent, so a client
cannot pick a key). The span id comes from the OS's CSPRNG (`SpanIds`, not a seeded Mersenne Twister whose
next outputs anyone who has seen 624 of them can compute), so no one who merely reaches the ext_proc port
can guess a live request's key: a forged observing stream attaches to nothing and can report nothing for
routing (it becomes an ``unrouted`` record). Only an attached stream reports the served endpoint, at most
once per request, and `PoolRouter.served` then applies its own trust rule (service.py). An unknown key means the routing filter did not route the request (Envoy answered it
itself, e.g. 413 for a body over its buffer, or the routing service failed open): the observing stream
then records it alone (`attach_unrouted`, reason ``unrouted``, no decision), and the routing stream drops
its own undecided record so the request is counted once. Best effort for Envoy's own 413: Envoy resets
both ext_proc streams at once, usually before this service has read either, so such a request is often
not recorded at all (Envoy's stats count it).

What the observing stream measures (monotonic clock, origin = the routing stream's first message):
``ttft_ms`` at the first response body chunk, ``latency_ms`` at end of stream, status and served endpoint
from the response headers, usage from the final SSE usage event (`StreamUsageTail`) or the JSON body of
a non-stream response (`usage_from_body`, bodies kept up to MAX_BODY_BYTES).

Emission, exactly once per record (`_emit` guards it), never blocking (recorder.record is O(1)):
- routing stream closed and the observing stream saw end of stream (or closed): emit;
- routing stream closed and no observing stream can come (router answered an error itself, or the
  Envoy config has no observing filter: the routing filter's gRPC initial metadata lacks
  OBSERVED_METADATA): emit at once;
- routing stream closed, observing stream not attached yet or not finished (under load the service may
  read the observing stream after the routing stream's close; or the client reset mid-stream): emit when
  it finishes, or after `obs_grace_s` with what was seen.
When the served endpoint differs from the primary, the reason becomes ``failover``.

Responses API (``POST /v1/responses``, kind "responses"): a stream's first events (``response.created``,
``response.in_progress``, output item and content part announcements) precede any token, so its TTFT is the
first token event (``response.output_text.delta``, ``response.function_call_arguments.delta``,
``response.reasoning_text.delta`` or ``response.refusal.delta``: an ``event:`` line ending ``.delta``), found by
scanning the event lines of the chunks until it comes. The response id (``"id":"resp_..."``: the first id of
``response.created``'s response, or of the JSON body) is read from the first bytes of a 200 response (at most
`MAX_ID_SCAN_BYTES`, one ``bytes.find`` per chunk until found) and reported to the router
(``on_response_id(pick, id, served address)``: `PoolRouter.learn_response`), which pins follow-ups to the
endpoint that served it.

The facts path (``--response-path facts``, envoy_facts.py): Envoy has no observing filter; the routing stream's
OBSERVED_METADATA says ``facts`` (`Tracked.facts`), and Envoy's one record per request is applied at its end
(`finish`), or the record is emitted `obs_grace_s` after the routing stream closed with "response facts missing".

GIE's gateway configuration (gie.py) has no observing filter: its one stream carries the response too, and
`inline` attaches that same stream's state as its observation (the same calls measure it: TTFT, usage, the
Responses id). ``traceparent`` goes to the model server only when traces are exported (`propagate`) or our
observing filter needs it as the correlation key; otherwise nothing of ours reaches the server for nothing.

The servicer calls a `Tracker`: this `RequestTracker`, or `NullTracker` when telemetry is off (its calls
do nothing, so the servicer has no telemetry branches).

Single event loop, not thread-safe (like the servicer).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from prefixroute.extproc.facts_fields import OBSERVED_FACTS
from prefixroute.extproc.headers import OBSERVED_METADATA, TRACEPARENT_HEADER
from prefixroute.extproc.lifecycle import Pick
from prefixroute.extproc.wire import header_dict, header_value
from prefixroute.telemetry.records import RequestRecord, tenant_hash
from prefixroute.telemetry.tracecontext import (SAMPLED_FLAG, RouterSpanContext, child_context, format_traceparent,
                                                new_trace_id, parse_traceparent)
from prefixroute.telemetry.usage import StreamUsageTail, Usage, usage_from_body
from prefixroute.types import Decision

MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest non-stream response body kept to read its usage (a completion JSON is KBs; bigger ones, e.g.
embeddings of large batches, are not worth holding: usage stays unknown)."""
MAX_ID_SCAN_BYTES = 64 * 1024
"""Most leading bytes of a Responses response searched for its id: the id is the response object's first
field (vLLM), in its first event or the body's first bytes; 64 KiB also covers a proxy's odd chunking."""
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp[A-Za-z0-9_\-.:]{0,200})"')
_TOKEN_EVENT_SUFFIX = b".delta"
MAX_PENDING = 100_000
"""Records awaiting their streams; beyond it new requests are not tracked (bounds memory if streams leak)."""


class SpanIds:
    """Unguessable 64-bit span ids, 16 lower-case hex characters, never all zero: ``os.urandom`` read 4 KiB at a
    time (one syscall per 256 ids; a fresh read per id costs ~0.8 us, a slice of the buffer ~0.1 us)."""

    __slots__ = ("_hex", "_pos")

    _CHUNK_BYTES = 4096

    def __init__(self) -> None:
        self._hex = ""
        self._pos = 0

    def __call__(self) -> str:
        pos = self._pos
        if pos >= len(self._hex):
            self._hex = os.urandom(self._CHUNK_BYTES).hex()
            pos = 0
        self._pos = pos + 16
        span_id = self._hex[pos:pos + 16]
        return span_id if span_id != "0000000000000000" else self()


def router_context(incoming: str | bytes | None, span_ids: Callable[[], str]) -> RouterSpanContext:
    """`tracecontext.child_context` with the span id from `span_ids` (the correlation key must be unguessable)."""
    parent = parse_traceparent(incoming)
    span_id = span_ids()
    if parent is None:
        trace_id = new_trace_id()
        return RouterSpanContext(trace_id, span_id, None, SAMPLED_FLAG, format_traceparent(trace_id, span_id))
    return RouterSpanContext(parent.trace_id, span_id, parent.span_id, parent.flags,
                             format_traceparent(parent.trace_id, span_id, parent.flags))


class Tracked:
    """One request's state between its two streams (see module docstring)."""

    __slots__ = ("rec", "t0", "key", "content_length", "decided", "routing_done", "obs_attached", "obs_done",
                 "emitted", "tail", "body", "body_bytes", "served_addr", "in_grace", "pick", "served_reported",
                 "expect_obs", "id_scan", "token_events", "line_start", "facts")

    def __init__(self, rec: RequestRecord, t0: float) -> None:
        self.rec = rec
        self.t0 = t0  # time.perf_counter() at the routing stream's first message
        self.key = rec.span_id
        self.content_length = 0
        self.decided = False
        self.routing_done = False
        self.obs_attached = False
        self.obs_done = False
        self.emitted = False
        self.tail: StreamUsageTail | None = None
        self.body: list[bytes] | None = None
        self.body_bytes = 0
        self.served_addr: str | None = None
        self.in_grace = False  # waiting in the tracker's grace queue (RequestTracker._grace)
        self.pick: Pick | None = None  # the router's pick, for reporting the served endpoint from the observing stream
        self.served_reported = False
        self.expect_obs = False  # Envoy announced an observing filter for this request (gRPC initial metadata)
        self.id_scan: bytearray | None = None  # a Responses response's first bytes, until its id is found
        self.token_events = False  # a Responses stream: TTFT at its first token event, not its first chunk
        self.line_start = True  # the next chunk starts a line (the previous one ended with a newline)
        self.facts = False  # the observation comes as Envoy's facts record (envoy_facts.py), not a stream


def _untracked() -> Tracked:
    """State for a request that has no record: every tracker call on it is a no-op (it counts as emitted)."""
    st = Tracked(RequestRecord(trace_id="", span_id="", start_time=0.0), 0.0)
    st.emitted = True
    return st


UNTRACKED = _untracked()
"""Shared state of requests without a record: `NullTracker`'s, and a routing stream's before its request
headers (RequestTracker then meets it only in `routing_closed`, which returns at once). Never written to."""

GrpcMetadata = Callable[[], Iterable[tuple[str, Any]] | None]
"""A routing stream's gRPC initial metadata, read only when needed (``context.invocation_metadata``)."""


class Tracker(Protocol):
    """What the servicer calls for telemetry: `RequestTracker` or `NullTracker` (docstrings: RequestTracker)."""

    def begin(self, headers: Mapping[str, str], grpc_metadata: GrpcMetadata = tuple
              ) -> tuple[Tracked, str | None]: ...
    def decided(self, st: Tracked, pick: Pick) -> None: ...
    def refused(self, st: Tracked, status: int, message: str, wait_ms: float = 0.0,
                outcome: str | None = None) -> None: ...
    def routing_response_headers(self, st: Tracked, headers: Any, served: str | None) -> bool: ...
    def routing_closed(self, st: Tracked) -> None: ...
    def discard(self, st: Tracked) -> None: ...
    def observe(self, request_headers: Any) -> Tracked | None: ...
    def obs_response_headers(self, st: Tracked, headers: Any, end_of_stream: bool, served_header: str
                             ) -> Pick | None: ...
    def obs_body(self, st: Tracked, chunk: bytes, end_of_stream: bool) -> None: ...
    def obs_closed(self, st: Tracked) -> None: ...
    def inline(self, st: Tracked) -> Tracked | None: ...


_NOTHING_BEGUN = (UNTRACKED, None)


class NullTracker:
    """Telemetry off: no record, no traceparent; routing streams report the served endpoint themselves and
    observing streams end at once (nothing to observe)."""

    def begin(self, headers: Mapping[str, str], grpc_metadata: GrpcMetadata = tuple) -> tuple[Tracked, None]:
        return _NOTHING_BEGUN

    def decided(self, st: Tracked, pick: Pick) -> None:
        pass

    def refused(self, st: Tracked, status: int, message: str, wait_ms: float = 0.0,
                outcome: str | None = None) -> None:
        pass

    def routing_response_headers(self, st: Tracked, headers: Any, served: str | None) -> bool:
        return True

    def routing_closed(self, st: Tracked) -> None:
        pass

    def discard(self, st: Tracked) -> None:
        pass

    def observe(self, request_headers: Any) -> None:
        return None

    # Never called: `observe` gives no state to call them with.
    def obs_response_headers(self, st: Tracked, headers: Any, end_of_stream: bool, served_header: str) -> None:
        return None

    def obs_body(self, st: Tracked, chunk: bytes, end_of_stream: bool) -> None:
        pass

    def obs_closed(self, st: Tracked) -> None:
        pass

    def inline(self, st: Tracked) -> None:
        return None


NULL_TRACKER = NullTracker()


class RequestTracker:
    """Builds and emits `RequestRecord`s (see module docstring).

    `on_decision(decision, decision_us)` and `on_response(record)` are `RouterTelemetry`'s calls (must not
    raise, must not block); `endpoint_of(address)` maps an ``ip:port`` Envoy reports back to the
    endpoint id (None if unknown).
    """

    def __init__(self, on_decision: Callable[[Decision, float], None], on_response: Callable[[RequestRecord], None],
                 endpoint_of: Callable[[str], str | None], *, max_body_bytes: int | None = None,
                 obs_grace_s: float = 2.0, on_first_token: Callable[[Pick, float], None] | None = None,
                 on_usage: Callable[[Pick, int | None, int | None], None] | None = None,
                 on_response_id: Callable[[Pick, str, str | None], None] | None = None,
                 propagate: bool = True) -> None:
        """`on_first_token(pick, ttft_s)` and `on_usage(pick, prompt_tokens, cached_tokens)`: the router's
        `PoolRouter.first_token` / `usage` (its time model learns from them), called for attached streamed
        responses, from the observing stream: the first token at the first body chunk of an SSE response (a
        Responses stream: its first token event), the usage when it ends (None figures when it carried none);
        `on_usage` also for a non-streamed Responses API response (its prompt size feeds the next follow-up's
        prediction). `on_response_id(pick, id,
        served address)`: `PoolRouter.learn_response`, for an attached 200 Responses response (module
        docstring). `propagate`: traces are exported, so the model server gets the router span as its
        ``traceparent`` parent; when False (traces off) `begin` gives a traceparent only to a request whose Envoy
        has the observing filter (the header is then its correlation key), so nothing of ours reaches the server
        for nothing."""
        self.propagate = propagate
        self.max_body_bytes = max_body_bytes
        self.on_response_id = on_response_id
        self.on_first_token = on_first_token
        self.on_usage = on_usage
        self.on_decision = on_decision
        self.on_response = on_response
        self.endpoint_of = endpoint_of
        self.obs_grace_s = obs_grace_s
        self.pending: dict[str, Tracked] = {}
        self.num_emitted = 0
        self.num_untracked = 0
        self.num_unattached_observations = 0  # observing streams that named no pending request (unrouted/forged)
        self.num_facts_missing = 0  # facts-path picks whose Envoy record did not come within obs_grace_s
        self._span_ids = SpanIds()
        # Routing streams closed, observation awaited: key -> (deadline on the loop's clock, state), in deadline
        # order (one grace for all), swept by one timer. A timer per request cost a TimerHandle made and
        # cancelled per request (~3 us, scripts/profile_router_path.py).
        self._grace: dict[str, tuple[float, Tracked]] = {}
        self._grace_timer: asyncio.TimerHandle | None = None
        self._grace_loop: asyncio.AbstractEventLoop | None = None  # the loop it runs on (tests use several)

    # --- routing stream -------------------------------------------------------------------------------
    def begin(self, headers: Mapping[str, str], grpc_metadata: GrpcMetadata = tuple) -> tuple[Tracked, str]:
        """At the routing stream's request headers: (state, traceparent value for the model server, None when
        none is to be set: traces off and no observing filter, see `propagate`).
        `grpc_metadata` holds OBSERVED_METADATA when the Envoy config has the observing filter, so a routed
        request's observation is worth waiting for. Beyond MAX_PENDING records the state is untracked
        (nothing is emitted for it) but the traceparent is still given (when one is given at all)."""
        t0 = time.perf_counter()
        ctx = router_context(headers.get(TRACEPARENT_HEADER), self._span_ids)
        observed = [v for k, v in grpc_metadata() or () if k == OBSERVED_METADATA]
        expect_obs = bool(observed)
        traceparent = ctx.traceparent if self.propagate or expect_obs else None
        if len(self.pending) >= MAX_PENDING:
            self.num_untracked += 1
            st = _untracked()
            st.facts = expect_obs and observed[0] == OBSERVED_FACTS
            return st, traceparent
        path = headers.get(":path", "")
        rec = RequestRecord(trace_id=ctx.trace_id, span_id=ctx.span_id, parent_span_id=ctx.parent_span_id,
                            start_time=time.time(), request_id=headers.get("x-request-id", ""),
                            path=path.split("?", 1)[0])
        st = Tracked(rec, t0)
        st.expect_obs = expect_obs
        st.facts = expect_obs and observed[0] == OBSERVED_FACTS
        cl = headers.get("content-length")
        if cl and cl.isdigit():
            st.content_length = int(cl)
        self.pending[st.key] = st
        return st, traceparent

    def decided(self, st: Tracked, pick: Pick) -> None:
        """The router picked: copy the decision into the record and count it in the metrics."""
        st.decided = True
        st.pick = pick
        rec = st.rec
        d = pick.decision
        rec.policy = d.policy
        rec.reason = d.reason
        rec.endpoints = tuple(d.endpoints)
        rec.matched_blocks = d.matched_blocks
        rec.total_blocks = d.total_blocks
        rec.predicted_hit_ratio = d.predicted_hit_ratio
        rec.predicted_ttft_ms = d.predicted_ttft_ms
        rec.alternative_endpoint = d.alternative_endpoint
        rec.alternative_ttft_ms = d.alternative_ttft_ms
        rec.index_source = pick.index_source or None
        rec.decision_us = pick.decision_us
        if pick.flow_released_by is not None:  # held in the gateway queue, then released
            rec.gateway_wait_ms = pick.flow_wait_s * 1000.0
            rec.gateway_outcome = "released:" + pick.flow_released_by
        req = pick.request
        rec.model = req.model
        rec.stream = req.stream
        if req.tenant:
            rec.tenant_hash = tenant_hash(req.tenant)
        if req.request_id:
            rec.request_id = req.request_id
        self.on_decision(d, pick.decision_us)

    def refused(self, st: Tracked, status: int, message: str, wait_ms: float = 0.0,
                outcome: str | None = None) -> None:
        """The router answered the request itself (4xx/503): no endpoint, the error is the outcome. A request
        shed by flow control passes its gateway wait and outcome (``shed:REASON``)."""
        rec = st.rec
        rec.status = status
        rec.error = message
        rec.gateway_wait_ms = wait_ms
        rec.gateway_outcome = outcome
        rec.latency_ms = (time.perf_counter() - st.t0) * 1000.0

    def routing_response_headers(self, st: Tracked, headers: Any, served: str | None) -> bool:
        """The routing stream's response headers (`served`: SERVED_HEADER's value). True when the servicer
        should report the served endpoint to the router: once per request, from whichever stream sees the
        response headers first."""
        status = header_value(headers, ":status")
        if status and not st.rec.status:
            st.rec.status = int(status)
        if served and st.served_addr is None:
            st.served_addr = served
        if st.served_reported:
            return False
        st.served_reported = True
        return True

    def discard(self, st: Tracked) -> None:
        """Forget a state that `begin` made without a record: the request is handed to another routing stream
        (an ext_authz check handed off to the ext_proc filter, authz.py), which begins its own."""
        if not st.emitted:
            st.emitted = True
            self.pending.pop(st.key, None)

    def routing_closed(self, st: Tracked) -> None:
        if st.emitted:  # untracked
            return
        st.routing_done = True
        rec = st.rec
        if not st.decided and rec.status == 0 and rec.error is None and st.expect_obs and not st.facts:
            # Ended before any decision (Envoy answered, e.g. 413, or the client left): the observing filter
            # saw whatever reply went out and reports it as an unrouted request (`attach_unrouted`).
            st.emitted = True
            self.pending.pop(st.key, None)
            return
        if not st.decided and rec.status == 0 and rec.error is None:
            # Ended before any decision. Envoy answers 413 itself when the body outgrows its buffer (sized to
            # max_body_bytes by the gateway), before the router sees the body: its local reply reaches
            # neither stream, so the declared content-length is the evidence.
            if self.max_body_bytes is not None and st.content_length > self.max_body_bytes:
                rec.status = 413
                rec.error = "request body too large (answered by Envoy)"
            else:
                rec.error = "request ended before the routing decision"
        if not st.obs_attached and st.rec.latency_ms is None:
            # The routing stream closes when the HTTP stream ends: the best end known without an observation
            # (replaced if the observing stream still reports).
            st.rec.latency_ms = (time.perf_counter() - st.t0) * 1000.0
        # A routed request's observing stream may still be on its way (under load the service reads the new
        # stream after the routing stream's close): wait for it when Envoy has an observing filter.
        if st.obs_done or (not st.obs_attached and not (st.decided and st.expect_obs)):
            self._emit(st)
        elif not st.in_grace:
            self._wait_grace(st)

    # --- observing stream -----------------------------------------------------------------------------
    def observe(self, request_headers: Any) -> Tracked:
        """The observing stream's request headers: the routed request's state, or a record of its own (which
        carries no pick, so nothing it reports reaches the router)."""
        st = self.attach(request_headers)
        if st is not None:
            return st
        self.num_unattached_observations += 1
        return self.attach_unrouted(request_headers)

    def inline(self, st: Tracked) -> Tracked | None:
        """The routing stream itself carries the response (GIE's FULL_DUPLEX_STREAMED configuration: one stream,
        no observing filter): `st` is observed there, with the observing stream's calls (`obs_response_headers`,
        `obs_body`, `obs_closed`); None when `st` has no record (nothing to measure)."""
        if st.emitted or st.obs_attached:
            return None
        st.obs_attached = True
        return st

    def attach(self, request_headers: Any) -> Tracked | None:
        """The observing stream's request headers (after the routing filter's mutation)."""
        tp = parse_traceparent(header_value(request_headers, TRACEPARENT_HEADER))
        if tp is None:
            return None
        st = self.pending.get(tp.span_id)
        if st is None or st.obs_attached:
            return None
        st.obs_attached = True
        return st

    def attach_unrouted(self, request_headers: Any) -> Tracked:
        """An observing stream of a request the routing filter did not route (Envoy answered it, e.g. 413, or
        the routing service failed open): a record of its own, measured from this stream's start."""
        hs = header_dict(request_headers)
        ctx = child_context(hs.get(TRACEPARENT_HEADER))
        rec = RequestRecord(trace_id=ctx.trace_id, span_id=ctx.span_id, parent_span_id=ctx.parent_span_id,
                            start_time=time.time(), request_id=hs.get("x-request-id", ""),
                            path=hs.get(":path", "").split("?", 1)[0], reason="unrouted")
        st = Tracked(rec, time.perf_counter())
        st.routing_done = st.obs_attached = True
        return st

    def obs_response_headers(self, st: Tracked, headers: Any, end_of_stream: bool, served_header: str
                             ) -> Pick | None:
        """The router's pick when the servicer should report `st.served_addr` to the router for it, else
        None: the routing filter skips response headers when the observing filter is configured, so passive
        failure detection relies on this stream."""
        report = None if st.served_reported else st.pick
        if report is not None:
            st.served_reported = True
        status = header_value(headers, ":status")
        if status:
            st.rec.status = int(status)
        served = header_value(headers, served_header)
        if served:
            st.served_addr = served
        ctype = header_value(headers, "content-type") or ""
        streamed = ctype.startswith("text/event-stream")
        if streamed:
            st.tail = StreamUsageTail()
        else:
            st.body = []
        pick = st.pick
        if pick is not None and pick.request.kind == "responses":
            st.token_events = streamed
            if status == "200" and self.on_response_id is not None:
                st.id_scan = bytearray()
        if end_of_stream:
            self._obs_finished(st, time.perf_counter())
        return report

    def obs_body(self, st: Tracked, chunk: bytes, end_of_stream: bool) -> None:
        now = time.perf_counter()
        rec = st.rec
        if st.id_scan is not None and chunk:
            self._scan_id(st, chunk)
        if rec.ttft_ms is None and chunk and (not st.token_events or self._token_event(st, chunk)):
            rec.ttft_ms = (now - st.t0) * 1000.0
            if st.tail is not None and st.pick is not None and self.on_first_token is not None:
                self.on_first_token(st.pick, now - st.t0)
        if st.tail is not None:
            st.tail.feed(chunk)
        elif st.body is not None:
            st.body_bytes += len(chunk)
            if st.body_bytes <= MAX_BODY_BYTES:
                st.body.append(chunk)
            else:
                st.body = None
        if end_of_stream:
            self._obs_finished(st, now)

    def _scan_id(self, st: Tracked, chunk: bytes) -> None:
        """Look for the response id in the response's first bytes (module docstring); report it once."""
        head = st.id_scan
        assert head is not None
        start = max(0, len(head) - 300)  # a match may straddle the previous chunk's end
        head += chunk[: MAX_ID_SCAN_BYTES - len(head)]
        m = _RESPONSE_ID.search(head, start)
        if m is not None:
            st.id_scan = None
            if st.pick is not None and self.on_response_id is not None:
                self.on_response_id(st.pick, m.group(1).decode("ascii"), st.served_addr)
        elif len(head) >= MAX_ID_SCAN_BYTES:
            st.id_scan = None

    @staticmethod
    def _token_event(st: Tracked, chunk: bytes) -> bool:
        """Whether `chunk` of a Responses stream holds a token event (an ``event:`` line ending ``.delta``).
        Only lines that start a line count: a data line's JSON never holds a raw newline, so text inside it
        cannot pose as an event line."""
        first = st.line_start
        st.line_start = chunk.endswith(b"\n")
        for k, line in enumerate(chunk.split(b"\n")):
            if (k or first) and line.startswith(b"event:") and line.rstrip().endswith(_TOKEN_EVENT_SUFFIX):
                return True
        return False

    def obs_closed(self, st: Tracked) -> None:
        """The observing stream ended (EOF or cancel) without end of stream: the response was cut short, unless
        its own end had passed (`StreamUsageTail.ended`: the client closed at ``[DONE]``), which finishes it."""
        if not st.obs_done and st.tail is not None and st.tail.ended():
            self._obs_finished(st, time.perf_counter())
        elif not st.obs_done:
            st.obs_done = True
            if st.rec.error is None:
                st.rec.error = "response incomplete"
            if st.routing_done:
                self._emit(st)

    def _obs_finished(self, st: Tracked, now: float) -> None:
        if st.obs_done:
            return
        usage = None
        if st.tail is not None:
            usage = st.tail.usage()
        elif st.body:
            usage = usage_from_body(b"".join(st.body))
        streamed = st.tail is not None
        st.tail = st.body = None
        self.finish(st, (now - st.t0) * 1000.0, usage, streamed)

    def finish(self, st: Tracked, latency_ms: float, usage: Usage | None, streamed: bool) -> None:
        """The response ended (observing stream, or Envoy's facts record: envoy_facts.py): its latency and usage
        into the record, the usage to the router, and the record emitted once the routing stream has closed."""
        st.obs_done = True
        rec = st.rec
        rec.latency_ms = latency_ms
        if usage is not None:
            rec.prompt_tokens = usage.prompt_tokens
            rec.completion_tokens = usage.completion_tokens
            rec.cached_tokens = usage.cached_tokens
        pick = st.pick
        # Responses API: a non-streamed response's usage counts too (its prompt size is what the next follow-up
        # is predicted to find cached; PoolRouter learns no rate from it without a first token).
        if pick is not None and self.on_usage is not None and rec.ttft_ms is not None and (
                streamed or pick.request.kind == "responses"):
            if usage is not None:
                self.on_usage(pick, usage.prompt_tokens, usage.cached_tokens)
                known = pick.request.known_prefix_tokens
                if known is not None and usage.prompt_tokens:
                    # A pinned follow-up's prediction is completed by its previous response's usage, which may
                    # arrive after the decision (PoolRouter.usage): the record carries the completed one.
                    rec.predicted_hit_ratio = max(rec.predicted_hit_ratio, min(1.0, known / usage.prompt_tokens))
            else:
                self.on_usage(pick, None, None)
        if st.routing_done:
            self._emit(st)

    # --- emission -------------------------------------------------------------------------------------
    def _wait_grace(self, st: Tracked) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.obs_grace_s
        st.in_grace = True
        self._grace[st.key] = (deadline, st)
        if self._grace_timer is None or self._grace_loop is not loop:
            self._grace_loop = loop
            self._grace_timer = loop.call_at(deadline, self._sweep_grace)

    def _sweep_grace(self) -> None:
        """Expire the states whose grace ended (the queue's front), then sleep until the next one's end."""
        self._grace_timer = None
        grace = self._grace
        # A timer may fire a little early (uvloop counts whole milliseconds): what is due within 1 ms is
        # expired now rather than re-armed for a moment.
        loop = asyncio.get_running_loop()
        now = loop.time() + 0.001
        while grace:
            key, (deadline, st) = next(iter(grace.items()))
            if deadline > now:
                self._grace_timer = loop.call_at(deadline, self._sweep_grace)
                return
            self._grace_expired(st)  # emits it, which takes it out of the queue
            grace.pop(key, None)

    def _grace_expired(self, st: Tracked) -> None:
        """`obs_grace_s` after the routing stream closed, still unobserved: emit what was seen. The observing
        stream opens at the response headers, so a routed request that never got one was cut short."""
        rec = st.rec
        if st.facts and not st.obs_attached:
            # Envoy's facts record never came (logger down, record lost; envoy_facts.py): counted, and said.
            self.num_facts_missing += 1
            rec.error = rec.error or "response facts missing"
        elif st.decided and not st.obs_attached and rec.status == 0 and rec.error is None:
            rec.error = "response incomplete"
        self._emit(st)

    def _emit(self, st: Tracked) -> None:
        if st.emitted:
            return
        st.emitted = True
        if st.in_grace:
            st.in_grace = False
            self._grace.pop(st.key, None)
        self.pending.pop(st.key, None)
        st.pick = None
        rec = st.rec
        if st.served_addr:
            served = self.endpoint_of(st.served_addr)
            if served is not None:
                rec.endpoint = served
                if rec.endpoints and served != rec.endpoints[0]:
                    rec.reason = "failover"
        if not st.decided and rec.status >= 400 and rec.error is None:
            rec.error = f"HTTP {rec.status} answered by Envoy"
        if rec.status >= 500 and rec.error is None:
            rec.error = f"HTTP {rec.status}"
        self.num_emitted += 1
        self.on_response(rec)
