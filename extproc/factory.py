"""The one place that builds a router from settings: the live service (`prefixroute extproc`, and so the
gateway and `prefixroute up`, which run it), the bench's virtual fleet (bench/virtual_run.py) and the decision
replay (bench/decision_replay.py) all call `build_router`, so they route with the same objects wired the same
way.

What it wires: the routing core (`RouterCore`: the policy, its time model, the prefix index, sessions) with
prefill tracking on (the router service releases every pick, `lifecycle.Lifecycle.released`), the KV-events
index when the settings use one (`uses_kv_events`, `new_event_index`; the caller feeds it: ZMQ subscribers
live, the fleet's events in a simulation) with its tokenization check (`KVEventIndex.note_routed`) and its
CPU-tier pricing (`tiers.attach`), and the router service
(`PoolRouter`) over the caller's `Pool` with its lifecycle listeners, its tenants, parse workers, flow control
and the other replicas (extproc/peers) with their limits: nothing is set on the router after it is built.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from prefixroute.extproc.endpoints import Pool
from prefixroute.extproc.flow.hold import flow_for
from prefixroute.extproc.flow.settings import FlowSettings
from prefixroute.extproc.kv_events import KVEventIndex, tiers
from prefixroute.extproc.kv_events.tiers import TieredKVEventIndex
from prefixroute.extproc.lifecycle_listeners import PeerPublisher
from prefixroute.extproc.parse_offload import ParseOffload
from prefixroute.extproc.peers.settings import PeerSettings
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.service import PoolRouter
from prefixroute.extproc.tenants import Tenants
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
                 clock: Callable[[], float] = time.monotonic, tenants: Tenants | None = None,
                 offload: ParseOffload | None = None, flow: FlowSettings | None = None,
                 flow_tick_s: float = 0.05, flow_stale_after_s: float = 1.0,
                 peers: Callable[[PoolRouter], PeerPublisher] | None = None,
                 peer_settings: PeerSettings | None = None) -> PoolRouter:
    """The router service for `routing` over `pool`, complete. `event_index`: the KV-events index the caller
    feeds (None: no events), matched for `event_endpoints` from the start (more later:
    ``router.core.set_event_endpoints``). `clock`: monotonic seconds for the time model and the Responses
    directory (a simulation's virtual clock). `tenants`: who sent each request (default: no table, no tenant
    header trusted). `offload`: the parse workers for large bodies (None: every body on the loop). `flow`: flow
    control's settings when it is on (None or ``flow_control`` off: every request routed at once), re-reading
    the pool every `flow_tick_s` (its scrape interval) and trusting scrapes younger than `flow_stale_after_s`.
    `peers`: builds the publisher to the other replicas over the router (the NATS bus), applied within
    `peer_settings`' limits."""
    core = RouterCore(routing, track_prefill=True, event_index=event_index,
                      note_routed=event_index.note_routed if event_index is not None else None)
    if event_index is not None and event_endpoints:
        core.set_event_endpoints(event_endpoints)
    tiers.attach(event_index, core)  # CPU-tier blocks priced with the prefix policy's time model
    hold = flow_for(flow, tick_s=flow_tick_s, stale_after_s=flow_stale_after_s) \
        if flow is not None and flow.flow_control else None
    return PoolRouter(core, pool, clock=clock, tenants=tenants, offload=offload, flow=hold, peers=peers,
                      peer_settings=peer_settings)
