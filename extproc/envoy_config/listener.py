"""The gateway listener: its HTTP connection manager (early header mutation, timeouts, path normalisation, the
route table, Envoy's own replies) and its HTTP filters (the routing ext_proc filter, the observing one, the router),
and the overload manager that bounds client connections."""

from __future__ import annotations

import dataclasses

from envoy_data_plane.envoy.config.accesslog.v3 import AccessLog
from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutation
from envoy_data_plane.envoy.config.core.v3 import ApiVersion
from envoy_data_plane.envoy.config.core.v3 import BackoffStrategy as CoreBackoffStrategy
from envoy_data_plane.envoy.config.core.v3 import (GrpcService, GrpcServiceEnvoyGrpc, HeaderValue,
                                                   Http1ProtocolOptions, Http2ProtocolOptions, TypedExtensionConfig)
from envoy_data_plane.envoy.config.core.v3 import HttpProtocolOptions as CoreHttpProtocolOptions
from envoy_data_plane.envoy.config.core.v3 import RetryPolicy as CoreRetryPolicy
from envoy_data_plane.envoy.config.core.v3 import RetryPolicyRetryHostPredicate as CoreRetryHostPredicate
from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
from envoy_data_plane.envoy.config.overload.v3 import OverloadManager, ResourceMonitor
from envoy_data_plane.envoy.config.route.v3 import Route, RouteConfiguration, VirtualHost
from envoy_data_plane.envoy.config.core.v3 import HttpUri
from envoy_data_plane.envoy.extensions.filters.http.ext_authz.v3 import (AuthorizationRequest, AuthorizationResponse,
                                                                        BufferSettings, ExtAuthz, HttpService)
from envoy_data_plane.envoy.type.matcher.v3 import ListStringMatcher, RegexMatcher, StringMatcher
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (ExternalProcessor, MetadataOptions,
                                                                        MetadataOptionsMetadataNamespaces,
                                                                        ProcessingMode)
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ProcessingModeBodySendMode as BodySendMode
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ProcessingModeHeaderSendMode as HeaderSendMode
from envoy_data_plane.envoy.extensions.filters.http.router.v3 import Router
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
    HttpConnectionManager, HttpConnectionManagerCodecType, HttpConnectionManagerPathWithEscapedSlashesAction,
    HttpFilter)
from envoy_data_plane.envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
    HeaderMutation as EarlyHeaderMutation)
from envoy_data_plane.envoy.extensions.resource_monitors.downstream_connections.v3 import DownstreamConnectionsConfig
from envoy_data_plane.envoy.extensions.retry.host.previous_hosts.v3 import PreviousHostsPredicate
from envoy_data_plane.envoy.type.v3 import HttpStatus, StatusCode
from envoy_data_plane.google.protobuf import Any as ProtoAny

from prefixroute.extproc.envoy_config.common import (AUTHZ_FILTER, AUTHZ_HTTP_CLUSTER, AUTHZ_PROCESSING,
                                                     EXTPROC_CLUSTER, OBSERVE_FILTER, ROUTING_FILTER, address,
                                                     duration, set_header)
from prefixroute.extproc.envoy_config.replies import local_reply_config
from prefixroute.extproc.envoy_config.response_headers import response_headers_filter
from prefixroute.extproc.envoy_config.envoy_settings import EnvoySettings
from prefixroute.extproc.envoy_config.timing import timing_filter
from prefixroute.extproc.facts_fields import OBSERVED_FACTS
from prefixroute.extproc.headers import (AUTHZ_BODY_BYTES_HEADER, AUTHZ_CHECK_PATH_PREFIX, FAIRNESS_HEADER,
                                         FLOW_HEADER_VALUE, HANDOFF_HEADER, HANDOFF_VALUE,
                                         SCHEDULING_HEADERS, LB_METADATA_NAMESPACE, MAX_FALLBACKS, OBSERVE_ATTRIBUTES,
                                         OBSERVED_METADATA,
                                         REFUSED_HEADER, REPLICA_HEADER, SERVED_HEADER, TRACEPARENT_HEADER,
                                         route_headers)

ROUTER_FILTER = "envoy.filters.http.router"


