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
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

import grpc

from prefixroute.extproc import wire
from prefixroute.extproc.answers import header_option, immediate_response, lookup_changed, with_traceparent  # noqa: F401
from prefixroute.extproc.gie import GieResponses, GieStream
from prefixroute.extproc.headers import (DESTINATION_HEADER, EXT_PROC_ATTRIBUTES_KEY, LB_METADATA_NAMESPACE,
                                         MAX_FALLBACKS, OBSERVE_ATTRIBUTES, REFUSED_HEADER, REPLICA_HEADER,
                                         SERVED_HEADER, fallback_header)
from prefixroute.extproc.lifecycle import Pick
from prefixroute.extproc.flow.control import NeedsHold, gateway_outcome
from prefixroute.extproc.response_directory import NeedsLookup
from prefixroute.extproc.tracking import NULL_TRACKER, UNTRACKED, Tracked, Tracker
from prefixroute.openai_errors import OpenAIError


_NO_KW: dict[str, Any] = {}


class RouterService(Protocol):
    """What the servicer needs from the router (implemented in service.py)."""

    def route(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Pick:
        """Choose endpoints and count the pick as in flight. Raises `OpenAIError` to refuse. (The check over
        HTTP also passes ``on_endpoints``, as `service.PoolRouter.route` takes it.)"""

    def served(self, pick: Pick, served_endpoint: str | None, status: int | None = None) -> None:
        """The response headers arrived; `served_endpoint` is Envoy's upstream host (None if unknown),
        `status` the response's HTTP status (None if unknown)."""

    def release(self, pick: Pick) -> None:
        """The request ended (success, error, reset); called exactly once per pick."""

    async def resolve(self, response_id: str, headers: Mapping[str, str]) -> Any:
        """After `route` raised `NeedsLookup`: locate `response_id` (raises `OpenAIError` 404/503). Only
        routers that raise `NeedsLookup` are asked."""

    async def hold(self, request: Any, headers: Mapping[str, str]) -> Any:
        """After `route(..., can_hold=True)` raised `NeedsHold` (flow control): wait in the gateway queue; returns
        the ticket to route with (``route(..., ticket=...)``) or raises its shed answer (`OpenAIError`). Only
        asked when the servicer was built with ``can_hold``."""

    def hold_deadline_s(self, headers: Mapping[str, str]) -> float:
        """The longest a request with these headers may be held (Envoy is asked to wait that long for it)."""


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


_NEEDS_LOOKUP = object()
"""A routing handler's answer when the decision waits for a response-id lookup (`_RoutingStream.lookup`)."""
_NEEDS_HOLD = object()
"""A routing handler's answer when the request waits in the gateway queue (flow control: `_RoutingStream.hold`)."""
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


_MAX_CACHED = 4096  # distinct endpoint lists kept pre-built; beyond it the cache is reset (cheap rebuild)

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
            if len(self._cache) >= _MAX_CACHED:
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


class _RoutingStream:
    """One routing stream's state; each handler answers one ProcessingRequest kind (module docstring)."""

    __slots__ = ("router", "tracker", "responses", "grpc_metadata", "headers", "pick", "st", "traceparent",
                 "pending_lookup", "can_hold", "pending_hold", "facts_first_token_live")

    def __init__(self, servicer: ExtProcServicer, grpc_metadata: Callable[[], Any]) -> None:
        self.router = servicer.router
        self.tracker = servicer.tracker
        self.responses = servicer.responses
        self.grpc_metadata = grpc_metadata
        self.headers: dict[str, str] = {}
        self.pick: Pick | None = None
        self.st: Tracked = UNTRACKED
        self.traceparent: str | None = None
        self.pending_lookup: tuple[str, str, bytes, bool, str] | None = None
        self.can_hold = servicer.can_hold
        self.facts_first_token_live = servicer.facts_first_token_live
        self.pending_hold: tuple[str, str, Any, bool] | None = None

    def request_headers(self, req: Any) -> Any:
        rh = req.request_headers
        self.headers = headers = wire.header_dict(rh.headers.headers)
        self.st, self.traceparent = self.tracker.begin(headers, self.grpc_metadata)
        if rh.end_of_stream:
            return self._decide(headers.get(":method", "GET"), headers.get(":path", "/"), b"", True)
        return _CONTINUE_REQUEST_HEADERS

    def request_body(self, req: Any) -> Any:
        if self.pick is not None:  # already decided (does not happen with BUFFERED)
            return _CONTINUE_REQUEST_BODY
        headers = self.headers
        rb = req.request_body
        if not rb.end_of_stream:  # BUFFERED sends a whole body; this is likely a chunk (see _warn_partial_body)
            _warn_partial_body()
        return self._decide(headers.get(":method", "POST"), headers.get(":path", "/"), rb.body, False)

    def response_headers(self, req: Any) -> Any:
        pick = self.pick
        if pick is not None:
            hs = req.response_headers.headers.headers
            served = wire.header_value(hs, SERVED_HEADER)
            if self.tracker.routing_response_headers(self.st, hs, served):
                status = wire.header_value(hs, ":status")
                self.router.served(pick, served, int(status) if status and status.isdigit() else None)
        return _CONTINUE_RESPONSE_HEADERS

    def _decide(self, method: str, path: str, body: Any, at_headers: bool, ticket: Any = None,
                on_endpoints: Callable[[tuple[str, ...]], None] | None = None) -> Any:
        # `on_endpoints` only when given: routers of other shapes (GIE's, tests') take the four arguments
        kw = _NO_KW if on_endpoints is None else {"on_endpoints": on_endpoints}
        try:
            if self.can_hold:
                pick = self.router.route(method, path, self.headers, body, can_hold=ticket is None, ticket=ticket,
                                         first_token_live=not self.st.facts or self.facts_first_token_live, **kw)
            else:
                pick = self.router.route(method, path, self.headers, body, **kw)
        except OpenAIError as err:
            self.tracker.refused(self.st, err.status, err.record_message)
            return immediate_response(err)
        except NeedsHold as need:
            self.pending_hold = (method, path, need.request, at_headers)
            return _NEEDS_HOLD
        except NeedsLookup as need:
            self.pending_lookup = (method, path, body, at_headers, need.response_id)
            return _NEEDS_LOOKUP
        self.pick = pick
        resp = self.responses.routing_response(pick.endpoints, at_headers)
        if self.traceparent is not None:
            resp = with_traceparent(resp, at_headers, self.traceparent)
        self.tracker.decided(self.st, pick)
        return resp


    async def lookup(self) -> Any:
        """Answer a decision that waits for a response-id lookup (`_decide` returned `_NEEDS_LOOKUP`), or for
        its body to be parsed off the event loop (`service.NeedsParse`: response id None), then maybe both."""
        assert self.pending_lookup is not None
        method, path, body, at_headers, response_id = self.pending_lookup
        self.pending_lookup = None
        try:
            if response_id is None:  # a large body: parsed in a worker process (parse_offload.py); `route`
                # then takes the parsed request in place of the body (so only the small result is kept)
                body = await self.router.parse_off_loop(method, path, self.headers, body)
            else:
                await self.router.resolve(response_id, self.headers)
        except OpenAIError as err:
            self.tracker.refused(self.st, err.status, err.record_message)
            return immediate_response(err)
        resp = self._decide(method, path, body, at_headers)
        if resp is _NEEDS_LOOKUP and response_id is None and self.pending_lookup is not None \
                and self.pending_lookup[4] is not None:
            return await self.lookup()  # parsed; now its response id needs a lookup
        if resp is _NEEDS_LOOKUP:  # found, then forgotten at once (its endpoint left meanwhile): no second round
            self.pending_lookup = None
            err = lookup_changed(response_id)
            self.tracker.refused(self.st, err.status, err.record_message)
            return immediate_response(err)
        return resp


    def extend_timeout(self) -> Any:
        """The message that asks Envoy to wait for a held request's answer (its deadline and a margin)."""
        msg = wire.ProcessingResponse()
        msg.override_message_timeout.FromMilliseconds(
            int((self.router.hold_deadline_s(self.headers) + HOLD_MARGIN_S) * 1000))
        return msg

    async def hold(self) -> Any:
        """Answer a decision that waits in the gateway queue (`_decide` returned `_NEEDS_HOLD`): route it when it
        is released, or answer its 429/503. A client that leaves cancels the wait (its request leaves the queue)."""
        assert self.pending_hold is not None
        method, path, request, at_headers = self.pending_hold
        self.pending_hold = None
        try:
            ticket = await self.router.hold(request, self.headers)
        except OpenAIError as err:
            self.tracker.refused(self.st, err.status, err.record_message, *gateway_outcome(err))
            return immediate_response(err)
        return self._decide(method, path, request, at_headers, ticket)


_ROUTING_HANDLERS: dict[str | None, Callable[[_RoutingStream, Any], Any]] = {
    "request_headers": _RoutingStream.request_headers,
    "request_body": _RoutingStream.request_body,
    "response_headers": _RoutingStream.response_headers,
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
                 facts_first_token_live: bool = True) -> None:
        """`replica_index`: see `ResponseCache` (one of several replicas behind one Envoy). `protocol`: which
        protocol each routing stream speaks (PROTOCOLS: "auto" reads it from the stream's first message).
        `gie_fallback_list`, `max_body_bytes`: GIE streams' destination list and body limit (gie.py).
        `can_hold`: the router holds requests past saturation (flow control; our own protocol's streams only:
        GIE streams are routed at once). `facts_first_token_live`: a streamed pick on the facts path reports its
        first token when it happens (Envoy's early report, envoy_facts.py), not only at its end."""
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
        stream = _RoutingStream(self, context.invocation_metadata)
        handlers = _ROUTING_HANDLERS
        try:
            while req is not eof:
                handler = handlers.get(req.WhichOneof("request"))
                if handler is not None:
                    resp = handler(stream, req)
                    if resp is _NEEDS_LOOKUP:
                        if stream.pending_lookup[4] is None:  # parsed off the loop: may pass Envoy's timeout
                            await write(_parse_extension())
                        resp = await stream.lookup()
                    if resp is _NEEDS_HOLD:
                        await write(stream.extend_timeout())
                        resp = await stream.hold()
                    await write(resp)
                req = await read()
        finally:
            if stream.pick is not None:
                self.router.release(stream.pick)
            self.tracker.routing_closed(stream.st)

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
