"""The one place that builds a router from settings: the live service (`prefixroute extproc`, and so the
gateway and `prefixroute up`, which run it), the bench's virtual fleet (bench/virtual_run.py) and the decision
replay (bench/decision_replay.py) all call `build_router`, so they route with the same objects wired the same
way.

What it wires: the routing core (`RouterCore`: the policy, its time model, the prefix index, sessions) with
prefill tracking on (the router service releases every pick, `lifecycle.Lifecycle.released`), the KV-events
index when the settings use one (`uses_kv_events`, `new_event_index`; the caller feeds it: ZMQ subscribers
live, the fleet's events in a simulation) with its tokenization check (`KVEventIndex.note_routed`) and its
CPU-tier pricing (`tiers.attach`), and the router service
(`PoolRouter`) over the caller's `Pool` with its lifecycle listeners. `share_with_peers` adds the other
replicas (extproc/peers) with their limits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from prefixroute.extproc.endpoints import Pool
from prefixroute.extproc.kv_events import KVEventIndex, tiers
from prefixroute.extproc.kv_events.tiers import TieredKVEventIndex
from prefixroute.extproc.lifecycle_listeners import PeerPublisher
from prefixroute.extproc.peers.settings import PeerSettings
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.service import PoolRouter
from prefixroute.types import EndpointId


def uses_kv_events(routing: RoutingSettings) -> bool:
    """Whether the router matches requests against the servers' KV events: only with token blocks (a
    tokenizer) and an index source that takes them (auto, events)."""
    return bool(routing.tokenizer) and routing.index_source in ("auto", "events")


def new_event_index(routing: RoutingSettings) -> TieredKVEventIndex:
    """The KV-events index a router with `routing` matches against (`uses_kv_events`): tier-aware, its CPU-tier
    blocks priced at ``kv_cpu_load_us_per_token`` (extproc/kv_events/tiers.py)."""
    return TieredKVEventIndex(routing.kv_block_tokens, routing.kv_cpu_load_us_per_token)


def build_router(routing: RoutingSettings, pool: Pool, *, event_index: KVEventIndex | None = None,
                 event_endpoints: Sequence[EndpointId] = (),
                 clock: Callable[[], float] = time.monotonic) -> PoolRouter:
    """The router service for `routing` over `pool`. `event_index`: the KV-events index the caller feeds (None:
    no events), matched for `event_endpoints` from the start (more later: ``router.core.set_event_endpoints``).
    `clock`: monotonic seconds for the time model and the Responses directory (a simulation's virtual clock)."""
    core = RouterCore(routing, track_prefill=True, event_index=event_index,
                      note_routed=event_index.note_routed if event_index is not None else None)
    if event_index is not None and event_endpoints:
        core.set_event_endpoints(event_endpoints)
    tiers.attach(event_index, core)  # CPU-tier blocks priced with the prefix policy's time model
    return PoolRouter(core, pool, clock=clock)


def share_with_peers(router: PoolRouter, publisher: PeerPublisher, settings: PeerSettings) -> None:
    """`router` tells the other replicas its picks through `publisher` (the NATS bus) and applies theirs within
    `settings`' limits (TTLs, in-flight counts per replica)."""
    router.peers = publisher
    router.peer_pending_ttl_s = settings.pending_ttl_s
    router.peer_in_flight_ttl_s = settings.in_flight_ttl_s
    router.peer_timeout_s = settings.peer_timeout_s
    router.max_in_flight_per_peer = settings.max_in_flight_per_peer