def http_filters(s: EnvoySettings, num_replicas: int) -> list[HttpFilter]:
    """The HTTP filters in order: the removal of router-internal response headers (response_headers.py: first, so
    last on the way back), the routing filter (our picker: ext_authz, then the ext_proc filter of the handoff
    route; or the ext_proc filter alone), the observing one (observability mode, never waited on), the facts Lua
    filter, the router."""
    http_filters: list[HttpFilter] = [response_headers_filter(s)]
    if s.extproc_enabled and s.routing_processing in AUTHZ_PROCESSING:
        http_filters.append(authz_http_filter(s, num_replicas))
        # The handoff route's routing filter (disabled on every other route): a request the router would hold, or
        # a large body it parses off its loop, is handed to it (authz.py), since only its answers extend Envoy's
        # wait.
        http_filters.append(extproc_routing_filter(dataclasses.replace(s, routing_processing="buffered"),
                                                   num_replicas))
    elif s.extproc_enabled:
        http_filters.append(extproc_routing_filter(s, num_replicas))
    if s.extproc_enabled and s.observe_responses:
        http_filters.append(HttpFilter(name=OBSERVE_FILTER, typed_config=ProtoAny.pack(ExternalProcessor(
            grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=EXTPROC_CLUSTER)),
            # Send-and-go: Envoy never waits for an answer, so the token stream is not slowed; a telemetry
            # failure never fails a request.
            observability_mode=True,
            failure_mode_allow=True,
            # After the HTTP stream ends Envoy keeps the side stream this long so queued messages (the
            # last body chunk) still reach the service; the service itself stops waiting after 2 s.
            deferred_close_timeout=duration(2),
            stat_prefix="observe",
            # The request headers as the routing filter left them are needed only for their traceparent (the
            # correlation key), id and path: sent as attributes with the response headers instead of a message
            # of their own (one message and a shorter-lived stream per request; measured, overhead-bench).
            response_attributes=list(OBSERVE_ATTRIBUTES),
            processing_mode=ProcessingMode(
                request_header_mode=HeaderSendMode.SKIP,
                response_header_mode=HeaderSendMode.SEND,
                request_body_mode=BodySendMode.NONE,
                response_body_mode=BodySendMode.STREAMED,
                request_trailer_mode=HeaderSendMode.SKIP,
                response_trailer_mode=HeaderSendMode.SKIP,
            ),
        ))))
    if (s.records_otlp_address and s.first_token_lua) or (s.extproc_enabled and s.response_facts_lua):
        # Last before the router: on the response path it sees each chunk first (timing.py).
        http_filters.append(timing_filter(s.response_facts_lua))
    http_filters.append(HttpFilter(name=ROUTER_FILTER, typed_config=ProtoAny.pack(Router())))
    return http_filters


ROUTING_PROCESSING = ("buffered", "buffered-partial", "full-duplex", "streamed-early", "skip-headers", "authz-http")
"""`EnvoySettings.routing_processing` choices; 'buffered' (ext_proc) and 'authz-http' (ext_authz over HTTP) are
correct as a gateway (bench-results/routing-modes/, routing-authz-http/)."""


def extproc_routing_filter(s: EnvoySettings, num_replicas: int) -> HttpFilter:
    """The routing ext_proc filter (`routing_processing`'s mode)."""
    return HttpFilter(name=ROUTING_FILTER, typed_config=ProtoAny.pack(ExternalProcessor(
        # No grpc_service timeout: one stream lives as long as its HTTP request (long streams);
        # message_timeout bounds each answer instead. The initial metadata tells the service that an
        # observing filter follows (so it waits for that stream's report before emitting a record).
        grpc_service=GrpcService(
            envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=EXTPROC_CLUSTER),
            # The GrpcService's own policy (EnvoyGrpc.retry_policy is for xDS streams only).
            retry_policy=extproc_retry_policy(num_replicas),
            initial_metadata=[HeaderValue(key=OBSERVED_METADATA, value=OBSERVED_FACTS if s.response_facts_lua
                                          else "1")] if s.observe_responses or s.response_facts_lua else []),
        failure_mode_allow=s.failure_mode == "open",
        status_on_error=HttpStatus(code=StatusCode.ServiceUnavailable),
        message_timeout=duration(s.extproc_message_timeout_ms / 1000),
        # Flow control: a held request's answer may take up to its queue deadline; the service asks for it
        # per request (override_message_timeout), so a hung picker still fails over after message_timeout.
        **({"max_message_timeout": duration(s.extproc_max_hold_s)} if s.extproc_max_hold_s > 0 else {}),
        **routing_processing(s),
        metadata_options=MetadataOptions(
            receiving_namespaces=MetadataOptionsMetadataNamespaces(untyped=[LB_METADATA_NAMESPACE])),
    )))


GRPC_AUTHZ_REMOVED = (" (Envoy's ext_authz over gRPC is no longer offered: 'authz-http' is the same filter and "
                      "decision over HTTP, and cost less in every measured figure)")
"""Said to whoever still names the gRPC ext_authz filter."""


