"""The decision behind Envoy's ext_authz filter over HTTP (authz_http.py): one check per request, answered at once.

Envoy's ext_authz filter, with ``with_request_body``, buffers the request and sends its headers and whole body in
one check; the answer's routing headers are set on the request and ``clear_route_cache`` makes Envoy route again
by them. One exchange each way and nothing held open, against the ext_proc routing stream's two round trips and a
stream held until the response ends (bench-results/routing-authz-http/, bench-results/extproc-default/).
Chosen by ``--routing-filter ext_authz_http`` (an option: the default is the ext_proc filter). Envoy's ext_authz
over gRPC was measured too and removed: the HTTP check cost less in every figure (bench-results/routing-authz/).

Contract, beside the ext_proc servicer's (servicer.py), which this reuses for the decision itself (the same
`Exchange`: decision, lookups, holds and telemetry calls):

- `AuthzServicer.start` decides at once where it can; `finish` awaits a lookup or a parse; `settle` turns the
  answer into the outcome: (endpoints, traceparent) when routed, the refusal otherwise. The transport builds its
  own answer from that (authz_http.py).
- Nothing tells a check when the response ends, so a pick is released by the request's facts record (the facts
  path, envoy_facts.py: Envoy sends it at the end of every HTTP stream, reset or not), which also closes its
  telemetry record. A pick whose record never comes (the facts logger down, a record lost) is released
  `release_after_s` (exchange.py `FactsWaits`) after its decision and its record emitted with "response facts
  missing": until then the endpoint's in-flight count holds it. The Envoy configuration refuses ext_authz without
  the facts path.
- Envoy's ext_authz timeout is one figure per filter (the ext_proc filter's message timeout, 0.5 s): it cannot be
  extended per request as ext_proc's ``override_message_timeout`` is. So a request that may wait longer, one flow
  control would hold or a large body parsed off the loop, is handed off: answered with ``x-prefixroute-handoff:
  ext_proc`` alone, which Envoy's handoff route matches, where the ext_proc routing filter runs and the router
  decides again on its stream, extending Envoy's wait as it needs (`AuthzServicer.start`; the check's own state is
  discarded, the stream records the request). Only when the check says the route exists (HANDOFF_HEADER, as our
  configuration sends); otherwise such a request is routed at once (no hold) and a large body parsed within the
  check.

Async safety: runs on the router's event loop, like the servicer; nothing blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prefixroute.extproc.answers import immediate_response
from prefixroute.extproc.headers import PARTIAL_BODY_HEADER
from prefixroute.extproc.exchange import (WAIT_HOLD, WAIT_PARSE, Exchange, FactsWaits, Outcome, Refused,
                                          RouterService, Wait)
from prefixroute.extproc.tracking import Tracker
from prefixroute.openai_errors import OpenAIError

log = logging.getLogger(__name__)

HANDOFF = object()
"""`AuthzServicer.start`'s answer for a request handed to the ext_proc filter."""
class AuthzServicer:
    """One ext_authz check -> the router's decision (module docstring); authz_http.py carries it."""

    def __init__(self, router: RouterService, tracker: Tracker, picks: FactsWaits, *, can_hold: bool = False,
                 first_token_live: bool = True) -> None:
        """`picks`: the facts receiver's table of unary picks (each released by its facts record); `can_hold`:
        the router holds requests past saturation (flow control), handed to the ext_proc filter when Envoy has
        the handoff route; `first_token_live`: the facts path's early first token reports are on."""
        self.router = router
        self.tracker = tracker
        self.picks = picks
        self.can_hold = can_hold
        self.first_token_live = first_token_live
        self.num_unreleasable = 0

    def start(self, headers: dict[str, str], method: str, path: str, body: Any,
              grpc_metadata: Callable[[], Any], handoff: bool = False,
              body_cap: int | None = None,
              early_answer: Callable[[tuple[str, ...], str | None], None] | None = None
              ) -> tuple[Exchange | None, Any]:
        """Decide one check's request at once where it can: (its exchange, the outcome), where the outcome may be
        `HANDOFF` (answer with `HANDOFF_HEADER`), or a `Wait`, then awaited with `finish`; `settle` turns the
        outcome into the answer's terms. Split so that a transport can answer a decision made at once without a
        coroutine (authz_http.py). `grpc_metadata`: the check's metadata pairs (the facts path's
        OBSERVED_METADATA, by the tracker). `handoff`: Envoy's configuration has the handoff route (the check
        carried HANDOFF_HEADER): a request flow control would hold, or a large body to parse off the loop, is
        handed to the ext_proc filter, whose answers may extend Envoy's wait; without it such a request is
        routed at once, and a large body parsed within the check. A body Envoy sent in part (PARTIAL_BODY_HEADER:
        above the filter's max_request_bytes, which our configuration sets to what the router parses on its loop)
        is handed off at once with no state begun (the exchange is None then); without the route it is refused
        (413). `body_cap`: that max_request_bytes when the check says it (AUTHZ_BODY_BYTES_HEADER): a body that
        long is taken for a cut one too, since Envoy may mark it whole. `early_answer`: called once with what
        `settle` will return for a routed decision made at once, (endpoints, traceparent or None), as soon as
        the decision is final and before the pick is recorded, counted and tracked (the HTTP check writes its
        answer then: that work no longer delays Envoy); not called for a refusal, a handoff or an answer left to
        `finish`."""
        partial = headers.get(PARTIAL_BODY_HEADER) == "true" or (body_cap is not None and len(body) >= body_cap)
        if partial and handoff:  # a body above what Envoy sends whole: parsed off the loop, its whole by ext_proc
            self.picks.num_handoffs["parse"] += 1
            return None, HANDOFF
        ex = Exchange(self.router, self.tracker, can_hold=handoff and self.can_hold,
                      first_token_live=self.first_token_live)
        ex.begin(headers, grpc_metadata)
        if partial:  # another project's configuration: no way to see the whole body
            return ex, ex.refuse(OpenAIError(413, "Request body larger than the gateway's ext_authz filter sends "
                                                  "whole (with_request_body.max_request_bytes) and no handoff route "
                                                  "to route it by"))
        on_endpoints = None
        if early_answer is not None:
            # what `settle` answers: the traceparent only when a facts record will release the pick
            tp = ex.traceparent if ex.traceparent is not None and ex.st.facts else None
            on_endpoints = lambda endpoints: early_answer(endpoints, tp)  # noqa: E731
        out = ex.decide(method, path, body, on_endpoints=on_endpoints)
        if handoff and (out is WAIT_HOLD or out is WAIT_PARSE):
            self.picks.num_handoffs[out.reason] += 1
            ex.abandon()
            self.tracker.discard(ex.st)  # the ext_proc stream records it
            return ex, HANDOFF
        return ex, out

    @staticmethod
    async def finish(ex: Exchange, out: Outcome) -> Outcome:
        """The outcome of a decision `start` could not make at once (a response-id lookup, a parse off the loop,
        a hold)."""
        while out.__class__ is Wait:
            out = await ex.resume(out)  # type: ignore[arg-type]
        return out

    def settle(self, ex: Exchange, out: Outcome) -> tuple[tuple[str, ...] | None, Any]:
        """The outcome of a decided check: (endpoints, traceparent: str or None) when routed, the pick then held
        until its facts record (or released now, off the facts path); (None, the ext_proc ImmediateResponse of
        the refusal) when refused."""
        st = ex.st
        if out.__class__ is Refused:  # the router answered
            self.tracker.routing_closed(st)
            return None, immediate_response(out.error)  # type: ignore[union-attr]
        pick = ex.pick
        assert pick is not None, out
        traceparent = ex.traceparent
        if traceparent is None or not st.facts:
            # Envoy sent no facts metadata (a configuration other than ours): no record will close this pick.
            self.num_unreleasable += 1
            if self.num_unreleasable in (1, 100) or self.num_unreleasable % 10_000 == 0:
                log.warning("ext_authz check without the facts path (no records): %d pick(s) released at their "
                            "decision, so endpoints' in-flight counts miss them", self.num_unreleasable)
            ex.end(None)
            return pick.endpoints, None
        ex.end(self.picks)  # nothing tells a check when its response ends: its facts record releases the pick
        return pick.endpoints, traceparent
