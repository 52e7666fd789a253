"""`prefixroute extproc`: run the ext_proc routing service that Envoy calls.

Prints one ready line (``prefixroute extproc ready on HOST:PORT (..., index events x3 (2 live, 1 undecodable) +
feedback, ..., metrics http://HOST:PORT/metrics)``) once it serves and its KV-event subscribers have replayed
their publishers' buffers (at most `EVENTS_SETTLE_S`; extproc/kv_events/link.py); SIGTERM or SIGINT stops it cleanly (in-flight gRPC streams get a short grace period, the
pool's probes are cancelled, queued spans are flushed for up to 2 s).

Telemetry (RouterTelemetrySettings, telemetry/router.py): one OTLP span per routed request,
exported in the background per the standard ``OTEL_*`` variables (or --otlp-endpoint), and Prometheus
/metrics on --metrics-port.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Callable

from prefixroute import settings
from prefixroute.extproc.exchange import RECORDS_MISSING_BACKOFF_S, STREAM_END_RELEASE_AFTER_S, FactsWaits
from prefixroute.extproc.envoy_facts import FactsCollector, FactsReceiver
from prefixroute.extproc.endpoints.discovery import DnsDiscovery, discovery_from_settings
from prefixroute.extproc.endpoints.metrics import PoolHealthCollector
from prefixroute.extproc.endpoints.pool import EndpointPool, event_addresses_from_settings
from prefixroute.extproc.endpoints.scrape import event_addresses
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.server import (ExtprocSettings, check_exposure, new_event_loop, resolved_auth_token,
                                        server_credentials, start_authz_http, start_health_server, start_server)
from prefixroute.extproc.kv_events import KVEventIndex, KVEventsManager
from prefixroute.extproc.kv_events.link import KVEventsLink
from prefixroute.extproc.peers.bus import PeerBus, PeersCollector
from prefixroute.extproc.peers.settings import PeerSettings
from prefixroute.extproc.parse_offload import ParseOffload
from prefixroute.extproc.response_directory import ResponsesCollector
from prefixroute.extproc.factory import build_router, new_event_index, uses_kv_events
from prefixroute.extproc.flow.metrics import FlowCollector
from prefixroute.extproc.flow.settings import FlowSettings
from prefixroute.extproc.tenants import Tenants, TenantSettings
from prefixroute.extproc.tracking import RequestTracker
from prefixroute.extproc.service import PoolRouter
from prefixroute.extproc.routing.conversations import ConversationsCollector
from prefixroute.extproc.routing.sessions import SessionsCollector
from prefixroute.extproc.routing.text_hash_cache import PromptHashCachesCollector
from prefixroute.extproc.lifecycle_listeners import TierPredictionCollector
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing.tokens import PromptHasher, TokenizerLoadError
from prefixroute.procs import return_large_blocks
from prefixroute.telemetry.router import RouterTelemetry, RouterTelemetrySettings

READY_PREFIX = "prefixroute extproc ready on "
EVENTS_SETTLE_S = 3.0
"""How long the ready line waits for the KV-event subscribers to replay their publishers' buffers (late join:
the first requests then route by events; a publisher that does not answer is reported as it is)."""
log = logging.getLogger("prefixroute.extproc")


def readiness(pool: EndpointPool, routing: RoutingSettings, events: KVEventsLink) -> Callable[[], bool]:
    """The picker can route (the gRPC health service's readiness, health.py): at least one endpoint is healthy,
    and with ``--index-source events`` (events the only prefix source) the KV-events index is connected to at
    least one endpoint. Cheap: one pass over the pool's snapshot (and the events link's figures)."""
    events_only = routing.index_source == "events"

    def ready() -> bool:
        if not any(st.healthy for st in pool.snapshot()):
            return False
        return not events_only or any(d.get("events_state") == "live" for d in events.info.values())

    return ready


HELP_ESSENTIALS = (
    "port", "listen_address", "protocol", "tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_token_file",
    "allow_unauthenticated", "health_port",  # where Envoy reaches it, and who may
    "policy", "index_source", "tokenizer",  # how it routes
    "endpoints", "endpoints_file", "endpoints_dns", "kv_events_port_offset",  # where the model servers are
    "metrics_port", "metrics_host", "traces", "otlp_endpoint",  # telemetry
    "url", "flow_control", "tenants_file",  # --peers-url (other replicas), the queue, tenants
)
"""The settings `prefixroute extproc --help` lists (a router run behind an Envoy of one's own); --help-all
lists all of them."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, ExtprocSettings)
    settings.add_arguments(parser, RoutingSettings)
    settings.add_arguments(parser, PoolSettings)
    settings.add_arguments(parser, RouterTelemetrySettings)
    settings.add_arguments(parser, PeerSettings)
    settings.add_arguments(parser, FlowSettings)
    settings.add_arguments(parser, TenantSettings)
    settings.essential_help(parser, HELP_ESSENTIALS)


def tenants_from_settings(tenant_settings: TenantSettings, routing: RoutingSettings, flow: FlowSettings) -> Tenants:
    """Who sent each request (extproc/tenants.py), with each role's header as the settings name it. Raises
    ValueError (or OSError) for a tenant table that cannot be read."""
    return Tenants(tenant_settings, tenant_header=routing.tenant_header, priority_header=flow.priority_header,
                   objective_header=flow.objective_header, fairness_header=flow.fairness_header)


async def serve(ext: ExtprocSettings, routing: RoutingSettings, pool_settings: PoolSettings,
                stop: asyncio.Event, tele: RouterTelemetrySettings | None = None,
                peer_settings: PeerSettings | None = None, flow_settings: FlowSettings | None = None,
                tenants: Tenants | None = None) -> None:
    """Run until `stop` is set. `peer_settings` with a url: share picks with the other replicas over NATS.
    `tenants`: where requests' tenant, priority and flow come from (default: no table, the fairness header
    trusted alone)."""
    pool = EndpointPool(pool_settings)
    # --endpoints-dns: the first lookup round gives the starting membership; later rounds follow pods.
    static = pool.endpoints
    discovery = discovery_from_settings(pool_settings, lambda _: None, static=static)
    if discovery is not None:
        await discovery.refresh()
        pool.set_endpoints(discovery.endpoints)
    # KV events: only when requests are matched by token blocks (a tokenizer) and the source allows them.
    use_events = uses_kv_events(routing)
    static_addresses = event_addresses_from_settings(pool_settings) if use_events else {}

    def addresses_of(endpoints: list[str]) -> dict[str, tuple[str, str | None]]:
        """Event addresses: listed ones as configured, discovered ones at their port + kv_events_port_offset."""
        found = [ep for ep in endpoints if ep not in static]
        return {**{ep: a for ep, a in static_addresses.items() if ep in endpoints}, **(event_addresses(
            found, pool_settings.kv_events_port_offset, pool_settings.kv_events_replay_port_offset)
            if use_events else {})}

    addresses = addresses_of(list(pool.endpoints))
    discovers_events = discovery is not None and use_events and pool_settings.kv_events_port_offset > 0
    event_index = new_event_index(routing) if addresses or discovers_events else None
    flow = flow_settings or FlowSettings(flow_control=False)
    # Large bodies parsed off the event loop; flow control holds, orders and sheds past saturation
    # (extproc/flow; prefixroute_flow_* on /metrics); the bus shares picks with the other replicas.
    offload = ParseOffload(routing) if routing.parse_workers else None
    share = peer_settings is not None and bool(peer_settings.url)
    router = build_router(routing, pool, event_index=event_index,
                          tenants=tenants or tenants_from_settings(TenantSettings(), routing, flow),
                          offload=offload, flow=flow, flow_tick_s=pool_settings.scrape_interval_s,
                          flow_stale_after_s=pool_settings.metrics_stale_after_s,
                          peers=(lambda r: PeerBus(peer_settings, r)) if share else None, peer_settings=peer_settings)
    core = router.core
    log.info("%s", core.memory.describe())
    if offload is not None:
        offload.start()
    manager = None
    if event_index is not None:
        manager = KVEventsManager(event_index, topic=pool_settings.kv_events_topic,
                                  on_cleared=lambda ep, reason: log.info("KV events of %s: index cleared (%s)",
                                                                         ep, reason),
                                  on_state=lambda ep, state: events.on_state(ep, state))
    events = KVEventsLink(core, manager, addresses, pool.snapshot)
    telemetry, tracker = _telemetry_for(router, pool, event_index, events, routing, tele)
    if router.flow is not None:
        telemetry.metrics.registry.register(FlowCollector(router.flow.gate.control))
    bus = _peer_bus(router, telemetry)
    await pool.start()
    events.start([str(ep) for ep in pool.endpoints])
    pool.add_listener(events.on_pool_change)  # an endpoint failing its probes leaves `live` at once
    if bus is not None:
        await bus.start()  # connects in the background: NATS down at start is no reason not to serve
    if discovery is not None:
        def on_membership(endpoints: list[str]) -> None:
            pool.set_endpoints(endpoints)
            events.update(endpoints, addresses_of(endpoints) if event_index is not None else {})

        discovery.on_change = on_membership
        discovery.start()
    try:
        all_up = await pool.wait_ready(ext.ready_timeout_s)
        await events.wait_settled(EVENTS_SETTLE_S)
        # Startup objects (modules, protobuf descriptors, settings) never die: move them out of the GC's view,
        # and collect young objects less often, so collections are rarer and shorter (tail latency).
        gc.collect()
        gc.freeze()
        gc.set_threshold(20_000, 20, 100)
        ready = readiness(pool, routing, events)
        # The HTTP check's picks end with their facts records; with ext_proc alone every pick ends with its stream.
        picks = (FactsWaits(router.release, tracker.routing_closed, ext.authz_release_after_s)
                 if ext.authz_http_port >= 0 else None)
        facts = FactsReceiver(tracker, router.served, early_first_token=ext.facts_first_token == "early",
                              unary_picks=picks, ended_picks=FactsWaits(
                                  router.release, tracker.routing_closed, STREAM_END_RELEASE_AFTER_S,
                                  missing_backoff_s=RECORDS_MISSING_BACKOFF_S))
        telemetry.metrics.registry.register(FactsCollector(facts))
        can_hold = router.flow is not None
        server, port = await start_server(router, ext, tracker, ready=ready, max_body_bytes=routing.max_body_bytes,
                                          can_hold=can_hold, facts=facts)
        health_server = await start_health_server(ext, ready)
        authz_http = await start_authz_http(router, ext, tracker, facts=facts, ready=ready,
                                            max_body_bytes=routing.max_body_bytes, can_hold=can_hold)
        print(_ready_line(ext, routing, router, port, pool, telemetry, events, bool(addresses), bus, all_up,
                          authz_http[1] if authz_http is not None else None), flush=True)
        await stop.wait()
        if authz_http is not None:
            authz_http[0].close()
        if health_server is not None:
            await health_server.stop(grace=None)
        await server.stop(grace=1.0)
    finally:
        await _shutdown(router, pool, events, telemetry, discovery, bus)


async def _shutdown(router: PoolRouter, pool: EndpointPool, events: KVEventsLink, telemetry: RouterTelemetry,
                    discovery: DnsDiscovery | None, bus: PeerBus | None) -> None:
    """Close what `serve` started, the network first, the telemetry flush last."""
    if discovery is not None:
        await discovery.close()
    await events.close()
    if bus is not None:
        await bus.close()
    await router.lookup.close()
    if router.offload is not None:
        router.offload.close()
    await pool.close()
    # Off the loop: flushing waits on the exporter (bounded), the loop must not stall meanwhile.
    await asyncio.get_running_loop().run_in_executor(None, telemetry.close, 2.0)


def _peer_bus(router: PoolRouter, telemetry: RouterTelemetry) -> PeerBus | None:
    """The replica's bus to the others (NATS), with its figures on /metrics; None when it routes alone."""
    bus = router.peers
    if not isinstance(bus, PeerBus):
        return None
    learner = router.core.learner
    telemetry.metrics.registry.register(PeersCollector(bus, learner.num_peer_picks if learner else lambda: 0,
                                                       router.num_peer_in_flight,
                                                       lambda: router.num_ignored_peer_messages))
    return bus


def _telemetry_for(router: PoolRouter, pool: EndpointPool, event_index: KVEventIndex | None, events: KVEventsLink,
                   routing: RoutingSettings, tele: RouterTelemetrySettings | None
                   ) -> tuple[RouterTelemetry, RequestTracker]:
    """The router's telemetry (metrics, traces, records) and the tracker of its streams. The tracker feeds the
    router's own learning (first tokens, usages, response ids) whether or not telemetry exports anything."""
    core = router.core
    telemetry = RouterTelemetry.from_settings(tele or RouterTelemetrySettings(metrics_port=-1),
                                              in_flight=lambda: pool.in_flight,
                                              index_size=lambda: {**core.index.num_entries_by_endpoint(), **(
                                                  event_index.num_blocks_by_endpoint() if event_index else {})},
                                              endpoint_states=pool.snapshot,
                                              time_model=core.learner.time_model_figures
                                              if core.learner is not None else None,
                                              index_info=lambda: events.info)
    tracker = RequestTracker(telemetry.on_decision, telemetry.on_response, router.endpoint_of,
                             max_body_bytes=routing.max_body_bytes, on_first_token=router.first_token,
                             on_usage=router.usage, on_response_id=router.learn_response,
                             propagate=bool(telemetry.recorder.enabled))
    # Responses API: the response-id directory and its lookups on /metrics (prefixroute_response_*).
    telemetry.metrics.registry.register(ResponsesCollector(router.responses, router.lookup))
    if core.sessions is not None:  # chat sessions (prefixroute_sessions*), when the policy keeps them
        telemetry.metrics.registry.register(SessionsCollector(core.sessions))
    conversations = getattr(core.scheduler.policy, "conversations", None)
    if conversations is not None:  # conversations and the load they are priced at (prefixroute_conversation*)
        telemetry.metrics.registry.register(ConversationsCollector(
            conversations.table, lambda: conversations.model.utilizations(router.clock())))
    # The pool's health judgement: probes by outcome, ejections, panic mode, the loop's lag (prefixroute_pool_*, ...).
    telemetry.metrics.registry.register(PoolHealthCollector(pool))
    # The prompt-hashing caches' hits and misses (prefixroute_prompt_hash_cache_*).
    telemetry.metrics.registry.register(PromptHashCachesCollector(router.text_cache, router.hasher))
    if router.tier_prediction is not None:  # the hit prediction by KV tier (prefixroute_predicted_tier_hit_tokens)
        telemetry.metrics.registry.register(TierPredictionCollector(router.tier_prediction))
    return telemetry, tracker


def _ready_line(ext: ExtprocSettings, routing: RoutingSettings, router: PoolRouter, port: int,
                pool: EndpointPool, telemetry: RouterTelemetry, events: KVEventsLink, has_event_addresses: bool,
                bus: PeerBus | None, all_up: bool, authz_http_port: int | None = None) -> str:
    """The one line that says the replica serves (`READY_PREFIX`; launchers wait for it)."""
    core_source = router.core.sourced.own_source
    healthy = sum(1 for s in pool.snapshot() if s.healthy)
    ms = telemetry.metrics_server
    metrics = f"http://{ms.server_address[0]}:{ms.server_address[1]}/metrics" if ms is not None else "off"
    index = f"index events {events.summary()} + {core_source}" if has_event_addresses else f"index {core_source}"
    peers = f", peers {bus.replica_id} via {bus.settings.url}" if bus is not None else ""
    http = f", ext_authz HTTP on port {authz_http_port}" if authz_http_port is not None else ""
    return (f"{READY_PREFIX}{ext.listen_address}:{port} (policy {routing.policy}{peers}{http}, {index}, "
            f"{healthy}/{len(pool.endpoints)} endpoints healthy{'' if all_up else ', still probing'}, "
            f"metrics {metrics}, traces {'on' if telemetry.recorder.enabled else 'off'}"
            f"{': ' + telemetry.recorder.disabled_reason if telemetry.recorder.disabled_reason else ''})")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Request bodies of megabytes must not stay in the heap once freed (routing/memory.py: the budget).
    return_large_blocks()
    try:
        ext = settings.from_namespace(ExtprocSettings, args)
        routing = settings.from_namespace(RoutingSettings, args)
        pool_settings = settings.from_namespace(PoolSettings, args)
        tele = settings.from_namespace(RouterTelemetrySettings, args)
        peer_settings = settings.from_namespace(PeerSettings, args)
        flow_settings = settings.from_namespace(FlowSettings, args)
        tenants = tenants_from_settings(settings.from_namespace(TenantSettings, args), routing, flow_settings)
        # Validate endpoints, TLS files, the token and the tokenizer before starting anything (exit 2).
        EndpointPool(pool_settings)
        event_addresses_from_settings(pool_settings)
        discovery_from_settings(pool_settings, lambda _: None)
        PromptHasher.from_settings(routing)
        server_credentials(ext)
        resolved_auth_token(ext)
        check_exposure(ext)  # an address others reach, with no way to tell Envoy from them: refused (exit 2)
    except (ValueError, OSError, TokenizerLoadError) as exc:
        print(f"prefixroute extproc: {exc}", file=sys.stderr)
        return 2
    loop = new_event_loop(ext.uvloop)
    asyncio.set_event_loop(loop)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        loop.run_until_complete(serve(ext, routing, pool_settings, stop, tele, peer_settings, flow_settings,
                                      tenants))
    except OSError as exc:
        print(f"prefixroute extproc: {exc}", file=sys.stderr)
        return 1
    finally:
        loop.close()
    return 0