HOP_BY_HOP_HEADERS = ("connection", "keep-alive", "proxy-connection", "te", "transfer-encoding", "upgrade", "expect")
"""Client headers a check over HTTP must not carry: they describe the client's connection, not the request (the
check has its own length and framing)."""


def authz_http_filter(s: EnvoySettings, num_replicas: int) -> HttpFilter:
    """The routing filter as Envoy's ext_authz over HTTP/1.1 (routing_processing 'authz-http',
    extproc/authz_http.py): each request's method, path (under ``/check``), headers and whole body as one HTTP
    request to a replica; a 200's routing headers are set on the request and route it again
    (``clear_route_cache``); a refusal's status, body and headers go to the client. Only with the facts path."""
    if not s.response_facts_lua:
        raise ValueError("routing_processing 'authz-http' needs the facts path (response_facts_lua): a request's facts "
                         "record is what ends its pick when Envoy routes by ext_authz")
    exact = (lambda names: ListStringMatcher(patterns=[StringMatcher(exact=n) for n in names]))
    return HttpFilter(name=AUTHZ_FILTER, typed_config=ProtoAny.pack(ExtAuthz(
        http_service=HttpService(
            # The ext_proc filter's answer timeout (what could take longer, a hold or a large body's parse, is
            # handed off to that filter, whose answers extend it).
            server_uri=HttpUri(uri=f"http://{AUTHZ_HTTP_CLUSTER}", cluster=AUTHZ_HTTP_CLUSTER,
                               timeout=duration(s.extproc_message_timeout_ms / 1000)),
            path_prefix=AUTHZ_CHECK_PATH_PREFIX,
            # Say the facts path is on and the handoff route exists; they overwrite a client's copies.
            authorization_request=AuthorizationRequest(
                headers_to_add=[HeaderValue(key=OBSERVED_METADATA, value=OBSERVED_FACTS),
                                HeaderValue(key=HANDOFF_HEADER, value=HANDOFF_VALUE), authz_body_cap(s)]),
            authorization_response=AuthorizationResponse(
                # Set on the request, overwriting (a client's copies are stripped before any filter anyway).
                allowed_upstream_headers=exact([*route_headers(MAX_FALLBACKS), REPLICA_HEADER, TRACEPARENT_HEADER,
                                                HANDOFF_HEADER]),
                # A refusal's headers for the client (Envoy adds status and content-length itself).
                allowed_client_headers=exact(["content-type", "retry-after", REFUSED_HEADER])),
            retry_policy=authz_http_retry_policy(num_replicas)),
        transport_api_version=ApiVersion.V3,
        failure_mode_allow=s.failure_mode == "open",
        status_on_error=HttpStatus(code=StatusCode.ServiceUnavailable),
        clear_route_cache=True,
        # Every client header, as the ext_proc filter sends them (session, tenant, the client's key for the
        # Responses API lookups), but those of the client's connection.
        allowed_headers=ListStringMatcher(patterns=[StringMatcher(safe_regex=RegexMatcher(regex=".*"))]),
        disallowed_headers=exact(HOP_BY_HOP_HEADERS),
        # The body as the HTTP request's body, whole up to authz_body_bytes (above, its first part: handed off).
        with_request_body=authz_body(s),
        stat_prefix="routing",
    )))


def authz_body_cap(s: EnvoySettings) -> HeaderValue:
    """Tells the router the checks' max_request_bytes: Envoy 1.40 marks a body cut at exactly that length as whole
    (x-envoy-auth-partial-body: false, when its buffer held exactly that much), so a body that long is handed off."""
    return HeaderValue(key=AUTHZ_BODY_BYTES_HEADER, value=str(authz_body(s).max_request_bytes))


def authz_body(s: EnvoySettings) -> BufferSettings:
    """What of a body an ext_authz check carries: the whole body up to authz_body_bytes; a larger one its first
    authz_body_bytes, marked partial (``x-envoy-auth-partial-body: true``), which the router hands to the ext_proc
    filter on the handoff route (that filter's buffer answers 413 above max_request_body_bytes). So a body the
    router would parse in its worker anyway crosses to it once in full, not twice."""
    if s.authz_body_bytes < 1:
        raise ValueError(f"authz_body_bytes must be at least 1, got {s.authz_body_bytes}")
    return BufferSettings(max_request_bytes=min(s.authz_body_bytes, s.max_request_body_bytes),
                          allow_partial_message=True)


def authz_http_retry_policy(num_replicas: int) -> CoreRetryPolicy | None:
    """A check that cannot reach one replica (refused, reset before the answer: it died or is restarting) is sent
    to another, as a routing stream is (`extproc_retry_policy`)."""
    policy = extproc_retry_policy(num_replicas)
    if policy is not None:
        policy.retry_on = "connect-failure,refused-stream,reset"
    return policy


