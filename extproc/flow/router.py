"""Flow control's view of the live router (issue 24): `RouterView` reads a `PoolRouter`'s pool, in-flight counts,
time model and prefix index (through `view`), so the gate and the virtual fleet judge saturation and order
held requests with what the router itself knows. Reads only; one event loop, like the router.

(The service does not import this module: flow control sits in front of it, so the imports point one way.)
"""

from __future__ import annotations

from collections.abc import Hashable

from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.extproc.routing.timemodel import TimeModel
from prefixroute.extproc.service import PoolRouter

from .saturation import EndpointLoad, SaturationDetector
from .view import cheapest_prefill_s, endpoint_loads, first_room_ratio


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
        self.stale_after_s = stale_after_s

    def loads(self) -> list[EndpointLoad]:
        r = self.router
        return endpoint_loads(r.pool.snapshot(), r.pool.in_flight, self.model, r.clock(),
                              stale_after_s=self.stale_after_s, drain=self.drain)

    def room_ratio(self, detector: SaturationDetector) -> float | None:
        """`view.first_room_ratio` over the router's pool now: < 1 when some endpoint has room, else None."""
        r = self.router
        return first_room_ratio(r.pool.snapshot(), r.pool.in_flight, self.model, r.clock(), detector,
                                stale_after_s=self.stale_after_s, drain=self.drain)

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
