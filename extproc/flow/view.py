"""What flow control reads of the router: each endpoint's load for the saturation detector, and a
request's predicted service for the queue's order, from the time model, the pool's last scrapes and the router's
in-flight counts. Pure functions over those objects; they change nothing (one event loop, like the router).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from prefixroute.extproc.routing.timemodel import TimeModel
from prefixroute.types import EndpointId, EndpointState

from .saturation import EndpointLoad, SaturationDetector


def queued_s_of(model: TimeModel, ep: EndpointId, n: int, now_s: float, drain: bool,
                streamed: Mapping[EndpointId, float] | None = None) -> float:
    """The time model's work ahead of a new request on `ep` (`n` in flight there), in seconds at its priced rate:
    the prefill of the requests sent there and not yet at their first token, plus the decoding requests' share of
    the steps (settings.saturation_drain). ``drain``: that prefill as it drains at the predicted rate since the
    last pick (`TimeModel.queued_at`). Otherwise, all of it until first tokens; with `streamed` (the
    `router.StreamedPrefill` figures: only streamed responses report a first token), the larger of the streamed
    requests' outstanding prefill and the draining backlog of all (so a non-streamed request, whose first token
    is never reported, is not counted until it ends)."""
    rate = model.priced(ep)[0]
    decoding = max(0, n - model.num_pending(ep))
    if drain:
        queued = model.queued_at(ep, now_s)
    elif streamed is None:
        queued = model.queued_at(ep, None)
    else:
        queued = max(model.queued_at(ep, now_s), streamed.get(ep, 0.0))
    return model.work_tokens(queued, 0.0, decoding) / rate


StallS = Callable[[float, float], float]
"""``stall_s(since_s, now_s)``: seconds of that interval the router's own event loop was stalled (the pool's
`LoopLag.stall_s`)."""


def is_fresh(scraped_at_s: float | None, now_s: float, stale_after_s: float, stall_s: StallS | None) -> bool:
    """A scrape is fresh while at most `stale_after_s` old, not counting the time the router's loop stalled
    since (`stall_s`; the pool's own rule): a scrape the router had no chance to refresh is not stale."""
    if scraped_at_s is None:
        return False
    age = now_s - scraped_at_s
    if age <= stale_after_s:
        return True
    return stall_s is not None and age - stall_s(scraped_at_s, now_s) <= stale_after_s


def endpoint_loads(snapshot: Sequence[EndpointState], in_flight: Mapping[EndpointId, int], model: TimeModel | None,
                   now_s: float, *, stale_after_s: float, drain: bool = False,
                   streamed: Mapping[EndpointId, float] | None = None,
                   stall_s: StallS | None = None) -> list[EndpointLoad]:
    """One `EndpointLoad` per endpoint of `snapshot`: ``queued_s`` is the time model's work ahead of a new
    request there (`queued_s_of`; 0 without a time model: a baseline policy is held by the scrapes alone); the
    scraped waiting count and KV usage only while the scrape is fresh (`is_fresh`: `now_s` and ``scraped_at_s``
    on one clock, the router's loop stalls left out of its age)."""
    out = []
    get = in_flight.get
    for s in snapshot:
        ep = s.endpoint
        n = get(ep, 0)
        queued_s = queued_s_of(model, ep, n, now_s, drain, streamed) if model is not None else 0.0
        fresh = is_fresh(s.scraped_at_s, now_s, stale_after_s, stall_s)
        out.append(EndpointLoad(ep, queued_s, s.num_requests_waiting if fresh else None,
                                s.kv_cache_usage_ratio if fresh else None, s.healthy, n))
    return out


def cheapest_prefill_s(model: TimeModel | None, prompt_tokens: float, tokens_per_block: float,
                       endpoints: Sequence[EndpointId], matches: Mapping[EndpointId, int]) -> float:
    """A request's predicted service for the queue's order: its least uncached prefill over `endpoints`
    (``prompt_tokens`` less the leading blocks each holds, `matches`: the prefix index's and the pending
    prefixes'), in seconds at that endpoint's priced rate; without a time model, in tokens / 10,000 (the order
    is what matters). >= 0; `prompt_tokens` when nothing matches."""
    best = float("inf")
    for ep in endpoints:
        own = max(0.0, prompt_tokens - matches.get(ep, 0) * tokens_per_block)
        rate = model.priced(ep)[0] if model is not None else 10_000.0
        best = min(best, own / rate)
    if best == float("inf"):
        rate = model.default_fit[0] if model is not None else 10_000.0
        best = prompt_tokens / rate
    return best


def first_room_ratio(snapshot: Sequence[EndpointState], in_flight: Mapping[EndpointId, int],
                     model: TimeModel | None, now_s: float, detector: SaturationDetector, *,
                     stale_after_s: float, drain: bool = False,
                     streamed: Mapping[EndpointId, float] | None = None,
                     stall_s: StallS | None = None) -> float | None:
    """The load ratio (< 1) of the first healthy endpoint of `snapshot` with room, or None when none has room:
    `endpoint_loads` + `SaturationDetector.detect`'s answer to "saturated?", stopping at the first endpoint with
    room, so a decision below saturation costs one or a few endpoints' figures, not the pool's."""
    get = in_flight.get
    for s in snapshot:
        if not s.healthy:
            continue
        ep = s.endpoint
        n = get(ep, 0)
        queued_s = queued_s_of(model, ep, n, now_s, drain, streamed) if model is not None and n else 0.0
        fresh = is_fresh(s.scraped_at_s, now_s, stale_after_s, stall_s)
        r = detector.load_ratio(EndpointLoad(ep, queued_s, s.num_requests_waiting if fresh else None,
                                             s.kv_cache_usage_ratio if fresh else None, True, n))
        if r < 1.0:
            return r
    return None
