"""The saturation detector: can some endpoint start a request soon? Pure: the caller hands it one
`EndpointLoad` per endpoint of the pool, built from the time model and the last scrape.

An endpoint has room when all of its known signals are under their bounds:

- ``queued_s``: the time model's predicted queueing there (the prefill ahead of a new request, in seconds at
  the endpoint's learned rate, decoding load included) under ``max_queued_s``;
- ``num_waiting``: the server's own waiting count (``vllm:num_requests_waiting``) under ``max_waiting``
  (GIE's detector: queue depth 5);
- ``kv_usage_ratio``: the server's KV-cache usage (``vllm:kv_cache_usage_perc``, 0-1) under ``max_kv_usage_ratio``
  (GIE: 0.8).

A scraped figure that is unknown (None: never scraped, or stale) is left out, as the time model's figure always
exists. An endpoint with nothing in flight (``num_in_flight`` 0: the router's own count) has room whatever the
other figures say: an idle engine can start a request now, so a stale or wrong figure (a pending entry whose
first token was never reported, a KV figure stuck high) can never hold requests in front of an idle fleet. The pool is saturated when no healthy endpoint has room; the signal is the least loaded healthy
endpoint's largest figure over its bound (>= 1: saturated; 0: idle), so it is one number for /metrics. With no
healthy endpoint the signal is infinite and `Saturation.num_healthy` is 0 (the answer to a shed is then 503).

Contract: below saturation (`saturated` False) the gate never holds a request.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from prefixroute.types import EndpointId


BOUND_QUEUED, BOUND_WAITING, BOUND_KV = "queued_s", "num_waiting", "kv_usage"
"""The detector's bounds, as /metrics names them (``prefixroute_flow_held_by_bound_total{bound}``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class EndpointLoad:
    """One endpoint's load now. ``queued_s`` >= 0 from the time model; ``num_waiting`` and ``kv_usage_ratio``
    from its last fresh scrape, None when unknown; ``healthy`` False for an endpoint the pool will not pick;
    ``num_in_flight`` the router's requests in flight there (None: unknown)."""

    endpoint: EndpointId
    queued_s: float
    num_waiting: int | None = None
    kv_usage_ratio: float | None = None
    healthy: bool = True
    num_in_flight: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Saturation:
    """The detector's answer: ``signal`` (>= 0; >= 1 saturated, inf with no healthy endpoint), ``num_healthy``
    and ``num_with_room`` (endpoints whose figures are all under their bounds)."""

    signal: float
    num_healthy: int
    num_with_room: int
    bound: str | None = None
    """Which bound gives the signal (``queued_s``, ``num_waiting`` or ``kv_usage``: the least loaded healthy
    endpoint's largest figure), None with no healthy endpoint: what holds a request when saturated."""

    @property
    def saturated(self) -> bool:
        return self.num_with_room == 0


@dataclasses.dataclass(frozen=True, slots=True)
class SaturationDetector:
    """Bounds (module docstring): each > 0; a bound of inf turns its signal off."""

    max_queued_s: float = 0.25
    max_waiting: float = 5.0
    max_kv_usage_ratio: float = 0.8

    def __post_init__(self) -> None:
        if not (self.max_queued_s > 0 and self.max_waiting > 0 and self.max_kv_usage_ratio > 0):
            raise ValueError("saturation bounds must be > 0")

    def load_ratio(self, load: EndpointLoad) -> float:
        """`load`'s largest figure over its bound (< 1: room; 0 for an endpoint with nothing in flight)."""
        if load.num_in_flight == 0:
            return 0.0
        ratio = max(0.0, load.queued_s) / self.max_queued_s
        if load.num_waiting is not None:
            ratio = max(ratio, load.num_waiting / self.max_waiting)
        if load.kv_usage_ratio is not None:
            ratio = max(ratio, load.kv_usage_ratio / self.max_kv_usage_ratio)
        return ratio

    def load_bound(self, load: EndpointLoad) -> tuple[float, str]:
        """`load_ratio` and the bound it comes from (``queued_s``, ``num_waiting`` or ``kv_usage``)."""
        if load.num_in_flight == 0:
            return 0.0, BOUND_QUEUED
        ratio, bound = max(0.0, load.queued_s) / self.max_queued_s, BOUND_QUEUED
        if load.num_waiting is not None and load.num_waiting / self.max_waiting > ratio:
            ratio, bound = load.num_waiting / self.max_waiting, BOUND_WAITING
        if load.kv_usage_ratio is not None and load.kv_usage_ratio / self.max_kv_usage_ratio > ratio:
            ratio, bound = load.kv_usage_ratio / self.max_kv_usage_ratio, BOUND_KV
        return ratio, bound

    def detect(self, loads: Iterable[EndpointLoad]) -> Saturation:
        signal = math.inf
        num_healthy = num_with_room = 0
        bound = None
        for load in loads:
            if not load.healthy:
                continue
            num_healthy += 1
            r, b = self.load_bound(load)
            if r < 1.0:
                num_with_room += 1
            if r < signal:
                signal, bound = r, b
        return Saturation(signal, num_healthy, num_with_room, bound)
