"""The clusters: the picked endpoint (a composite of ORIGINAL_DST clusters, one per fallback header), the ext_proc
replicas (least request, outlier detection and gRPC health checks when there are several), the routing-unavailable
cluster without endpoints, and the fail-open round-robin pool."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from envoy_data_plane.envoy.config.cluster.v3 import (CircuitBreakers, CircuitBreakersThresholds, Cluster,
                                                      ClusterCustomClusterType, ClusterDiscoveryType, ClusterLbPolicy,
                                                      ClusterOriginalDstLbConfig, OutlierDetection)
from envoy_data_plane.envoy.config.core.v3 import Http2ProtocolOptions, RoutingPriority
from envoy_data_plane.envoy.config.core.v3 import HttpProtocolOptions as CoreHttpProtocolOptions
from envoy_data_plane.envoy.config.core.v3 import (HealthCheck, HealthCheckGrpcHealthCheck, HealthCheckHttpHealthCheck,
                                                   Http1ProtocolOptions)
from envoy_data_plane.envoy.config.endpoint.v3 import ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints
from envoy_data_plane.envoy.extensions.clusters.composite.v3 import ClusterConfig as CompositeClusterConfig
from envoy_data_plane.envoy.extensions.clusters.composite.v3 import ClusterConfigClusterEntry
from envoy_data_plane.envoy.extensions.transport_sockets.tls.v3 import Secret
from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (HttpProtocolOptions,
                                                                 HttpProtocolOptionsExplicitHttpConfig)
from envoy_data_plane.google.protobuf import Any as ProtoAny

from prefixroute.extproc.envoy_config.auth import credential_filters, extproc_transport_socket
from prefixroute.extproc.envoy_config.common import (AUTHZ_HTTP_CLUSTER, EXTPROC_CLUSTER, EXTPROC_REPLICA_CLUSTER_PREFIX,
                                                     PICKED_CLUSTER, POOL_CLUSTER, UNAVAILABLE_CLUSTER, address,
                                                     authz_http_addresses, duration)
from prefixroute.extproc.envoy_config.envoy_settings import EnvoySettings
from prefixroute.extproc.headers import AUTHZ_TOKEN_HEADER, route_headers

AUTHZ_HTTP_IDLE_TIMEOUT_S = 60.0
"""Envoy closes a connection to a replica's check port after this long without a check: half the router's idle
timeout for trusted connections (extproc/authz_http.py IDLE_TIMEOUT_S), so the router never closes one Envoy may be
sending a check on (which would fail that request over to Envoy's failure mode). Envoy's default is an hour."""


def gateway_clusters(s: EnvoySettings, replicas: Sequence[str], token_secret: Secret | None,
                     records_cluster: Cluster | None) -> list[Cluster]:
    """Every cluster, in the order of the rendered configuration: picked endpoint (and its sub-clusters), ext_proc
    (and one per replica for the observing streams), routing unavailable, records, round-robin pool."""
    clusters: list[Cluster] = []
    if s.extproc_enabled:
        sub = [original_dst_cluster(f"{PICKED_CLUSTER}_{i}", h, s.connect_timeout_s, s.connection_buffer_bytes)
               for i, h in enumerate(route_headers(s.num_fallbacks))]
        clusters.append(Cluster(
            name=PICKED_CLUSTER,
            connect_timeout=duration(s.connect_timeout_s),
            lb_policy=ClusterLbPolicy.CLUSTER_PROVIDED,
            cluster_type=ClusterCustomClusterType(name="envoy.clusters.composite", typed_config=ProtoAny.pack(
                CompositeClusterConfig(clusters=[ClusterConfigClusterEntry(name=c.name) for c in sub]))),
            circuit_breakers=circuit_breakers(),
        ))
        clusters.extend(sub)
        # Every in-flight HTTP request holds one gRPC stream (two with the observing filter): Envoy's default
        # of 1024 concurrent requests per cluster would fail requests open beyond that (hence the breakers).
        tls_socket = extproc_transport_socket(s)
        grpc_fields: dict[str, Any] = {
            **({"transport_socket": tls_socket} if tls_socket is not None else {}),
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": ProtoAny.pack(HttpProtocolOptions(
                    explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(
                        http2_protocol_options=Http2ProtocolOptions()),
                    # The token on every stream to a replica, from the secret (never initial metadata).
                    http_filters=credential_filters() if token_secret is not None else []))}}
        if len(replicas) > 1:
            # Least request: a replica busy with long streams gets fewer new ones. A replica that refuses
            # connections is ejected after two local-origin failures (its streams are retried elsewhere:
            # extproc_retry_policy) and stays out until a gRPC health check (every 0.25 s) finds it ready
            # again (extproc_health_check): a restarted replica listens only once it is ready to route.
            grpc_fields |= replica_balancing(extproc_health_check())
        clusters.append(strict_dns_cluster(EXTPROC_CLUSTER, replicas, 0.25, **grpc_fields))
        if len(replicas) > 1:
            clusters += [strict_dns_cluster(f"{EXTPROC_REPLICA_CLUSTER_PREFIX}{k}", [a], 0.25, **grpc_fields)
                         for k, a in enumerate(replicas) if s.observe_responses or s.response_facts_lua]
        if s.routing_processing == "authz-http":
            clusters.append(authz_http_cluster(s, token_secret is not None))
    if s.extproc_enabled:  # the unavailable routes' target: no endpoint, so Envoy answers 503 (mapped below)
        clusters.append(Cluster(name=UNAVAILABLE_CLUSTER, type=ClusterDiscoveryType.STATIC,
                                connect_timeout=duration(s.connect_timeout_s),
                                per_connection_buffer_limit_bytes=s.connection_buffer_bytes,
                                load_assignment=ClusterLoadAssignment(cluster_name=UNAVAILABLE_CLUSTER)))
    if records_cluster is not None:
        clusters.append(records_cluster)
    if s.endpoints and (s.failure_mode == "open" or not s.extproc_enabled):
        clusters.append(strict_dns_cluster(POOL_CLUSTER, s.endpoints, s.connect_timeout_s,
                                           lb_policy=ClusterLbPolicy.ROUND_ROBIN,
                                           per_connection_buffer_limit_bytes=s.connection_buffer_bytes))

    return clusters


def authz_http_cluster(s: EnvoySettings, with_token: bool) -> Cluster:
    """The replicas' ext_authz HTTP ports (routing_processing 'authz-http'): HTTP/1.1 kept-alive connections (closed
    after `AUTHZ_HTTP_IDLE_TIMEOUT_S` idle), the token in its own header (the check's ``authorization`` is the client's), the same TLS as the gRPC cluster; with
    several replicas the same balancing and ejection, and an HTTP health check of each one's /health (200 while it
    can route)."""
    addresses = authz_http_addresses(s)
    tls_socket = extproc_transport_socket(s, alpn=("http/1.1",))
    fields: dict[str, Any] = {
        **({"transport_socket": tls_socket} if tls_socket is not None else {}),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": ProtoAny.pack(HttpProtocolOptions(
                common_http_protocol_options=CoreHttpProtocolOptions(
                    idle_timeout=duration(AUTHZ_HTTP_IDLE_TIMEOUT_S)),
                explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(
                    http_protocol_options=Http1ProtocolOptions()),
                http_filters=credential_filters(header=AUTHZ_TOKEN_HEADER) if with_token else []))}}
    if len(addresses) > 1:
        fields |= replica_balancing(HealthCheck(
            timeout=duration(0.25), interval=duration(0.25), no_traffic_interval=duration(0.25),
            unhealthy_threshold=1, healthy_threshold=1, http_health_check=HealthCheckHttpHealthCheck(path="/health")))
    return strict_dns_cluster(AUTHZ_HTTP_CLUSTER, addresses, 0.25, **fields)


def replica_balancing(health_check: HealthCheck) -> dict[str, Any]:
    """The cluster fields of several router replicas: least request, a replica that refuses connections ejected
    after two local-origin failures, back once `health_check` finds it ready."""
    return {
        "lb_policy": ClusterLbPolicy.LEAST_REQUEST,
        "outlier_detection": OutlierDetection(
            split_external_local_origin_errors=True, consecutive_local_origin_failure=2,
            enforcing_consecutive_local_origin_failure=100, interval=duration(0.25),
            base_ejection_time=duration(10), max_ejection_time=duration(30), max_ejection_percent=100),
        "health_checks": [health_check]}


def extproc_health_check() -> HealthCheck:
    """The replicas' health check: the picker's gRPC health service (extproc/health.py), asked for
    envoy.service.ext_proc.v3.ExternalProcessor, which is SERVING only while the replica can route (an endpoint
    healthy in its pool), so Envoy prefers the replicas that can; all not ready: Envoy's panic mode uses them all,
    and they answer 503 themselves. Exempt from the bearer token; over the cluster's TLS when it has one."""
    return HealthCheck(timeout=duration(0.25), interval=duration(0.25), no_traffic_interval=duration(0.25),
                       unhealthy_threshold=1, healthy_threshold=1, grpc_health_check=HealthCheckGrpcHealthCheck(
                           service_name="envoy.service.ext_proc.v3.ExternalProcessor"))


