"""One request's lifecycle in the router service: the record (`Pick`), its phases, and the one dispatcher
(`Lifecycle`) that tells the listeners (the time model, the prefix index and sessions, the Responses
directory, the other replicas, the pool's in-flight count) what happened to it.

Phases, in the order they can happen (GIE's request-control plugins name the same points: PreRequest is our
DECIDED, ResponseReceived our response headers, ResponseStreaming our FIRST_TOKEN, ResponseComplete our USAGE
and RELEASED)::

    DECIDED --> [FAILED_OVER] --> [FIRST_TOKEN] --> [USAGE] ... RELEASED
          \\-- the router refused the request (an OpenAIError): no record, nothing to release

- DECIDED: `PoolRouter.route` made the record (its `Decision`, the addresses for Envoy) and counted the primary
  in flight; `Lifecycle.decided` tells the listeners.
- FAILED_OVER: Envoy's served-endpoint report named a fallback (counted only under `PoolRouter.served`'s trust
  rule, at most once): the prefix is where it really is now.
- FIRST_TOKEN: the response's first token came `ttft_s` after the request arrived (streamed responses only), at
  most once, before or after RELEASED (the gateway's two streams report in no fixed order).
- USAGE: the response ended with its usage figures (None: none reported), at most once, before or after
  RELEASED. TTFT_SAMPLE: the first usage report after FIRST_TOKEN, the (TTFT, usage) pair the time model learns
  a rate from (usually the same report as USAGE; a non-streamed response has no first token, so no sample).
- RESPONSE_ID: a Responses API response carried its id (the directory pins follow-ups to its endpoint).
- RELEASED: the HTTP request ended for any reason, exactly once per record.

Each `Lifecycle` method records the phase on the `Pick` (so a repeated report is ignored here, not in every
listener), stores the figures on it, then calls the matching hook of every listener in registration order. A
listener is a `LifecycleListener` subclass overriding only the hooks it needs (the others are no-ops): one file
and one `Lifecycle.add` per new listener (docs/extending.md). Hooks must not raise and must not block: they run
on the event loop, in the request's path.

Single event loop; not thread-safe.
"""

from __future__ import annotations

from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.types import Decision, EndpointId


class Phase:
    """What happened to a request so far (module docstring): bits, a `Pick` holds their union (an int). Plain
    ints, not an ``enum.IntFlag``: every ``|`` or ``in`` of an IntFlag runs Python code in `enum` (~1 us), and
    a request takes several."""

    DECIDED = 1
    FAILED_OVER = 2
    FIRST_TOKEN = 4
    USAGE = 8
    RESPONSE_ID = 16
    RELEASED = 32
    TTFT_SAMPLE = 64
    """The first usage report after the first token: (TTFT, usage), what the time model learns a rate from."""
    SERVED_REPORT = 128
    """A served-endpoint report was counted (a failover, or a pinned holder's 503 that asked for a probe): only
    the first counts (`PoolRouter.served`'s trust rule)."""


class Pick:
    """One routed request, from its decision to its release: the only per-request state of the router service
    (module docstring). ``endpoints`` are addresses (``ip:port``, what Envoy's ORIGINAL_DST needs) and
    ``endpoint_ids`` the endpoints behind them, primary first; ``counted`` is the endpoint holding its in-flight
    count (the primary, or the fallback a counted failover report named)."""

    __slots__ = ("endpoints", "endpoint_ids", "request", "decision", "decision_us", "counted", "phases",
                 "index_source", "ttft_s", "prompt_tokens", "cached_tokens", "response_id", "response_endpoint",
                 "peer_seq", "peer_pending", "peer_seq_any", "flow_wait_s", "flow_released_by",
                 "first_token_live", "predicted_tiers")

    def __init__(self, endpoints: tuple[str, ...], endpoint_ids: tuple[EndpointId, ...],
                 request: InferenceRequest, decision: Decision, decision_us: float) -> None:
        self.endpoints = endpoints
        self.endpoint_ids = endpoint_ids
        self.request = request
        self.decision = decision
        self.decision_us = decision_us  # parse + schedule, microseconds
        self.counted: EndpointId = endpoint_ids[0]
        self.phases = 0  # Phase bits
        self.index_source = ""  # where the primary's match came from (RouterCore.index_source_of), for telemetry
        self.ttft_s: float | None = None  # FIRST_TOKEN: seconds from arrival
        self.prompt_tokens: int | None = None  # USAGE: the serving endpoint's figures (None: not reported)
        self.cached_tokens: int | None = None
        self.response_id: str | None = None  # RESPONSE_ID: the Responses API id of this pick's response
        # Flow control (extproc/flow): seconds this request was held in the gateway queue, and the event that
        # released it (first_token, release, scrape, arrival); 0 / None: routed at once.
        self.flow_wait_s = 0.0
        self.flow_released_by: str | None = None
        # Whether a streamed response's first token is reported when it happens (the observing stream, GIE) or
        # only with the request's end (the facts path: Envoy's record comes once per request, after its end).
        self.first_token_live = True
        self.response_endpoint: EndpointId | None = None  # the endpoint holding `response_id`
        self.peer_seq: int | None = None  # set while the other replicas count this pick in flight (a Release due)
        self.peer_pending = False  # the other replicas count it pending (a Done due at the first token)
        self.peer_seq_any: int | None = None  # its number on the bus, kept after its Release (for its response id)
        # (GPU, CPU) leading blocks at the primary as the tier-aware events index matched them (None: no such
        # prediction; lifecycle_listeners.TierPredictionListener)
        self.predicted_tiers: tuple[int, int] | None = None

    @property
    def released(self) -> bool:
        return bool(self.phases & Phase.RELEASED)


