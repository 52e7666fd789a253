"""The ext_proc gRPC servicer: a thin translation between Envoy's ProcessingRequest stream and a
`RouterService` (which knows nothing of gRPC).

One routing gRPC stream per HTTP request (plus one observing stream when telemetry is on, below). Routing
stream message flow (processing mode set in envoy_config.py):

1. request headers: if the request has no body (end_of_stream, e.g. ``GET /v1/models``) decide now and
   answer with the routing headers; otherwise answer CONTINUE at once (Envoy then sends the body).
2. request body (BUFFERED, whole body): `RouterService.route` -> header mutation setting
   ``x-gateway-destination-endpoint`` (primary) and the fallback headers, dynamic metadata
   ``envoy.lb/x-gateway-destination-endpoint`` with the same value as the header, and
   ``clear_route_cache: true`` so the route is chosen again with the header. An `OpenAIError` becomes an
   ImmediateResponse with its status, JSON body, ``content-type: application/json`` and ``retry-after``
   when it carries one.
3. response headers: ``x-gateway-destination-endpoint-served`` tells which endpoint served; when it
   differs from the primary the router service reports a failover (`PoolRouter.served`: counted only for
   a fallback of this pick, once, and confirmed by the pool's own probe before anything is marked down:
   a stream on this port may be forged). With the observing filter (below) these come on the observing
   stream instead (Envoy does not wait), and the routing filter skips them.
4. stream end: `RouterService.release` runs exactly once for a pick, in ``finally``. Envoy keeps the
   gRPC stream open until the HTTP stream is destroyed (response complete, reset, or client gone), even
   when no further messages are expected: checked with Envoy 1.40, a 1 s SSE response released its pick
   at 1.006 s, with response headers SEND and with SKIP. So release = "the response ended or failed".

Hot path: responses are pre-built protobuf messages, cached per endpoint list (few distinct lists exist:
at most N x (N-1) x ... for N endpoints); nothing is logged per request.

Telemetry (a `Tracker`, tracking.py: `RequestTracker`, or `NullTracker` when it is off): the routing
stream starts each request's record and adds ``traceparent`` (the router's span) to the routing header
mutation; a second stream, from Envoy's observing ext_proc filter (``observability_mode``: every message
has ``observability_mode`` set, nothing is answered), reports response headers (with the request's
traceparent, id and path as attributes: no request headers message) and body chunks for TTFT, latency and
usage. An observing stream reaches the router only through the pick whose unguessable span id
its traceparent carries (tracking.py); any other is telemetry at most. Both streams are served by `Process`; the first message's ``observability_mode`` flag
tells them apart. Each stream's messages are dispatched per kind (``WhichOneof("request")``) to a handler.

On the facts path (envoy_facts.py) Envoy has no observing filter: the response's facts come once per request as an
OTLP log record to this same port's ``LogsService.Export``, served beside ext_proc (server.py `add_services`).

Messages are prefixroute's own ext_proc classes (wire.py: upb protobuf, private descriptor pool).

Two protocols, chosen per routing stream (`PROTOCOLS`, ``--protocol``): the flow above is prefixroute's own
(our Envoy configuration, envoy_config.py); a stream whose first message says its filter sends request bodies
FULL_DUPLEX_STREAMED (``protocol_config``: GIE's reference Envoy and the gateways that follow the Gateway API
Inference Extension's endpoint picker protocol) is served by `gie.GieStream` instead, with the same router and
tracker. The check is one field read on the first message; our own streams cost what they did.

Responses API follow-ups whose response id the router does not know: `RouterService.route` raises
`NeedsLookup`; the routing stream then awaits ``router.resolve(id, headers)`` (a bounded fan-out to the
endpoints, responses.py) and decides again, or answers the lookup's 404/503. Only such a request awaits; the
common path stays one synchronous call.

Async safety: all calls happen on the event loop thread; the RouterService needs no locks.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from prefixroute.extproc import wire
from prefixroute.extproc.answers import MAX_CACHED_ANSWERS, header_option, immediate_response, with_traceparent
from prefixroute.extproc.exchange import (WAIT_HOLD, WAIT_PARSE, Exchange, Outcome, Refused, Routed,  # noqa: F401
                                          RouterService, Wait)
from prefixroute.extproc.gie import GieResponses, GieStream
from prefixroute.extproc.headers import (DESTINATION_HEADER, EXT_PROC_ATTRIBUTES_KEY, LB_METADATA_NAMESPACE,
                                         MAX_FALLBACKS, OBSERVE_ATTRIBUTES, REFUSED_HEADER, REPLICA_HEADER,
                                         SERVED_HEADER, fallback_header)
from prefixroute.extproc.tracking import NULL_TRACKER, Tracked, Tracker


_NO_KW: dict[str, Any] = {}


_CONTINUE_REQUEST_HEADERS = wire.ProcessingResponse(request_headers=wire.HeadersResponse())
_CONTINUE_RESPONSE_HEADERS = wire.ProcessingResponse(response_headers=wire.HeadersResponse())
_CONTINUE_REQUEST_BODY = wire.ProcessingResponse(request_body=wire.BodyResponse())
_CONTINUE_REQUEST_TRAILERS = wire.ProcessingResponse(request_trailers=wire.TrailersResponse())
_CONTINUE_RESPONSE_TRAILERS = wire.ProcessingResponse(response_trailers=wire.TrailersResponse())
_CONTINUE_RESPONSE_BODY = wire.ProcessingResponse(response_body=wire.BodyResponse())

log = logging.getLogger(__name__)
_warned_partial_body: list[bool] = []


def _warn_partial_body() -> None:
    """Once per process: a stream in prefixroute's own protocol sent a request body without end_of_stream. Our
    configuration sends bodies whole (BUFFERED: without end_of_stream only when request trailers follow, which
    OpenAI clients never send), so the gateway most likely streams bodies in chunks and the decision, made on
    the first chunk, fails (400 "not valid JSON"). Said in the log, since the client sees only that 400."""
    if not _warned_partial_body:
        _warned_partial_body.append(True)
        log.warning("a routing stream sent a request body in chunks (end_of_stream false) without saying its body "
                    "mode (no protocol_config): a gateway that streams bodies (the Gateway API Inference "
                    "Extension's FULL_DUPLEX_STREAMED) needs --protocol gie; decisions on a partial body fail")


HOLD_MARGIN_S = 2.0
"""Envoy waits a held request's deadline plus this for its answer: the shed answer itself must get through."""
PARSE_EXTENSION_S = 5.0
"""Envoy waits this long for the answer to a body parsed in a worker (parse_offload.py), instead of its message
timeout: on a loaded host a large body's parse can pass 0.5 s, and Envoy would then fail the request open (sent,
unvetted, to an endpoint: a body of 200,000 messages reached a server instead of getting its 400). The worker's
own queue bound (MAX_WAIT_S) and the parse budgets keep the real wait far below this. Where Envoy allows no
extension (extproc_max_hold_s 0, or a gateway of another project) the message is ignored: the former behaviour."""