ROUTING_REQUEST_ATTRIBUTES = ("request.url_path", "request.method", "request.headers", "request.id")
"""What 'skip-headers' asks Envoy for in place of the request headers message."""


def routing_processing(s: EnvoySettings) -> dict[str, object]:
    """The routing filter's processing mode and the body-send options that go with it (`routing_processing`).

    'buffered' (the default): headers sent and answered at once (CONTINUE), then the whole body, on which the
    router decides: two round trips. Measured on Envoy 1.40 against every alternative (overhead-bench --variants
    buffered-partial,full-duplex,streamed-early,skip-headers): none is both faster beyond noise and correct for
    large bodies, slow uploads and failover (bench-results/routing-modes/README.md). Mode override is not among
    them: Envoy takes `mode_override` only from the answer to the headers message, so it cannot save that trip."""
    if s.routing_processing not in ROUTING_PROCESSING or s.routing_processing in AUTHZ_PROCESSING:
        removed = GRPC_AUTHZ_REMOVED if s.routing_processing in ("authz", "ext_authz") else ""
        raise ValueError(f"routing_processing must be one of {', '.join(ROUTING_PROCESSING)}; "
                         f"got {s.routing_processing!r}{removed}")
    mode = s.routing_processing
    body = {"buffered": BodySendMode.BUFFERED, "buffered-partial": BodySendMode.BUFFERED_PARTIAL,
            "full-duplex": BodySendMode.FULL_DUPLEX_STREAMED, "streamed-early": BodySendMode.STREAMED,
            "skip-headers": BodySendMode.BUFFERED}[mode]
    extra: dict[str, object] = {}
    if mode == "streamed-early":
        # Only STREAMED honours it (BUFFERED ignores it in Envoy 1.40: checked).
        extra["send_body_without_waiting_for_header_response"] = True
    if mode == "skip-headers":
        extra["request_attributes"] = list(ROUTING_REQUEST_ATTRIBUTES)
    return {**extra, "processing_mode": ProcessingMode(
        # Headers must be sent (and answered at once) for the body to reach us before routing.
        request_header_mode=HeaderSendMode.SKIP if mode == "skip-headers" else HeaderSendMode.SEND,
        # The served header is needed once: the observing filter or the facts record, when present, carries
        # it without making Envoy wait, so this filter's blocking response-headers round trip is skipped.
        response_header_mode=HeaderSendMode.SEND if s.report_served and not (
            s.observe_responses or s.response_facts_lua) else HeaderSendMode.SKIP,
        request_body_mode=body,
        # Responses (incl. SSE streams) flow through unbuffered and unseen.
        response_body_mode=BodySendMode.NONE,
        # FULL_DUPLEX_STREAMED requires its trailers sent (Envoy refuses the configuration otherwise).
        request_trailer_mode=HeaderSendMode.SEND if mode == "full-duplex" else HeaderSendMode.SKIP,
        response_trailer_mode=HeaderSendMode.SKIP,
    )}


