"""Scorers: each maps every candidate endpoint to a score in [0, 1], higher = better.

Contract: ``score(ctx, endpoints)`` returns one float in [0, 1] per endpoint, in the same order, depending only
on the context (pure). A signal that is unknown (never scraped, or stale: the pool sets it to None) scores the
neutral 0.5, so a missing metric neither attracts nor repels traffic.

The prefix policy weights them in prompt tokens (policies.py): prefix x tokens hashed = prefill saved;
in-flight x (load_cost_tokens x concurrency_threshold) = a constant minus load_cost_tokens per request; so a
weighted sum is a constant minus the Dynamo-like cost, and the max score is the least cost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

from prefixroute.extproc.routing.types import EndpointId, EndpointState

NEUTRAL_SCORE = 0.5


@dataclasses.dataclass(slots=True)
class ScoringContext:
    """Inputs shared by the scorers for one decision."""

    in_flight: Mapping[EndpointId, int]
    matches: Mapping[EndpointId, int]  # consecutive leading blocks held (prefix index), absent = 0
    total_blocks: int
    concurrency_threshold: int = 32
    queue_scale: int = 16


class Scorer(Protocol):
    name: str

    def score(self, ctx: ScoringContext, endpoints: Sequence[EndpointState]) -> list[float]: ...


class PrefixScorer:
    """matched leading blocks / blocks hashed (0 for every endpoint when the request has no block)."""

    name = "prefix"

    def score(self, ctx: ScoringContext, endpoints: Sequence[EndpointState]) -> list[float]:
        if ctx.total_blocks <= 0 or not ctx.matches:
            return [0.0] * len(endpoints)
        get = ctx.matches.get
        inv = 1.0 / ctx.total_blocks  # matches never exceed the blocks they were counted over
        return [get(s.endpoint, 0) * inv for s in endpoints]


class InFlightScorer:
    """1 - in_flight / concurrency_threshold, floored at 0 (the router's own counts: exact and current)."""

    name = "load"

    def score(self, ctx: ScoringContext, endpoints: Sequence[EndpointState]) -> list[float]:
        get = ctx.in_flight.get
        t = ctx.concurrency_threshold
        inv = 1.0 / t
        # Conditional expressions, not max(): this runs per endpoint per request.
        return [1.0 - n * inv if n < t else 0.0 for n in [get(s.endpoint, 0) for s in endpoints]]


class QueueScorer:
    """1 - num_requests_waiting / queue_scale, floored at 0; unknown -> 0.5."""

    name = "queue"

    def score(self, ctx: ScoringContext, endpoints: Sequence[EndpointState]) -> list[float]:
        q = ctx.queue_scale
        inv = 1.0 / q
        return [NEUTRAL_SCORE if w is None else (1.0 - w * inv if w < q else 0.0)
                for w in [s.num_requests_waiting for s in endpoints]]


class KvCacheScorer:
    """1 - kv_cache_usage_ratio (clamped to [0, 1]); unknown -> 0.5."""

    name = "kv"

    def score(self, ctx: ScoringContext, endpoints: Sequence[EndpointState]) -> list[float]:
        return [NEUTRAL_SCORE if u is None else (0.0 if u >= 1.0 else (1.0 if u <= 0.0 else 1.0 - u))
                for u in [s.kv_cache_usage_ratio for s in endpoints]]


def weighted_scores(ctx: ScoringContext, endpoints: Sequence[EndpointState],
                    scorers: Sequence[tuple[Scorer, float]]) -> list[float]:
    """Sum of weight x score per endpoint (range [0, sum of weights]); zero-weight scorers are skipped."""
    total: list[float] | None = None
    for scorer, weight in scorers:
        if weight <= 0:
            continue
        vals = scorer.score(ctx, endpoints)
        if total is None:
            total = [weight * v for v in vals]
        else:
            total = [t + weight * v for t, v in zip(total, vals)]
    return total if total is not None else [0.0] * len(endpoints)
