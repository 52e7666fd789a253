"""`SimulatedPool`: the live endpoint pool's interface (`prefixroute.extproc.endpoints.Pool`) over a
`VirtualFleet`, in virtual time, so the live router service (`extproc.service.PoolRouter`) routes a simulation.

What it reproduces of the live `EndpointPool` (extproc/endpoints/pool.py), with the same `PoolSettings`:
- scrapes: every server is scraped each ``scrape_interval_s`` of virtual time (lengthened to keep the pool
  within ``max_scrapes_per_s``, as live), each at its own seeded random phase, so the router decides on load
  figures up to one interval old, as a live router does. A scrape reads what the server's ``/metrics`` shows
  (`model_servers.metrics.render` reads the same engine fields). The snapshot is replaced only when a scrape
  finds other figures (the scheduler memoises per snapshot object), so ``scraped_at_s`` is the time of the
  last scrape that changed something.
- health, models, capacity: every server is up, serves the spec's models and reports its KV capacity from the
  start (a live pool once `wait_ready` returned and the first scrapes landed). A passive failure
  (`report_failure`) marks the endpoint down; the re-probe ``failure_probe_delay_s`` later brings it back up
  (simulated servers never fail).
- addresses: each endpoint id is its address (nothing to resolve).
- in-flight: the router's own `acquire` / `release`, as live.
- listeners: called at `add_listener` and on structural changes (health; membership and capacity never
  change in a simulation).
Not modelled: failed probes or scrapes (so no staleness), membership changes, name resolution.

Single-threaded, driven by the fleet's clock (`VirtualFleet.call_at`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
from collections.abc import Mapping

from prefixroute.extproc.endpoints import Listener
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.types import EndpointId, EndpointState
from prefixroute.model_servers.virtual_fleet import VirtualFleet

log = logging.getLogger(__name__)


class SimulatedPool:
    """A `Pool` over `fleet` (see the module docstring). Scrapes are scheduled on the fleet at construction."""

    def __init__(self, fleet: VirtualFleet, settings: PoolSettings | None = None, *, seed: int = 0) -> None:
        """`seed` draws the scrape phases (reproducible runs)."""
        self.settings = settings or PoolSettings()
        self.adapters = None  # simulated servers serve no LoRA adapters
        self._fleet = fleet
        self._order = fleet.endpoint_ids
        n = len(self._order)
        self._healthy = [True] * n
        self._figures: list[tuple[int, int, float]] = [(-1, -1, -1.0)] * n  # last published load figures
        self._states = [self._scrape(i) for i in range(n)]
        self._snapshot = tuple(self._states)
        self._in_flight: dict[EndpointId, int] = {ep: 0 for ep in self._order}
        self._listeners: list[Listener] = []
        # The live pool's effective interval: scrape_interval_s, lengthened beyond max_scrapes_per_s.
        self.scrape_interval_s = max(self.settings.scrape_interval_s, n / self.settings.max_scrapes_per_s)
        rng = random.Random(seed)
        self._ticks = [functools.partial(self._tick, i) for i in range(n)]
        for i, tick in enumerate(self._ticks):
            fleet.call_at(fleet.now_s + rng.random() * self.scrape_interval_s, tick)

    # --- the Pool interface ------------------------------------------------------------------------------
    def snapshot(self) -> tuple[EndpointState, ...]:
        return self._snapshot

    @property
    def in_flight(self) -> Mapping[EndpointId, int]:
        return self._in_flight

    @property
    def endpoints(self) -> tuple[EndpointId, ...]:
        return self._order

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)
        listener(self._snapshot)

    def acquire(self, endpoint: EndpointId) -> None:
        self._in_flight[endpoint] += 1

    def release(self, endpoint: EndpointId) -> None:
        n = self._in_flight[endpoint]
        self._in_flight[endpoint] = n - 1 if n > 0 else 0

    def report_failure(self, endpoint: EndpointId) -> None:
        i = self._order.index(endpoint)
        if self._healthy[i]:
            log.warning("simulated endpoint %s marked down after a passive failure", endpoint)
            self._set_health(i, False)
            self._fleet.call_at(self._fleet.now_s + self.settings.failure_probe_delay_s,
                                lambda: self._set_health(i, True))

    # --- internals -------------------------------------------------------------------------------------------
    def _scrape(self, i: int) -> EndpointState:
        core = self._fleet.engines[i]
        figures = (core.num_running, core.num_waiting, core.cache.usage_ratio)
        self._figures[i] = figures
        ep = self._order[i]
        cfg = core.config
        return EndpointState(ep, healthy=self._healthy[i], models=self._fleet.models, num_requests_running=figures[0],
                             num_requests_waiting=figures[1], kv_cache_usage_ratio=figures[2],
                             num_gpu_blocks=cfg.num_gpu_blocks, block_size=cfg.block_size,
                             num_cpu_blocks=cfg.num_cpu_blocks or None,
                             prefix_cache_tokens=(float(core.stats.prefix_cache_queries),
                                                  float(core.stats.prefix_cache_hits),
                                                  float(core.stats.external_prefix_cache_hits)),
                             scraped_at_s=self._fleet.now_s, address=ep)

    def _tick(self, i: int) -> None:
        """One scrape of server i (a timer on the fleet), then the next one an interval later."""
        core = self._fleet.engines[i]
        if (core.num_running, core.num_waiting, core.cache.usage_ratio) != self._figures[i]:
            self._states[i] = self._scrape(i)
            self._snapshot = tuple(self._states)
        self._fleet.call_at(self._fleet.now_s + self.scrape_interval_s, self._ticks[i])

    def _set_health(self, i: int, healthy: bool) -> None:
        self._healthy[i] = healthy
        self._states[i] = dataclasses.replace(self._states[i], healthy=healthy)
        self._snapshot = tuple(self._states)
        for listener in self._listeners:
            listener(self._snapshot)