class LifecycleListener:
    """A party that acts on requests' phases (module docstring). Override the hooks you need; each is called
    once per record at most, after the `Pick` holds that phase's figures. Must not raise, must not block."""

    def on_decided(self, pick: Pick) -> None:
        """DECIDED: the decision is made and the primary counted in flight."""

    def on_failed_over(self, pick: Pick, served: EndpointId) -> None:
        """FAILED_OVER: `served`, a fallback of `pick`, served it (``pick.counted`` still names the previous
        holder of the in-flight count)."""

    def on_first_token(self, pick: Pick) -> None:
        """FIRST_TOKEN: ``pick.ttft_s`` is set."""

    def on_usage(self, pick: Pick) -> None:
        """USAGE: ``pick.prompt_tokens`` / ``pick.cached_tokens`` are set (None: not reported)."""

    def on_ttft_sample(self, pick: Pick) -> None:
        """TTFT_SAMPLE: a usage report after the first token: ``pick.ttft_s`` with ``pick.prompt_tokens`` /
        ``pick.cached_tokens``, the pair a rate is learned from (right after `on_usage` when both come in one
        report)."""

    def on_response_id(self, pick: Pick) -> None:
        """RESPONSE_ID: ``pick.response_id`` and ``pick.response_endpoint`` are set."""

    def on_released(self, pick: Pick) -> None:
        """RELEASED: the HTTP request ended (finished, failed or cancelled)."""


class Lifecycle:
    """The one dispatcher of request phases to the listeners, in registration order (module docstring)."""

    def __init__(self) -> None:
        self.listeners: list[LifecycleListener] = []

    def add(self, listener: LifecycleListener) -> None:
        """Register `listener`: it is told of every phase from now on, after the listeners added before it."""
        self.listeners.append(listener)

    def decided(self, pick: Pick) -> None:
        pick.phases |= Phase.DECIDED
        for listener in self.listeners:
            listener.on_decided(pick)

    def failed_over(self, pick: Pick, served: EndpointId) -> bool:
        """The first counted failover report of `pick`; False (nothing told) for a later one."""
        if pick.phases & Phase.FAILED_OVER:
            return False
        pick.phases |= Phase.FAILED_OVER
        for listener in self.listeners:
            listener.on_failed_over(pick, served)
        return True

    def first_token(self, pick: Pick, ttft_s: float) -> None:
        if pick.phases & Phase.FIRST_TOKEN:
            return
        pick.phases |= Phase.FIRST_TOKEN
        pick.ttft_s = ttft_s
        for listener in self.listeners:
            listener.on_first_token(pick)

    def usage(self, pick: Pick, prompt_tokens: int | None, cached_tokens: int | None) -> None:
        """The first usage report is USAGE (`on_usage`); the first one after a first token is also the TTFT
        sample (`on_ttft_sample`): a report that came before any first token (a non-streamed response) has no
        TTFT to learn from, and only a later report can complete the pair."""
        new = not pick.phases & Phase.USAGE
        sample = bool(pick.phases & Phase.FIRST_TOKEN) and not pick.phases & Phase.TTFT_SAMPLE
        if not (new or sample):
            return
        pick.prompt_tokens = prompt_tokens
        pick.cached_tokens = cached_tokens
        if new:
            pick.phases |= Phase.USAGE
            for listener in self.listeners:
                listener.on_usage(pick)
        if sample:
            pick.phases |= Phase.TTFT_SAMPLE
            for listener in self.listeners:
                listener.on_ttft_sample(pick)

    def response_id(self, pick: Pick, response_id: str, endpoint: EndpointId) -> None:
        pick.phases |= Phase.RESPONSE_ID
        pick.response_id = response_id
        pick.response_endpoint = endpoint
        for listener in self.listeners:
            listener.on_response_id(pick)

    def released(self, pick: Pick) -> None:
        if pick.phases & Phase.RELEASED:
            return
        pick.phases |= Phase.RELEASED
        for listener in self.listeners:
            listener.on_released(pick)