def _parse_extension() -> Any:
    msg = wire.ProcessingResponse()
    msg.override_message_timeout.FromMilliseconds(int(PARSE_EXTENSION_S * 1000))
    return msg



PROTOCOLS = ("auto", "prefixroute", "gie")
"""Routing stream protocols: "prefixroute" (our own Envoy configuration: request body BUFFERED, an observing
filter), "gie" (the Gateway API Inference Extension's: FULL_DUPLEX_STREAMED bodies on one stream, gie.py), or
"auto": GIE when the stream's first message says its filter sends request bodies FULL_DUPLEX_STREAMED
(``protocol_config``, which Envoy puts on every stream's first message), else prefixroute (also when it carries
no ``protocol_config``: a client that streams bodies without saying so needs "gie")."""
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # RoutingSettings.max_body_bytes's default


_header = header_option


class ResponseCache:
    """Pre-built routing responses, keyed by (endpoint list, phase). Phase: True = headers, False = body."""

    def __init__(self, replica_index: int | None = None) -> None:
        """`replica_index`: this process's index among the gateway's ext_proc replicas (None: the only one); every
        routing response then also sets `REPLICA_HEADER` to it (Envoy's route sends the observing stream here)."""
        self._cache: dict[tuple[tuple[str, ...], bool], Any] = {}
        self._replica = str(replica_index) if replica_index is not None else None

    def routing_response(self, endpoints: tuple[str, ...], at_headers: bool) -> Any:
        key = (endpoints, at_headers)
        resp = self._cache.get(key)
        if resp is None:
            if len(self._cache) >= MAX_CACHED_ANSWERS:
                self._cache.clear()
            resp = self._cache[key] = self._build(endpoints, at_headers)
        return resp

    def _build(self, endpoints: tuple[str, ...], at_headers: bool) -> Any:
        primary = endpoints[0]
        headers = [_header(DESTINATION_HEADER, primary)]
        # Every fallback header is always set (padded with the last endpoint): an ORIGINAL_DST sub-cluster
        # without its header would connect to the listener's own address (Envoy itself).
        for k in range(1, MAX_FALLBACKS + 1):
            headers.append(_header(fallback_header(k), endpoints[min(k, len(endpoints) - 1)]))
        if self._replica is not None:
            headers.append(_header(REPLICA_HEADER, self._replica))
        common = wire.CommonResponse(header_mutation=wire.HeaderMutation(set_headers=headers), clear_route_cache=True)
        md = wire.Struct()
        # GIE protocol: metadata envoy.lb / x-gateway-destination-endpoint with the same value as the header
        # (header and metadata must not disagree; the header holds one address because ORIGINAL_DST takes one).
        md.get_or_create_struct(LB_METADATA_NAMESPACE)[DESTINATION_HEADER] = primary
        if at_headers:
            return wire.ProcessingResponse(request_headers=wire.HeadersResponse(response=common), dynamic_metadata=md)
        return wire.ProcessingResponse(request_body=wire.BodyResponse(response=common), dynamic_metadata=md)


