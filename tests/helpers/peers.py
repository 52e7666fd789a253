"""Replicas for the peers tests: `StaticPool` (a fixed, healthy pool: what PoolRouter needs without probing) and
`replica` (a PoolRouter over it, prefill tracked as in `prefixroute extproc`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import orjson

from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.types import EndpointId, EndpointState
from prefixroute.extproc.service import PoolRouter

ENDPOINTS = tuple(EndpointId(f"10.0.0.{i}:8000") for i in range(1, 5))
POST = ("POST", "/v1/chat/completions")


class StaticPool:
    """`Pool` over fixed healthy endpoints (addresses = ids), with real in-flight accounting."""

    def __init__(self, endpoints: Sequence[EndpointId] = ENDPOINTS) -> None:
        self._snapshot = tuple(EndpointState(ep, address=str(ep)) for ep in endpoints)
        self._in_flight: dict[EndpointId, int] = {}
        self._listeners: list = []
        self.adapters = None  # no LoRA adapters

    def snapshot(self) -> tuple[EndpointState, ...]:
        return self._snapshot

    @property
    def in_flight(self) -> Mapping[EndpointId, int]:
        return self._in_flight

    @property
    def endpoints(self) -> tuple[EndpointId, ...]:
        return tuple(s.endpoint for s in self._snapshot)

    def add_listener(self, listener) -> None:  # noqa: ANN001
        self._listeners.append(listener)
        listener(self._snapshot)

    def acquire(self, endpoint: EndpointId) -> None:
        self._in_flight[endpoint] = self._in_flight.get(endpoint, 0) + 1

    def release(self, endpoint: EndpointId) -> None:
        n = self._in_flight.get(endpoint, 0) - 1
        if n > 0:
            self._in_flight[endpoint] = n
        else:
            self._in_flight.pop(endpoint, None)

    def report_failure(self, endpoint: EndpointId) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def replica(settings: RoutingSettings | None = None, clock: Clock | None = None, **wiring) -> PoolRouter:
    """A router over `StaticPool`; `wiring`: PoolRouter's own arguments (peers, offload, tenants, ...)."""
    s = settings or RoutingSettings(rng_seed=7, num_fallbacks=1)
    return PoolRouter(RouterCore(s, track_prefill=True), StaticPool(), clock=clock or Clock(), **wiring)


def chat(system: str, user: str) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "system", "content": system},
                                                    {"role": "user", "content": user}]})


class Wire:
    """The peers bus without NATS: collects what a replica publishes (`publish`), delivered by `deliver`."""

    def __init__(self, origin: tuple[str, int]) -> None:
        self.origin = origin
        self.messages: list = []

    def publish(self, message) -> None:  # noqa: ANN001
        self.messages.append(message)

    def deliver(self, to: PoolRouter) -> None:
        msgs, self.messages = self.messages, []
        to.apply_peer_batch(self.origin, msgs, to.clock())
