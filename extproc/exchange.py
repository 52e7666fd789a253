"""One request's exchange with the router, whatever transport carried it.

A transport (the ext_proc routing stream in servicer.py, GIE's stream in gie.py, the ext_authz check over HTTP in
authz.py / authz_http.py) translates its wire to these calls and the outcomes back to its wire; nothing here knows
a wire format or calls a transport.

Contract:

- `begin(headers, grpc_metadata)` once, before anything else: the request's record begins (the tracker).
- `decide(method, path, body)` routes the request and says how it ended: `Routed` (the pick is made, counted in
  the endpoint's in-flight figures and tracked), `Refused` (an OpenAI-format error, already recorded), or `Wait`
  (the decision waits: a response-id `lookup`, a `parse` of a large body off the event loop, or a `hold` in the
  gateway queue past saturation). A transport answers `Wait` by awaiting `resume` until the outcome is `Routed`
  or `Refused` (a parse may be followed by a lookup or a hold: each its own `Wait`, so the transport can ask its
  gateway to wait longer first), or by `abandon`ing it (the ext_authz check hands such a request to the ext_proc
  filter).
- At most one pick per exchange (`pick`), released in one place: `end`, the transport's end of the request (the
  stream's end; a check's decision), at once or, on the facts path, when its facts record comes (`FactsWaits`,
  closed by the facts receiver) or its wait expires.

Invariants: `decide` and `resume` never raise for a request the router refuses (they return `Refused`); every
`Refused` has been recorded with the tracker once; a `Wait` keeps exactly what `resume` needs, and nothing after.

Async safety: the event loop's thread only, like every transport.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from prefixroute.extproc.answers import lookup_changed
from prefixroute.extproc.flow.control import NeedsHold, gateway_outcome
from prefixroute.extproc.lifecycle import Pick
from prefixroute.extproc.response_directory import NeedsLookup
from prefixroute.extproc.tracking import UNTRACKED, Tracked, Tracker
from prefixroute.openai_errors import OpenAIError
from prefixroute.telemetry.tracecontext import parse_traceparent

_NO_KW: dict[str, Any] = {}


def _span_of(traceparent: str | None) -> str | None:
    """The router span id of `traceparent` (a state past the tracker's bound has no key of its own)."""
    tp = parse_traceparent(traceparent) if traceparent is not None else None
    return tp.span_id if tp is not None else None


class RouterService(Protocol):
    """What an exchange needs from the router (implemented in service.py: `PoolRouter`)."""

    def route(self, method: str, path: str, headers: Mapping[str, str], body: Any, subset: Any = None, *,
              can_hold: bool = False, ticket: Any = None, first_token_live: bool = True,
              on_endpoints: Callable[[tuple[str, ...]], None] | None = None) -> Pick:
        """Choose endpoints and count the pick as in flight. Raises `OpenAIError` to refuse, `NeedsLookup` for a
        response id to locate or a large body to parse first (`parse_off_loop`), `NeedsHold` (only with
        `can_hold`) for a request to wait in the gateway queue. `body`: the request body, or what
        `parse_off_loop` made of it. `subset`: GIE's subset hint. `ticket`: a held request's release.
        `on_endpoints`: called with the endpoints as soon as they are final (the HTTP check's early answer)."""

    def served(self, pick: Pick, served_endpoint: str | None, status: int | None = None) -> None:
        """The response headers arrived; `served_endpoint` is Envoy's upstream host (None if unknown),
        `status` the response's HTTP status (None if unknown)."""

    def release(self, pick: Pick) -> None:
        """The request ended (success, error, reset); called exactly once per pick."""

    async def parse_off_loop(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Any:
        """After `route` raised `NeedsLookup` without a response id: parse a large body in a worker process
        (raises `OpenAIError` 400/413/503); its result is `route`'s body next."""

    async def resolve(self, response_id: str, headers: Mapping[str, str]) -> Any:
        """After `route` raised `NeedsLookup`: locate `response_id` (raises `OpenAIError` 404/503). Only
        routers that raise `NeedsLookup` are asked."""

    async def hold(self, request: Any, headers: Mapping[str, str]) -> Any:
        """After `route(..., can_hold=True)` raised `NeedsHold` (flow control): wait in the gateway queue; returns
        the ticket to route with (``route(..., ticket=...)``) or raises its shed answer (`OpenAIError`). Only
        asked when the servicer was built with ``can_hold``."""

    def hold_deadline_s(self, headers: Mapping[str, str]) -> float:
        """The longest a request with these headers may be held (Envoy is asked to wait that long for it)."""


class Routed:
    """The request goes to `pick.endpoints` (primary first, then the fallbacks)."""

    __slots__ = ("pick",)

    def __init__(self, pick: Pick) -> None:
        self.pick = pick


class Refused:
    """The router answers the request itself with `error` (already recorded)."""

    __slots__ = ("error",)

    def __init__(self, error: OpenAIError) -> None:
        self.error = error


class Wait:
    """The decision waits: `reason` is "lookup" (a response id's endpoint), "parse" (a large body, off the event
    loop) or "hold" (the gateway queue past saturation). `resume` ends it."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


Outcome = Routed | Refused | Wait
WAIT_LOOKUP, WAIT_PARSE, WAIT_HOLD = Wait("lookup"), Wait("parse"), Wait("hold")

RELEASE_AFTER_S = 660.0
"""Longest a pick made by a check (ext_authz) waits for its facts record before it is released anyway: Envoy's
whole-response timeout (EnvoySettings.upstream_timeout_s, 600 s) and a margin for the record's flush and a retry's
connect. A response cannot outlast it through our Envoy configuration, so only a lost record waits this long."""
STREAM_END_RELEASE_AFTER_S = 5.0
"""Longest a pick whose ext_proc routing stream has ended waits for its facts record (`FactsReceiver.ended_picks`):
Envoy sends the record within its flush interval (facts_flush_interval_ms, 50 ms) of the stream's end; 5 s covers a
loaded host, and a lost record holds an endpoint's in-flight count no longer than that."""
RECORDS_MISSING_BACKOFF_S = 30.0
"""After a pick that could end without its record (a stream that ended first) waited in vain, picks are released at
their stream's end for this long (`FactsWaits.accepts`): with the facts logger down every pick would otherwise hold
its endpoint's in-flight count `STREAM_END_RELEASE_AFTER_S` past its end (at 24 requests/s, ~120 phantom requests
the picker and flow control read as load); one wait in 35 s tries the records again."""


class FactsWaits:
    """Picks waiting for their facts record (`Exchange.end`), each until the record closes it (the facts receiver,
    envoy_facts.py) or `release_after_s` passes, keyed by the router span id of its ``traceparent`` (what the record
    carries). One timer for all: one timeout, so insertion order is deadline order. Not thread-safe: the event
    loop's thread only."""

    def __init__(self, release: Callable[[Pick], None], closed: Callable[[Tracked], None],
                 release_after_s: float = RELEASE_AFTER_S, *, missing_backoff_s: float | None = None) -> None:
        """`missing_backoff_s`: for picks that have another end (a stream's), how long after one expired here
        (its record lost) picks are not taken (`accepts`), so they are released at that end while records go
        missing (RECORDS_MISSING_BACKOFF_S); None: always taken (a check's pick has no other end)."""
        self._release = release
        self._closed = closed
        self.release_after_s = release_after_s
        self._pending: dict[str, tuple[float, Tracked, Pick]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.num_expired = 0
        self.missing_backoff_s = missing_backoff_s
        self._expired_at: float | None = None  # the loop's time of the last expiry
        self.num_handoffs = {"hold": 0, "parse": 0}
        """Checks handed to the ext_proc filter, by reason (authz.py `AuthzServicer.start`): counted here, beside
        the picks, for /metrics."""

    def __len__(self) -> int:
        return len(self._pending)

    def accepts(self) -> bool:
        """Whether a pick should wait here for its record: always, but within `missing_backoff_s` of an expiry."""
        if self.missing_backoff_s is None or self._expired_at is None or self._loop is None:
            return True
        return self._loop.time() - self._expired_at >= self.missing_backoff_s

    def add(self, span_id: str, st: Tracked, pick: Pick) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.release_after_s
        self._pending[span_id] = (deadline, st, pick)
        if self._timer is None or self._loop is not loop:
            self._loop = loop
            self._timer = loop.call_at(deadline, self._sweep)

    def close(self, span_id: str | None) -> bool:
        """The facts record of `span_id` came: release its pick and close its record. False when none waits."""
        entry = self._pending.pop(span_id, None) if span_id is not None else None
        if entry is None:
            return False
        _, st, pick = entry
        self._release(pick)
        self._closed(st)
        return True

    def _sweep(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time() + 0.001
        pending = self._pending
        while pending:
            span_id, (deadline, st, pick) = next(iter(pending.items()))
            if deadline > now:
                self._timer = loop.call_at(deadline, self._sweep)
                return
            del pending[span_id]
            self.num_expired += 1
            self._expired_at = now
            self._release(pick)
            self._closed(st)  # no record: the tracker says "response facts missing" after its grace


class Exchange:
    """One request's state between its transport and the router (module docstring)."""

    __slots__ = ("router", "tracker", "headers", "pick", "st", "traceparent", "can_hold", "first_token_live",
                 "_pending")

    def __init__(self, router: RouterService, tracker: Tracker, *, can_hold: bool = False,
                 first_token_live: bool = True) -> None:
        """`can_hold`: the router holds requests past saturation (flow control). `first_token_live`: on the facts
        path, the router hears a streamed response's first token when it happens (Envoy's early report)."""
        self.router = router
        self.tracker = tracker
        self.headers: dict[str, str] = {}
        self.pick: Pick | None = None
        self.st: Tracked = UNTRACKED
        self.traceparent: str | None = None
        self.can_hold = can_hold
        self.first_token_live = first_token_live
        self._pending: tuple[Any, ...] | None = None  # what `resume` needs: (method, path, body or request, id)

    def begin(self, headers: dict[str, str], grpc_metadata: Callable[[], Any]) -> None:
        self.headers = headers
        self.st, self.traceparent = self.tracker.begin(headers, grpc_metadata)

    def end(self, waits: FactsWaits | None) -> None:
        """The transport's end of the request: the one place a pick is released. On the facts path with `waits`
        (a stream that ended before its facts record, or a check, which never hears its response end) the pick
        waits there until its record comes, so what the record brings (a short stream's first token, its usage)
        is learned before the release; otherwise it is released now. Either way the record is closed once."""
        pick, st = self.pick, self.st
        key = st.key or (_span_of(self.traceparent) if pick is not None and waits is not None else None)
        if pick is not None and waits is not None and st.facts and not st.obs_done and key and waits.accepts():
            waits.add(key, st, pick)  # released by its facts record (or its expiry), which closes st too
            return
        if pick is not None:
            self.router.release(pick)
        self.tracker.routing_closed(st)

    def decide(self, method: str, path: str, body: Any, ticket: Any = None,
               on_endpoints: Callable[[tuple[str, ...]], None] | None = None, **route_kw: Any) -> Outcome:
        """Route once (module docstring). `ticket`: the gateway queue's release of a held request.
        `on_endpoints`: called with the endpoints as soon as they are final, before the pick's bookkeeping (the
        HTTP check writes its answer then). `route_kw`: the router's other arguments (GIE's subset hint)."""
        kw = route_kw if on_endpoints is None else {**route_kw, "on_endpoints": on_endpoints}
        try:
            if self.can_hold:
                pick = self.router.route(method, path, self.headers, body, can_hold=ticket is None, ticket=ticket,
                                         first_token_live=not self.st.facts or self.first_token_live, **kw)
            else:
                pick = self.router.route(method, path, self.headers, body, **kw)
        except OpenAIError as err:
            return self.refuse(err)
        except NeedsHold as need:
            self._pending = (method, path, need.request, None)
            return WAIT_HOLD
        except NeedsLookup as need:
            self._pending = (method, path, body, need.response_id)
            return WAIT_PARSE if need.response_id is None else WAIT_LOOKUP
        self.pick = pick
        self.tracker.decided(self.st, pick)
        return Routed(pick)

    async def resume(self, wait: Wait) -> Outcome:
        """End a `Wait`: the lookup, the parse or the hold, then the decision again. A parse may end in another
        `Wait` (its request's response id to look up, or a hold), which the transport resumes in turn; a lookup
        whose endpoint left at once is refused (no second round); a held request, released, is decided."""
        assert self._pending is not None, "resume without a Wait"
        method, path, body, response_id = self._pending
        self._pending = None
        if wait.reason == "hold":
            try:
                ticket = await self.router.hold(body, self.headers)
            except OpenAIError as err:
                return self.refuse(err, *gateway_outcome(err))
            return self.decide(method, path, body, ticket)
        try:
            if response_id is None:  # a large body, parsed in a worker: `route` then takes the parsed request
                body = await self.router.parse_off_loop(method, path, self.headers, body)
            else:
                await self.router.resolve(response_id, self.headers)
        except OpenAIError as err:
            return self.refuse(err)
        out = self.decide(method, path, body)
        if out is WAIT_LOOKUP and response_id is not None:
            self._pending = None  # found, then forgotten at once (its endpoint left meanwhile): no second round
            return self.refuse(lookup_changed(response_id))
        return out

    def abandon(self) -> None:
        """Drop a `Wait` without resuming it (the request is handed to another transport, which decides again)."""
        self._pending = None

    def refuse(self, err: OpenAIError, *outcome: Any) -> Refused:
        """The router answers `err` itself: recorded once (`outcome`: the gateway queue's words for a shed)."""
        self.tracker.refused(self.st, err.status, err.record_message, *outcome)
        return Refused(err)

    def served(self, served: str | None, headers: Any, status: str | None) -> None:
        """The response's headers came (the served endpoint, its status): passive failure detection."""
        pick = self.pick
        if pick is not None and self.tracker.routing_response_headers(self.st, headers, served):
            self.router.served(pick, served, int(status) if status and status.isdigit() else None)


def route_kw(subset: Any) -> dict[str, Any]:
    """The router's keyword arguments for a GIE subset hint (none without one)."""
    return _NO_KW if subset is None else {"subset": subset}