class RoutingStream:
    """The ext_proc routing stream as a transport: each handler turns one ProcessingRequest kind into calls of the
    request's `Exchange`, and its outcome into the answer (`answer`; a `Wait` is returned as it is, for `Process`
    to resume)."""

    __slots__ = ("ex", "responses", "grpc_metadata", "at_headers")

    def __init__(self, servicer: ExtProcServicer, grpc_metadata: Callable[[], Any]) -> None:
        self.ex = Exchange(servicer.router, servicer.tracker, can_hold=servicer.can_hold,
                           first_token_live=servicer.facts_first_token_live)
        self.responses = servicer.responses
        self.grpc_metadata = grpc_metadata
        self.at_headers = False  # decided at the request headers (a request without a body)

    def request_headers(self, req: Any) -> Any:
        rh = req.request_headers
        headers = wire.header_dict(rh.headers.headers)
        ex = self.ex
        ex.begin(headers, self.grpc_metadata)
        if rh.end_of_stream:
            self.at_headers = True
            return self.answer(ex.decide(headers.get(":method", "GET"), headers.get(":path", "/"), b""))
        return _CONTINUE_REQUEST_HEADERS

    def request_body(self, req: Any) -> Any:
        ex = self.ex
        if ex.pick is not None:  # already decided (does not happen with BUFFERED)
            return _CONTINUE_REQUEST_BODY
        headers = ex.headers
        rb = req.request_body
        if not rb.end_of_stream:  # BUFFERED sends a whole body; this is likely a chunk (see _warn_partial_body)
            _warn_partial_body()
        return self.answer(ex.decide(headers.get(":method", "POST"), headers.get(":path", "/"), rb.body))

    def response_headers(self, req: Any) -> Any:
        if self.ex.pick is not None:
            hs = req.response_headers.headers.headers
            self.ex.served(wire.header_value(hs, SERVED_HEADER), hs, wire.header_value(hs, ":status"))
        return _CONTINUE_RESPONSE_HEADERS

    def answer(self, out: Outcome) -> Any:
        """The ext_proc answer of an outcome: the pre-built routing answer (with the request's traceparent), the
        refusal's ImmediateResponse, or the `Wait` itself."""
        cls = out.__class__
        if cls is Routed:
            resp = self.responses.routing_response(out.pick.endpoints, self.at_headers)  # type: ignore[union-attr]
            traceparent = self.ex.traceparent
            return resp if traceparent is None else with_traceparent(resp, self.at_headers, traceparent)
        if cls is Refused:
            return immediate_response(out.error)  # type: ignore[union-attr]
        return out

    def extend_timeout(self) -> Any:
        """The message that asks Envoy to wait for a held request's answer (its deadline and a margin)."""
        msg = wire.ProcessingResponse()
        msg.override_message_timeout.FromMilliseconds(
            int((self.ex.router.hold_deadline_s(self.ex.headers) + HOLD_MARGIN_S) * 1000))
        return msg


