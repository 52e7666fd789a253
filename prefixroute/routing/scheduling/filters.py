"""Filters: which endpoints may take a request. Each keeps the input order (the pool's configured order)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prefixroute.routing.types import EndpointId, EndpointState


def serves_model(state: EndpointState, model: str | None) -> bool:
    """True when `state` may serve `model`: no model asked, models unknown (empty), or listed."""
    return model is None or not state.models or model in state.models


def filter_model(endpoints: Sequence[EndpointState], model: str | None) -> list[EndpointState]:
    """Endpoints that serve `model` (healthy or not): decides 404 vs 503 in the router."""
    if model is None:
        return list(endpoints)
    return [s for s in endpoints if not s.models or model in s.models]


def filter_healthy(endpoints: Sequence[EndpointState]) -> list[EndpointState]:
    return [s for s in endpoints if s.healthy]


def eligible(endpoints: Sequence[EndpointState], model: str | None) -> list[EndpointState]:
    """Healthy endpoints that serve `model`: the candidates every policy chooses from."""
    if model is None:
        return [s for s in endpoints if s.healthy]
    return [s for s in endpoints if s.healthy and (not s.models or model in s.models)]


def split_threshold(endpoints: Sequence[EndpointState], in_flight: Mapping[EndpointId, int],
                    threshold: int) -> tuple[list[EndpointState], list[EndpointState]]:
    """(under, at_or_over) the concurrency threshold of in-flight requests, order kept."""
    if not in_flight or max(in_flight.values()) < threshold:  # the common case, checked at C speed
        return list(endpoints), []
    get = in_flight.get
    under = [s for s in endpoints if get(s.endpoint, 0) < threshold]
    if len(under) == len(endpoints):  # the common case: nobody is at the threshold
        return under, []
    return under, [s for s in endpoints if get(s.endpoint, 0) >= threshold]