def circuit_breakers() -> CircuitBreakers:
    # Envoy's default max_retries (3 concurrent) would silently drop failover retries under load.
    return CircuitBreakers(thresholds=[CircuitBreakersThresholds(
        priority=RoutingPriority.DEFAULT, max_connections=100000, max_pending_requests=100000,
        max_requests=100000, max_retries=100000)])


def original_dst_cluster(name: str, header: str, connect_timeout_s: float, buffer_bytes: int) -> Cluster:
    return Cluster(
        name=name,
        per_connection_buffer_limit_bytes=buffer_bytes,
        type=ClusterDiscoveryType.ORIGINAL_DST,
        lb_policy=ClusterLbPolicy.CLUSTER_PROVIDED,
        connect_timeout=duration(connect_timeout_s),
        cleanup_interval=duration(60),
        original_dst_lb_config=ClusterOriginalDstLbConfig(use_http_header=True, http_header_name=header),
        circuit_breakers=circuit_breakers(),
    )


def strict_dns_cluster(name: str, hostports: Sequence[str], connect_timeout_s: float, **fields: Any) -> Cluster:
    # STRICT_DNS: accepts IPs, and also compose service names (the ext_proc container, model servers).
    return Cluster(
        name=name,
        type=ClusterDiscoveryType.STRICT_DNS,
        connect_timeout=duration(connect_timeout_s),
        circuit_breakers=circuit_breakers(),
        load_assignment=ClusterLoadAssignment(cluster_name=name, endpoints=[LocalityLbEndpoints(
            lb_endpoints=[LbEndpoint(endpoint=Endpoint(address=address(h))) for h in hostports])]),
        **fields,
    )
