"""Flow control's view of the live router: `RouterView` reads a `PoolRouter`'s pool, in-flight counts,
time model and prefix index (through `view`), so the gate and the virtual fleet judge saturation and order
held requests with what the router itself knows. Reads only; one event loop, like the router.

(The service does not import this module: flow control sits in front of it, so the imports point one way.)
"""

from __future__ import annotations

from collections.abc import Hashable

from prefixroute.extproc.lifecycle import LifecycleListener, Pick
from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.extproc.routing.timemodel import TimeModel
from prefixroute.extproc.service import PoolRouter

from .saturation import EndpointLoad, SaturationDetector
from .view import cheapest_prefill_s, endpoint_loads, first_room_ratio


class StreamedPrefill(LifecycleListener):
    """Per endpoint, the predicted uncached prefill (tokens) of the streamed requests sent there whose first token
    has not been reported yet (it leaves at the first token, a failover or the request's end): the detector's
    outstanding work (settings.saturation_drain off). Only streamed responses report a first token; the others
    are left to the time model's draining backlog, which the view takes when it is larger. One event loop."""

    def __init__(self, learner) -> None:  # noqa: ANN001 - routing.ttft_learner.TtftLearner
        self.learner = learner
        self.tokens: dict = {}  # endpoint -> tokens
        self._picks: dict[int, tuple] = {}  # request key -> (endpoint, tokens)

    def on_decided(self, pick: Pick) -> None:
        req = pick.request
        if not req.stream or not pick.first_token_live:  # no first token before its end: left to the drain
            return
        own = self.learner.pending_tokens_of(req)
        if not own or own <= 0:
            return
        ep = pick.endpoint_ids[0]
        self._picks[req.key] = (ep, own)
        self.tokens[ep] = self.tokens.get(ep, 0.0) + own

    def _end(self, pick: Pick) -> None:
        entry = self._picks.pop(pick.request.key, None)
        if entry is None:
            return
        ep, own = entry
        left = self.tokens.get(ep, 0.0) - own
        if left > 0.5:  # under half a token is float residue
            self.tokens[ep] = left
        else:
            self.tokens.pop(ep, None)

    def on_failed_over(self, pick: Pick, served) -> None:  # noqa: ANN001
        self._end(pick)

    def on_first_token(self, pick: Pick) -> None:
        self._end(pick)

    def on_released(self, pick: Pick) -> None:
        self._end(pick)


class RouterView:
    """`loads()` for the saturation detector, `cost_of(request)` and `group_of(request)` for the queue."""

    def __init__(self, router: PoolRouter, *, stale_after_s: float, drain: bool = False) -> None:
        """`stale_after_s`: the pool's metrics_stale_after_s (older scrapes say nothing); `drain`: the
        settings' saturation_drain (predicted queueing drains at the predicted rate; default: it stays until
        first tokens are reported)."""
        self.router = router
        self.drain = drain
        learner = router.core.learner
        # The prefix policy's time model; a baseline policy has none (held on the servers' scrapes alone).
        self.model: TimeModel | None = learner.model if learner is not None else None
        # Registered before flow control's own listener (`flow_for`), so a first token has left it when the gate
        # is pumped on that first token.
        self.streamed: StreamedPrefill | None = None
        if learner is not None and not drain:
            self.streamed = StreamedPrefill(learner)
            router.add_listener(self.streamed)
        self.stale_after_s = stale_after_s
        # The router's own loop stalls (the pool's `LoopLag`, as its health judgements use): a scrape is not
        # stale for the time the router could not read the next one. None for a pool without one (simulated).
        lag = getattr(router.pool, "lag", None)
        self.stall_s = lag.stall_s if lag is not None else None

    def loads(self) -> list[EndpointLoad]:
        r = self.router
        return endpoint_loads(r.pool.snapshot(), r.pool.in_flight, self.model, r.clock(),
                              stale_after_s=self.stale_after_s, drain=self.drain, streamed=self._streamed(),
                              stall_s=self.stall_s)

    def room_ratio(self, detector: SaturationDetector) -> float | None:
        """`view.first_room_ratio` over the router's pool now: < 1 when some endpoint has room, else None."""
        r = self.router
        return first_room_ratio(r.pool.snapshot(), r.pool.in_flight, self.model, r.clock(), detector,
                                stale_after_s=self.stale_after_s, drain=self.drain, streamed=self._streamed(),
                                stall_s=self.stall_s)

    def _streamed(self) -> dict | None:
        return self.streamed.tokens if self.streamed is not None else None

    def cost_of(self, request: InferenceRequest) -> float:
        """The request's least uncached prefill over the pool (seconds): what the index holds of its prefix, or
        a pending request's prefix (a sibling placed a moment ago), at each endpoint's priced rate."""
        core = self.router.core
        settings = core.settings
        hashes = request.block_hashes
        matches = dict(core.sourced.match(hashes)) if hashes else {}
        if hashes and self.model is not None:
            for ep, m in self.model.pending_matches(hashes).items():
                if m > matches.get(ep, 0):
                    matches[ep] = m
        if request.num_prompt_tokens is not None:
            tokens, per_block = float(request.num_prompt_tokens), float(settings.kv_block_tokens)
        else:
            tokens, per_block = request.num_prompt_chars / settings.chars_per_token, settings.tokens_per_block
        return cheapest_prefill_s(self.model, tokens, per_block, self.router.pool.endpoints, matches)

    def group_of(self, request: InferenceRequest) -> Hashable | None:
        """Requests sharing their first cold_key_blocks blocks (a system prompt) are one group: placing one
        makes the others hits."""
        hashes = request.block_hashes
        if not hashes:
            return None
        return hashes[min(len(hashes), self.router.core.settings.cold_key_blocks) - 1]