def connection_manager(s: EnvoySettings, routes: list[Route], filters: list[HttpFilter],
                       access_log: list[AccessLog]) -> HttpConnectionManager:
    """The gateway's HTTP connection manager: client-supplied routing headers stripped before any filter runs (a
    client never picks an address), and its scheduling headers (`scheduling_mutations`), `routes` on the
    normalised path, `filters`, Envoy's replies in OpenAI format."""
    stripped = [*route_headers(MAX_FALLBACKS), SERVED_HEADER, REPLICA_HEADER, HANDOFF_HEADER,
                "x-envoy-original-dst-host"]
    return HttpConnectionManager(
        access_log=access_log,
        stat_prefix="gateway",
        codec_type=HttpConnectionManagerCodecType.AUTO,
        early_header_mutation_extensions=[TypedExtensionConfig(
            name="envoy.http.early_header_mutation.header_mutation",
            typed_config=ProtoAny.pack(EarlyHeaderMutation(mutations=[
                *(HeaderMutation(remove=h) for h in stripped), *scheduling_mutations(s)])))],
        route_config=RouteConfiguration(name="gateway", virtual_hosts=[VirtualHost(
            name="inference", domains=["*"], routes=routes,
            # What a BUFFERED ext_proc body may grow to (413 above it), apart from the small per-connection
            # buffers: a slow client then costs connection_buffer_bytes, not max_request_body_bytes.
            request_body_buffer_limit=s.max_request_body_bytes)]),
        http_filters=filters,
        local_reply_config=local_reply_config(s),
        # Route on the path the endpoint will see: escaped slashes decoded first (Envoy unescapes before it
        # normalises), then dot segments resolved and '//' merged; the path forwarded is that normalised one, so an
        # endpoint never decodes a %2F into a path other than the one matched. Model ids hold slashes, and SDKs
        # send them escaped (GET /v1/models/meta-llama%2FLlama-3.1-8B-Instruct): refusing them would refuse those.
        normalize_path=True,
        merge_slashes=True,
        path_with_escaped_slashes_action=HttpConnectionManagerPathWithEscapedSlashesAction.UNESCAPE_AND_FORWARD,
        request_headers_timeout=duration(s.request_headers_timeout_s),
        request_timeout=duration(s.request_timeout_s),
        stream_idle_timeout=duration(s.stream_idle_timeout_s),
        common_http_protocol_options=CoreHttpProtocolOptions(idle_timeout=duration(s.idle_timeout_s)),
        max_request_headers_kb=s.max_request_headers_kb,
        # HTTP/1.0 is refused with 426 (accept_http_10 off, Envoy's default): it has no chunked encoding, so
        # a token stream could only be close-delimited; every OpenAI client speaks HTTP/1.1 or HTTP/2.
        http_protocol_options=Http1ProtocolOptions(accept_http_10=False),
        # HTTP/2 clients: per-stream window = what one stream may buffer here (Envoy's edge recommendation).
        http2_protocol_options=Http2ProtocolOptions(
            max_concurrent_streams=100, initial_stream_window_size=64 * 1024,
            initial_connection_window_size=1024 * 1024),
    )


def scheduling_mutations(s: EnvoySettings) -> list[HeaderMutation]:
    """A client never sets its own scheduling class (extproc/tenants.py): its copies of the priority, tenant,
    objective and fairness headers are removed before any filter runs, but those an ingress in front sets
    (`trusted_ingress_headers`); the fairness header is then set to the client connection's peer address
    (`FLOW_HEADER_VALUE`), so the router's fairness holds per client, whatever ids a client sends."""
    kept = {h.lower() for h in s.trusted_ingress_headers}
    unknown = kept - set(SCHEDULING_HEADERS)
    if unknown:
        raise ValueError(f"trusted_ingress_headers: {', '.join(sorted(unknown))} is no scheduling header; "
                         f"expected any of {', '.join(SCHEDULING_HEADERS)}")
    out = [HeaderMutation(remove=h) for h in SCHEDULING_HEADERS if h not in kept]
    if FAIRNESS_HEADER not in kept:
        out.append(HeaderMutation(append=set_header(FAIRNESS_HEADER, FLOW_HEADER_VALUE)))
    return out


def gateway_listener(s: EnvoySettings, hcm: HttpConnectionManager) -> Listener:
    """The one listener clients connect to, serving `hcm`."""
    return Listener(
        name="gateway",
        address=address(f"{s.listen_address}:{s.gateway_port}"),
        # Read-ahead per client connection (the request body limit is the virtual host's).
        per_connection_buffer_limit_bytes=s.connection_buffer_bytes,
        filter_chains=[FilterChain(filters=[Filter(
            name="envoy.filters.network.http_connection_manager", typed_config=ProtoAny.pack(hcm))])],
    )


def overload_manager(s: EnvoySettings) -> OverloadManager:
    """Client connections beyond `max_downstream_connections` are refused (bounds Envoy's memory)."""
    return OverloadManager(resource_monitors=[ResourceMonitor(
        name="envoy.resource_monitors.global_downstream_max_connections",
        typed_config=ProtoAny.pack(DownstreamConnectionsConfig(
            max_active_downstream_connections=s.max_downstream_connections)))])


def extproc_retry_policy(num_replicas: int) -> CoreRetryPolicy | None:
    """A routing stream that cannot start on one replica (refused, reset before any answer: it died or is
    restarting) is retried on another, so a request not yet routed meets no error; a stream that a replica
    answered is never retried (Envoy's async gRPC client retries only before the first response message)."""
    if num_replicas < 2:
        return None
    return CoreRetryPolicy(
        retry_on="connect-failure,refused-stream,reset,unavailable", num_retries=3,
        retry_back_off=CoreBackoffStrategy(base_interval=duration(0.002), max_interval=duration(0.02)),
        retry_host_predicate=[CoreRetryHostPredicate(
            name="envoy.retry_host_predicates.previous_hosts", typed_config=ProtoAny.pack(PreviousHostsPredicate()))],
        host_selection_retry_max_attempts=5)