_ROUTING_HANDLERS: dict[str | None, Callable[[RoutingStream, Any], Any]] = {
    "request_headers": RoutingStream.request_headers,
    "request_body": RoutingStream.request_body,
    "response_headers": RoutingStream.response_headers,
    "request_trailers": lambda stream, req: _CONTINUE_REQUEST_TRAILERS,
    "response_trailers": lambda stream, req: _CONTINUE_RESPONSE_TRAILERS,
    "response_body": lambda stream, req: _CONTINUE_RESPONSE_BODY,
}
"""Routing stream: message kind -> handler returning the answer. A kind not listed gets no answer."""


def attribute_headers(req: Any) -> list[Any]:
    """The request headers an observing stream's first message carries as attributes (`OBSERVE_ATTRIBUTES`),
    as HeaderValues; empty when it carries none (an Envoy config without them, or Envoy's own reply)."""
    attrs = req.attributes
    if EXT_PROC_ATTRIBUTES_KEY not in attrs:  # `in` first: indexing a message map would insert the key
        return []
    fields = attrs[EXT_PROC_ATTRIBUTES_KEY].fields
    out = []
    for attr, header in OBSERVE_ATTRIBUTES.items():
        if attr in fields:
            value = fields[attr].string_value
            if value:
                out.append(wire.HeaderValue(key=header, value=value))
    return out


def _observe_response_headers(servicer: ExtProcServicer, st: Tracked, req: Any) -> bool:
    rh = req.response_headers
    pick = servicer.tracker.obs_response_headers(st, rh.headers.headers, rh.end_of_stream, SERVED_HEADER)
    if pick is not None:  # passive failure detection from here when the routing filter skips response headers
        servicer.router.served(pick, st.served_addr, st.rec.status or None)
    return rh.end_of_stream


def _observe_response_body(servicer: ExtProcServicer, st: Tracked, req: Any) -> bool:
    rb = req.response_body
    servicer.tracker.obs_body(st, rb.body, rb.end_of_stream)
    return rb.end_of_stream


_OBSERVING_HANDLERS: dict[str | None, Callable[[ExtProcServicer, Tracked, Any], bool]] = {
    "response_headers": _observe_response_headers,
    "response_body": _observe_response_body,
}
"""Observing stream: message kind -> handler, True once the response is complete. Nothing is answered."""


