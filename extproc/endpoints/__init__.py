"""The endpoint pool: membership, health (active probes + passive failures), name resolution, model lists, load
metrics (Prometheus scrape of vLLM/SGLang names) and the router's in-flight counts. I/O lives here, not in
routing/.

`Pool` is the interface the router service (`extproc.service.PoolRouter`) depends on. Two implementations:
`pool.EndpointPool` (live: HTTP probes and scrapes, DNS) and `bench.sim_pool.SimulatedPool` (the same contract
over a virtual-time fleet), so a simulation runs the live router's code path.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from typing import Protocol

from prefixroute.types import EndpointId, EndpointState

Listener = Callable[[tuple[EndpointState, ...]], None]


class Pool(Protocol):
    """What the router reads and reports. Single event loop (or single-threaded simulation); not thread-safe.

    Contract shared by the implementations:
    - `snapshot()` is O(1) and returns a tuple of immutable `EndpointState` in the configured order; it is
      replaced whole when something changes and is the same object until then (the scheduler memoises per
      snapshot identity). Load figures may be up to one scrape interval old, like a live scrape's.
    - A healthy state always has an ``address``; only healthy endpoints are routed to. A healthy state with
      ``panic`` set fails its probes and is routed only because the pool is in panic mode (too few endpoints
      pass theirs: the live pool's `healthy_panic_threshold_ratio`); a pool without panic mode never sets it.
    - Listeners (`add_listener`) are called with the new snapshot on every *structural* change (membership,
      health, models, KV capacity, address), never on a load-figure-only change.
    - `in_flight` counts the router's own picks: `acquire` at the pick, `release` when the response ends;
      never negative.
    - ``EndpointState.restart_epoch`` goes up when the implementation detects that the endpoint restarted
      (its KV cache is empty); that is a structural change. A pool that cannot tell leaves it at 0.
    """

    adapters: Container[str] | None
    """LoRA adapter names the endpoints serve, a live set (None: this pool does not list adapters; requests are
    then parsed without adapter names)."""

    def snapshot(self) -> tuple[EndpointState, ...]:
        """The current states (see the class contract)."""

    @property
    def in_flight(self) -> Mapping[EndpointId, int]:
        """Requests picked and not yet finished, per endpoint (a live read-only view)."""

    @property
    def endpoints(self) -> tuple[EndpointId, ...]:
        """The configured endpoints, in order."""

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(snapshot)` now and after each structural change; listeners must be quick."""

    def acquire(self, endpoint: EndpointId) -> None:
        """A request was sent to `endpoint`."""

    def release(self, endpoint: EndpointId) -> None:
        """A request to `endpoint` ended (response done, failed or cancelled)."""

    def report_failure(self, endpoint: EndpointId) -> None:
        """Passive failure reported by the gateway (connect refused/reset). The live pool treats it as a
        suspicion and marks the endpoint down only when its own probe confirms (a report may be forged);
        the simulated pool, whose reports only come from its own simulation, marks it down at once."""