class ExtProcServicer:
    """Envoy ext_proc `Process` stream -> RouterService calls. See module docstring for the flow.
    Serve it with `wire.add_to_server(server, servicer.Process)`."""

    def __init__(self, router: RouterService, tracker: Tracker = NULL_TRACKER, *,
                 replica_index: int | None = None, protocol: str = "auto", gie_fallback_list: bool = False,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, can_hold: bool = False,
                 facts_first_token_live: bool = True, ended_picks: Any = None) -> None:
        """`replica_index`: see `ResponseCache` (one of several replicas behind one Envoy). `protocol`: which
        protocol each routing stream speaks (PROTOCOLS: "auto" reads it from the stream's first message).
        `gie_fallback_list`, `max_body_bytes`: GIE streams' destination list and body limit (gie.py).
        `can_hold`: the router holds requests past saturation (flow control; our own protocol's streams only:
        GIE streams are routed at once). `facts_first_token_live`: a streamed pick on the facts path reports its
        first token when it happens (Envoy's early report, envoy_facts.py), not only at its end. `ended_picks`
        (exchange.FactsWaits, the facts receiver's): where a pick on the facts path waits for its facts record when
        its stream ends first (a short response: the record, sent after the stream's end, carries its first token
        and usage, which the time model learns only from a pick not yet released); None: released at the end."""
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}; got {protocol!r}")
        self.router = router
        self.tracker = tracker
        self.responses = ResponseCache(replica_index)
        self.gie_responses = GieResponses(gie_fallback_list)
        self.max_body_bytes = max_body_bytes
        self._gie_always = protocol == "gie"
        self._gie_auto = protocol == "auto"
        self.can_hold = can_hold
        self.facts_first_token_live = facts_first_token_live
        self.ended_picks = ended_picks

    async def Process(self, request_iterator: AsyncIterator[Any],  # noqa: N802 - gRPC name
                      context: grpc.aio.ServicerContext) -> None:
        # read()/write() instead of an async generator: fewer coroutine hops per message (measured faster).
        read = context.read
        write = context.write
        eof = grpc.aio.EOF
        req = await read()
        if req is eof:
            return
        if req.observability_mode:
            await self._observe(req, read, eof)
            return
        if self._gie_always or (self._gie_auto and req.protocol_config.request_body_mode == wire.FULL_DUPLEX_STREAMED):
            pc = req.protocol_config
            full_duplex = pc.response_body_mode == wire.FULL_DUPLEX_STREAMED if req.HasField("protocol_config") else True
            await GieStream(self.router, self.tracker, self.gie_responses, context.invocation_metadata,
                            self.max_body_bytes, full_duplex).run(req, read, write, eof)
            return
        stream = RoutingStream(self, context.invocation_metadata)
        ex = stream.ex
        handlers = _ROUTING_HANDLERS
        try:
            while req is not eof:
                handler = handlers.get(req.WhichOneof("request"))
                if handler is not None:
                    resp = handler(stream, req)
                    while resp.__class__ is Wait:
                        if resp is WAIT_PARSE:  # parsed off the loop: may pass Envoy's timeout
                            await write(_parse_extension())
                        elif resp is WAIT_HOLD:
                            await write(stream.extend_timeout())
                        resp = stream.answer(await ex.resume(resp))
                    await write(resp)
                req = await read()
        finally:
            ex.end(self.ended_picks)

    async def _observe(self, first: Any, read: Any, eof: Any) -> None:
        """An observing stream (observability mode): read everything, answer nothing.

        The gateway's observing filter skips request headers: its stream starts at the response headers, whose
        attributes carry the request's traceparent, id and path (`attribute_headers`). The router's own
        refusal (REFUSED_HEADER, already recorded by its routing stream) is skipped; a stream without the
        router's traceparent (Envoy's own reply, or a request the routing filter failed open on) is recorded
        as unrouted, its first message included. A stream that starts at request headers (a filter configured
        to send them) is attached by those."""
        kind = first.WhichOneof("request")
        pending = None
        if kind == "request_headers":
            st = self.tracker.observe(first.request_headers.headers.headers)
        else:
            if kind == "response_headers" and wire.header_value(first.response_headers.headers.headers, REFUSED_HEADER):
                return
            st = self.tracker.observe(attribute_headers(first))
            pending = first
        if st is None:
            return  # telemetry off: nothing to measure
        handlers = _OBSERVING_HANDLERS
        # Returning ends the RPC at once. Envoy would otherwise keep the stream open for deferred_close_timeout
        # after the HTTP stream ends, and streams held that long pile up against the cluster's limits.
        try:
            while True:
                if pending is not None:
                    req, pending = pending, None
                else:
                    req = await read()
                if req is eof:
                    return
                handler = handlers.get(req.WhichOneof("request"))
                if handler is not None and handler(self, st, req):
                    return
        finally:
            self.tracker.obs_closed(st)
