"""Render the Envoy configuration of the gateway from typed settings (`prefixroute envoy-config`).

`build_config` builds the bootstrap from envoy-data-plane's typed messages (every listener, filter and
cluster as its own message, each `typed_config` a packed `Any` of the extension's message), so a misspelt
field or a wrong type fails at build time, not when Envoy loads the file. `render` writes it as YAML (its
proto3 JSON mapping: snake_case, default values omitted). The committed `envoy/envoy.yaml` is this
rendering with default settings (a test asserts equality, so it cannot drift).

Only what renders the configuration imports this module (this command, `prefixroute gateway`, the overhead
bench): envoy-data-plane is slow to import and to build the first time (pydantic schemas), so the ext_proc
service never loads it; the names it shares with the hot path live in `headers.py`
(tests/unit/extproc/test_envoy_config_hot_path.py checks it).

Request path through Envoy:

    listener -> HCM early header mutation: strip every routing header a client may have sent
             -> ext_proc filter (our picker): headers SEND, request body BUFFERED, response headers SEND
             -> ext_proc filter in observability mode (telemetry; observe_responses): response headers
                (the request's traceparent, id and path as attributes) and response body STREAMED, sent
                without waiting for answers
             -> router: route on the header the picker set, else the ext_proc-down route

Telemetry (extproc/tracking.py): the picker also sets ``traceparent`` (its own span, a child
of the client's) on the request; the observing filter sees it in its request headers, which correlates
its stream with the picker's, then reports the response's first body chunk (gateway TTFT), its end
(latency) and its usage. Observability mode means Envoy forwards every chunk to the client at once.

Endpoint selection and failover (Gateway API Inference Extension endpoint-picker protocol):
- The picker sets `x-gateway-destination-endpoint: ip:port` (primary; also dynamic metadata
  `envoy.lb` with the same value) and, for each fallback k = 1..MAX_FALLBACKS (4),
  `x-prefixroute-fallback-endpoint-k: ip:port`. It always sets every fallback header (repeating the
  last endpoint when the decision has fewer), because an ORIGINAL_DST cluster that finds no header falls
  back to the downstream connection's own destination, which is Envoy itself.
- The route to the picked endpoint matches only when `x-gateway-destination-endpoint` is present (the
  route cache is cleared by the picker, so this is re-evaluated after the mutation). It targets an
  `envoy.clusters.composite` cluster whose sub-cluster k is an ORIGINAL_DST cluster keyed on the k-th
  header: attempt 1 goes to the primary, retry 1 to fallback 1, and so on. The route retries on
  connect-failure / refused-stream / reset-before-request, and (retry_on_reset, default on) on a reset
  or close before any response byte: a killed server's pooled connections otherwise fail requests that
  Envoy dispatched before it saw the close. Such a retried request may run twice (one extra prefill); a
  response that started streaming is never retried.
- Envoy adds `x-gateway-destination-endpoint-served: %UPSTREAM_HOST%` to every routed response; the
  picker sees it (through the observing filter, or response headers SEND on the picker's filter when
  that one is off) and reports the primary as failed when another endpoint served.
- SECURITY: a client can never choose the address: early header mutation removes the routing headers
  before any filter runs, the picker only writes addresses from its endpoint pool, and the ORIGINAL_DST
  route is reachable only with the picker's header.

Processing modes (measured with `prefixroute overhead-bench`): request headers SEND (answered at once,
or decided there when the request has no body), request body BUFFERED (FULL_DUPLEX_STREAMED saves the
CONTINUE round trip but makes the picker hand the body back: slower here), response headers SEND only
for the served header when no observing filter carries it (report_served; a blocking round trip per
request: turn it off and health probes alone find dead endpoints), response body NONE so streams flow
unbuffered.

When the ext_proc service is down (or times out): `failure_mode = "open"` (default) lets the request
continue without the header, and it matches the fallback route: plain round-robin over the configured
endpoints (a STRICT_DNS cluster), because serving without affinity beats refusing users.
`failure_mode = "closed"` answers an OpenAI-format 503 instead (the filter's ``status_on_error``, whose default
500 would misname the failure). Neither ever uses a client address. The Responses API paths (``/v1/responses``
and ``/v1/responses/...``) always fail closed: a follow-up (``previous_response_id``) exists only in the store of
the endpoint that produced it, so round-robin would answer most of them with a false "not found" (5 of 8 on 4
endpoints, measured) where a 503 with ``Retry-After`` tells the client the truth.

What the gateway serves (issue 11): only the allowlist (`allowed_paths` exact, `allowed_path_prefixes`):
each allowlisted path has its picked route and its ext_proc-down route; every other path matches the last
route, an OpenAI-format 404 answered by Envoy with both ext_proc filters disabled on it (the router never
sees it). CONNECT matches only a connect_matcher route: one exists, so Envoy refuses CONNECT itself (403
upgrade_failed) instead of handing a never-ending tunnel body to ext_proc. Paths are normalised before
matching: `%2F`/`%5C` decoded to `/`/`\\` first (UNESCAPE_AND_FORWARD), then RFC 3986 dot segments resolved and
repeated slashes merged; the route is matched on, and the endpoint receives, that one path. So no spelling of a
private path (`/v1/../admin`, `//admin`, `..%2F`, an absolute-URI target) reaches an endpoint, and a model id
holding a slash (`GET /v1/models/meta-llama%2FLlama-3.1-8B-Instruct`, as the OpenAI SDK sends it) reaches the
endpoint as `/v1/models/meta-llama/Llama-3.1-8B-Instruct`: exactly the path a vLLM server sees when called
directly (its HTTP server decodes `%2F` before routing), so the client gets the endpoint's own answer (vLLM 0.33
has no such route and answers 404 `{"detail": "Not Found"}`; checked with its own router and error handlers).

Errors: `local_reply_config` rewrites every reply Envoy composes itself (codec errors 400/501, a path that
cannot be normalised 400, 403, 404, 408 timeouts, 413, 426 HTTP/1.0, 431, 502, 503 (no healthy endpoint, none
reachable), 504, any other status) into the OpenAI error format (`{"error": {...}}`, `content-type:
application/json`): a sentence saying what happened and what to do, with Envoy's short reason token in
parentheses for the operator. A CEL filter spares the router's own ImmediateResponse
replies (details ``prefixroute_<status>``, already OpenAI JSON with precise messages) and direct responses.

Bounds: per-connection buffers (`connection_buffer_bytes`, client and endpoint side) are small, so a client
that stops reading costs Envoy ~2x that per stream; the BUFFERED ext_proc body may still grow to
`max_request_body_bytes` (the virtual host's request_body_buffer_limit; 413 above). Timeouts: request
headers (slowloris), whole request, stream idle, connection idle (see each setting's help for its size).

ext_proc authentication: optional TLS to the ext_proc cluster (UpstreamTlsContext: Envoy verifies the
service certificate and its SAN, and presents its own for mutual TLS) and a bearer token in the
``authorization`` header of every ext_proc stream. The token is an Envoy *secret* (static_resources.secrets,
a generic secret: from `extproc_auth_token_file`, read by Envoy itself, so the rendered file holds only its
path; or inline) injected by a credential_injector upstream filter on the ext_proc clusters, never gRPC
initial metadata: Envoy redacts secrets from /config_dump, and checked with Envoy 1.40 neither /config_dump
nor its log at any level (debug and trace included) shows the token (issue 27: the admin port printed it).

Envoy's admin interface (`admin_mode`): "loopback" binds 127.0.0.1:`admin_port` and serves only read-only
paths (`ADMIN_READ_ONLY_PATHS`: no /config_dump, /logging, /quitquitquit, /drain_listeners, /runtime_modify,
/healthcheck/fail, /reset_counters, profilers or taps: every local user can reach loopback); "unix" serves
everything on a Unix socket (`admin_socket_path`, mode 0600: its owner only); "off" has no admin at all (then
`health_path`, answered by Envoy on the gateway listener, tells whether it serves). Note: at debug and trace
levels Envoy logs every request's headers, clients' own ``authorization`` included; only the owner can set
them (flag, or the unix admin socket).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import re
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import betterproto2
import orjson
import yaml
from envoy_data_plane.envoy.config.accesslog.v3 import (AccessLogFilter, AndFilter, ComparisonFilter,
                                                        ComparisonFilterOp, ExtensionFilter, StatusCodeFilter)
from envoy_data_plane.envoy.extensions.access_loggers.filters.cel.v3 import ExpressionFilter
from envoy_data_plane.envoy.config.bootstrap.v3 import Admin, Bootstrap, BootstrapStaticResources
from envoy_data_plane.envoy.config.cluster.v3 import (CircuitBreakers, CircuitBreakersThresholds, Cluster,
                                                      ClusterCustomClusterType, ClusterDiscoveryType, ClusterLbPolicy,
                                                      ClusterOriginalDstLbConfig, OutlierDetection)
from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutation
from envoy_data_plane.envoy.config.accesslog.v3 import AccessLog
from envoy_data_plane.envoy.config.core.v3 import Pipe
from envoy_data_plane.envoy.extensions.access_loggers.open_telemetry.v3 import OpenTelemetryAccessLogConfig
from envoy_data_plane.opentelemetry.proto.common.v1 import AnyValue, KeyValue, KeyValueList
from envoy_data_plane.envoy.extensions.filters.http.credential_injector.v3 import CredentialInjector
from envoy_data_plane.envoy.extensions.filters.http.upstream_codec.v3 import UpstreamCodec
from envoy_data_plane.envoy.extensions.http.injected_credentials.generic.v3 import Generic as GenericCredential
from envoy_data_plane.envoy.config.core.v3 import (Address, DataSource, GrpcService, GrpcServiceEnvoyGrpc,
                                                   HeaderValue, HeaderValueOption, HeaderValueOptionHeaderAppendAction,
                                                   Http1ProtocolOptions, Http2ProtocolOptions, HttpProtocolOptions as
                                                   CoreHttpProtocolOptions, RoutingPriority, RuntimeUInt32,
                                                   SocketAddress, SubstitutionFormatString, TransportSocket,
                                                   TypedExtensionConfig)
from envoy_data_plane.envoy.config.core.v3 import BackoffStrategy as CoreBackoffStrategy
from envoy_data_plane.envoy.config.core.v3 import HealthCheck, HealthCheckGrpcHealthCheck
from envoy_data_plane.envoy.config.core.v3 import RetryPolicy as CoreRetryPolicy
from envoy_data_plane.envoy.config.core.v3 import RetryPolicyRetryHostPredicate as CoreRetryHostPredicate
from envoy_data_plane.envoy.config.endpoint.v3 import ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints
from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
from envoy_data_plane.envoy.config.overload.v3 import OverloadManager, ResourceMonitor
from envoy_data_plane.envoy.config.route.v3 import (DirectResponseAction, HeaderMatcher, RetryPolicy,
                                                    RetryPolicyRetryBackOff, RetryPolicyRetryHostPredicate, Route,
                                                    RouteAction, RouteConfiguration, RouteMatch,
                                                    RouteMatchConnectMatcher, VirtualHost)
from envoy_data_plane.envoy.extensions.clusters.composite.v3 import ClusterConfig as CompositeClusterConfig
from envoy_data_plane.envoy.extensions.clusters.composite.v3 import ClusterConfigClusterEntry
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (ExternalProcessor, ExtProcOverrides,
                                                                        ExtProcPerRoute,
                                                                        MetadataOptions,
                                                                        MetadataOptionsMetadataNamespaces,
                                                                        ProcessingMode)
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ProcessingModeBodySendMode as BodySendMode
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ProcessingModeHeaderSendMode as HeaderSendMode
from envoy_data_plane.envoy.extensions.filters.http.router.v3 import Router
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
    HttpConnectionManager, HttpConnectionManagerCodecType, HttpConnectionManagerPathWithEscapedSlashesAction,
    HttpFilter, LocalReplyConfig, ResponseMapper)
from envoy_data_plane.envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
    HeaderMutation as EarlyHeaderMutation)
from envoy_data_plane.envoy.extensions.resource_monitors.downstream_connections.v3 import DownstreamConnectionsConfig
from envoy_data_plane.envoy.extensions.retry.host.previous_hosts.v3 import PreviousHostsPredicate
from envoy_data_plane.envoy.extensions.transport_sockets.tls.v3 import (CertificateValidationContext, CommonTlsContext,
                                                                        GenericSecret, SdsSecretConfig, Secret,
                                                                        SubjectAltNameMatcher,
                                                                        SubjectAltNameMatcherSanType, TlsCertificate,
                                                                        UpstreamTlsContext)
from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (HttpProtocolOptions,
                                                                 HttpProtocolOptionsExplicitHttpConfig)
from envoy_data_plane.envoy.type.matcher.v3 import RegexMatcher, StringMatcher
from envoy_data_plane.envoy.type.v3 import HttpStatus, StatusCode
from envoy_data_plane.google.protobuf import Any as ProtoAny

from prefixroute import settings
from prefixroute.responses_prompt import RESPONSES_PATH, RESPONSES_PREFIX
from prefixroute.extproc.headers import (DESTINATION_HEADER, LB_METADATA_NAMESPACE, MAX_FALLBACKS,  # noqa: F401
                                         OBSERVE_ATTRIBUTES, OBSERVED_METADATA, REPLICA_HEADER, SERVED_HEADER,
                                         fallback_header,
                                         route_headers)
from prefixroute.openai_errors import ERROR_TYPES
from prefixroute.settings import Settings, setting

EXTPROC_CLUSTER = "prefixroute_extproc"
EXTPROC_REPLICA_CLUSTER_PREFIX = "prefixroute_extproc_replica_"
"""Cluster `<prefix>k` holds ext_proc replica k alone: the observing stream of a request replica k routed."""
PICKED_CLUSTER = "picked_endpoint"
POOL_CLUSTER = "endpoint_pool_round_robin"
DIRECT_CLUSTER = "direct_upstream"
UNAVAILABLE_CLUSTER = "routing_unavailable"
"""A cluster without endpoints: the target of the routes taken while the routing service is down and the request
must not go elsewhere (Envoy answers 503; its local reply mapper names the reason)."""
UNAVAILABLE_STATEFUL_ROUTE = "extproc_unavailable_stateful"
UNAVAILABLE_CLOSED_ROUTE = "extproc_unavailable_fail_closed"
OBSERVE_FILTER = "prefixroute.observe_responses"
ROUTING_FILTER = "envoy.filters.http.ext_proc"

DEFAULT_ALLOWED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/models",
                         "/tokenize", "/detokenize")
DEFAULT_ALLOWED_PATH_PREFIXES = ("/v1/responses/", "/v1/models/")
# Characters an allowlisted path may hold: RFC 3986 pchar without '%' (an escaped form never matches a
# normalised path) and without ';' (a path parameter would be a second spelling of the same path).
_PATH_RE = re.compile(r"^/[A-Za-z0-9._~!$&'()*+,=:@/-]*$")


@dataclasses.dataclass(frozen=True)
class EnvoySettings(Settings):
    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_ENVOY_"
    TITLE: ClassVar[str] = "Envoy gateway configuration"

    gateway_port: int = setting(8080, "Port clients send OpenAI requests to (8080: the usual unprivileged HTTP port).")
    listen_address: str = setting("0.0.0.0", "Address the gateway listens on (all interfaces, so a container's "
                                  "published port reaches it; use 127.0.0.1 to keep it local).")
    admin_port: int = setting(9901, "Envoy admin port, bound to 127.0.0.1 only (9901: Envoy's customary port); "
                              "admin_mode loopback.")
    admin_mode: str = setting("loopback", "Envoy's admin interface: loopback (127.0.0.1:admin_port, read-only paths "
                              "only: stats, ready, clusters, listeners, server_info; every local user can reach "
                              "loopback), unix (every path, on the Unix socket admin_socket_path, mode 0600: only "
                              "its owner), or off (no admin; health_path still answers).")
    admin_socket_path: str = setting("", "Unix socket of the admin interface when admin_mode is unix; put it in a "
                                     "folder only its owner can enter.")
    health_path: str = setting("/healthz", "Path Envoy answers itself on the gateway listener with 200 "
                               "{\"status\": \"ok\"} (GET; no router, no endpoint): a supervisor's probe that the "
                               "listener serves (a drained listener fails it). Empty: none.")
    extproc_address: str = setting("127.0.0.1:9002", "host:port of the ext_proc routing service "
                                   "(9002: the port the endpoint-picker reference uses).")
    extproc_replica_addresses: tuple[str, ...] = setting(
        (), "host:port of each ext_proc replica, in replica index order (replica k is started with --replica-index "
        "k); two or more replace extproc_address: Envoy spreads routing streams over them (least request, a "
        "refused or dead replica retried on another) and sends each request's observing stream to the replica "
        "that routed it (the x-prefixroute-replica header it sets selects the route). Empty = extproc_address "
        "alone.")
    endpoints: tuple[str, ...] = setting(
        ("127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003", "127.0.0.1:8004"),
        "Model-server endpoints host:port for the fail-open round-robin route (the same list the ext_proc "
        "service is given; four local simulated servers by default).")
    failure_mode: str = setting("open", "What happens when the ext_proc service is down or times out: 'open' = "
                                "round-robin over the configured endpoints (availability beats affinity), "
                                "'closed' = OpenAI-format 503.")
    extproc_message_timeout_ms: int = setting(500, "How long Envoy waits for one ext_proc answer before applying "
                                              "failure_mode (decisions take ~1 ms; 500 ms absorbs GC pauses and "
                                              "CPU contention yet fails open fast when the picker hangs).")
    max_request_body_bytes: int = setting(8 * 1024 * 1024, "Largest request body; larger gets 413 (8 MiB, the "
                                          "routing core's max_body_bytes: a 128k-token prompt many times over, "
                                          "while bounding what Envoy buffers per request).")
    connect_timeout_s: float = setting(1.0, "Upstream connect timeout (refused connections fail at once; 1 s "
                                       "bounds a black-holed endpoint before the fallback is tried).")
    upstream_timeout_s: float = setting(600.0, "Whole-response timeout for an inference request (long "
                                        "generations stream for minutes; 0 disables).")
    num_fallbacks: int = setting(2, "Fallback endpoints tried, in order, when the previous one refuses the "
                                 "connection, 0-4 (2: survives two endpoints down at once without long tails; "
                                 "the routing core's num_fallbacks should match).")
    retry_on_reset: bool = setting(True, "Also move to the next endpoint when one resets or closes the connection "
                                   "before any response byte (a crashed or killed server, or a pooled connection it "
                                   "closed just as Envoy reused it). Such a request may have started there, so it can "
                                   "run twice (one extra prefill); without it, those requests fail with 503. Streamed "
                                   "responses that started are never retried.")
    report_served: bool = setting(True, "Send response headers to ext_proc so it learns which endpoint served "
                                  "(passive failure detection; costs one more small gRPC message per request). With "
                                  "observe_responses the observing filter carries them, without blocking.")
    max_downstream_connections: int = setting(50000, "Client connections Envoy accepts at once; beyond it new "
                                              "ones are refused (bounds memory; far above what one picker "
                                              "process can route).")
    extproc_enabled: bool = setting(True, "Insert the ext_proc filter (false = plain round-robin, used by the "
                                    "overhead benchmark as the baseline).")
    observe_responses: bool = setting(True, "Insert the observing ext_proc filter (observability mode: Envoy never "
                                      "waits for it) that streams response headers and body chunks to the ext_proc "
                                      "service for gateway TTFT, latency and token usage per request; false omits "
                                      "it (records then lack TTFT and usage).")
    allowed_paths: tuple[str, ...] = setting(
        DEFAULT_ALLOWED_PATHS,
        "Request paths (exact, case-sensitive, query string aside) the gateway routes to endpoints: the OpenAI "
        "inference API and vLLM's /tokenize and /detokenize. Any other path gets an OpenAI-format 404 from Envoy "
        "and never reaches an endpoint or the ext_proc service, so a model server's admin, metrics, profiling "
        "or sleep paths stay private. Add a path here for an endpoint API you mean to expose.")
    allowed_path_prefixes: tuple[str, ...] = setting(
        DEFAULT_ALLOWED_PATH_PREFIXES,
        "Path prefixes routed like allowed_paths (a prefix should end in '/'): the Responses API's "
        "/v1/responses/{id}... and /v1/models/{model}. Paths are normalised first (%2F and %5C decoded, then RFC "
        "3986 dot segments resolved and repeated slashes merged; the endpoint receives that path), so '..' cannot "
        "climb out of them, and a model id with a slash (meta-llama%2FLlama-3.1-8B-Instruct) reaches the endpoint as "
        "vLLM itself would see it.")
    request_headers_timeout_s: float = setting(
        10.0, "Time a client has, from the first byte of a request, to send all of its headers; then Envoy closes "
        "the connection (slowloris: a client trickling headers otherwise holds a connection forever). Real "
        "clients send headers in one packet; 10 s leaves room for a lossy mobile link.")
    request_timeout_s: float = setting(
        120.0, "Time to receive a whole request, headers and body (Envoy answers 408 in OpenAI format after it). "
        "The timer stops once the request has gone to the endpoint, so it never cuts a long response; 120 s "
        "uploads a max_request_body_bytes body (8 MiB) at ~0.5 Mbit/s. 0 disables.")
    stream_idle_timeout_s: float = setting(
        300.0, "A request with no bytes moving in either direction for this long is reset (a stalled client or "
        "endpoint). Sized for inference: near saturation a first token can take tens of seconds, and a "
        "non-streamed completion sends nothing until its last token (a few thousand tokens at ~30 tokens/s: "
        "minutes); 300 s is Envoy's default and stays under upstream_timeout_s. A client that stops reading "
        "stalls its stream (flow control) and is cut after this long. 0 disables.")
    idle_timeout_s: float = setting(
        30.0, "A client connection with no request in flight for this long is closed (keep-alive connections, and "
        "connections that never send a byte: request_headers_timeout_s starts at the first byte). Never "
        "applies while a response streams. 30 s: far above SDK reuse gaps (the OpenAI SDK's httpx keeps idle "
        "connections 5 s), short enough that idle sockets do not pile up. 0 disables.")
    max_request_headers_kb: int = setting(
        32, "Largest request header block in KiB; larger gets an OpenAI-format 431. OpenAI clients send under 2 KiB "
        "(a long bearer JWT is ~1-8 KiB); 32 KiB (Envoy's default is 60) halves what a header flood holds per "
        "request.")
    connection_buffer_bytes: int = setting(
        32 * 1024, "Per-connection buffer high-water mark, client side and endpoint side: how far Envoy reads "
        "ahead of a slow peer before flow control pauses the other side. It bounds what a client that stops "
        "reading costs Envoy (~2x this per stream instead of ~2x max_request_body_bytes). 32 KiB is Envoy's "
        "edge-proxy recommendation: seconds of a token stream (~100 bytes per SSE event); request bodies are "
        "buffered separately up to max_request_body_bytes.")
    records_otlp_address: str = setting(
        "", "host:port of an OTLP/gRPC receiver (`prefixroute telemetry`) Envoy sends one log record per routed "
        "request to (its id, path, status, duration, served endpoint, response flags): the receiver keeps it as "
        "the request's record only when the router's own record never comes (the router was down or was killed "
        "while the request ran), so every request served has a record. Empty: none.")
    records_otlp_token_file: str = setting(
        "", "File holding the bearer token the OTLP receiver of records_otlp_address requires (read by Envoy, "
        "never written into the configuration).")
    extproc_tls_ca_file: str = setting(
        "", "PEM CA bundle that signs the ext_proc service's certificate; set = Envoy talks TLS to it and verifies "
        "its certificate (the SAN must name extproc_tls_server_name). Empty = plaintext (loopback only).")
    extproc_tls_cert_file: str = setting(
        "", "PEM client certificate Envoy presents to the ext_proc service (mutual TLS; the service requires one "
        "when it is given tls_client_ca_file). Needs extproc_tls_key_file and extproc_tls_ca_file.")
    extproc_tls_key_file: str = setting("", "PEM private key of extproc_tls_cert_file.")
    extproc_tls_server_name: str = setting(
        "", "Name sent as SNI and required in the ext_proc certificate's subject alternative names (DNS name or "
        "IP address); empty = the host of extproc_address.")
    extproc_auth_token: str = setting(
        "", "Bearer token Envoy sends to the ext_proc service (`authorization: Bearer ...` on every stream, both "
        "filters); must equal the service's auth_token. Prefer extproc_auth_token_file: given inline, the token is "
        "written into the rendered configuration (as a secret, so Envoy's /config_dump redacts it; envoy-config "
        "--out writes the file mode 0600).")
    extproc_auth_token_file: str = setting(
        "", "File holding extproc_auth_token, read by Envoy itself at start: the rendered configuration names the "
        "file and holds no secret (Envoy must be able to read it). A file with surrounding whitespace (a trailing "
        "newline) is read here instead and its stripped token written into the configuration. Used when "
        "extproc_auth_token is empty.")


def _duration(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def _address(hostport: str) -> Address:
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {hostport!r}")
    return Address(socket_address=SocketAddress(address=host, port_value=int(port)))


def _set_header(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, value=value),
                             append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD)


# Statuses only Envoy itself answers, named like openai_errors.ERROR_TYPES names the others.
_ENVOY_ERROR_TYPES = {**ERROR_TYPES, 408: "RequestTimeoutError", 426: "UpgradeRequiredError",
                      431: "RequestHeaderFieldsTooLargeError", 501: "NotImplementedError"}


def _error_json(status: int, message: str) -> str:
    # Same shape as prefixroute.openai_errors.error_body; Envoy fills %...% operators at reply time.
    return orjson.dumps({"error": {"message": message, "type": _ENVOY_ERROR_TYPES[status], "param": None,
                                   "code": status}}).decode()


def extproc_auth_token(s: EnvoySettings) -> str:
    """The bearer token Envoy sends to the ext_proc service: `extproc_auth_token`, else the stripped content of
    `extproc_auth_token_file`, else "" (none). OSError when the file cannot be read."""
    if s.extproc_auth_token:
        return s.extproc_auth_token
    if s.extproc_auth_token_file:
        return Path(s.extproc_auth_token_file).read_text().strip()
    return ""


EXTPROC_TOKEN_SECRET = "prefixroute_extproc_token"
ADMIN_READ_ONLY_PATHS = ("/ready", "/stats", "/stats/prometheus", "/stats/recentlookups", "/server_info",
                         "/clusters", "/listeners", "/certs", "/memory", "/hot_restart_version", "/runtime", "/help")
"""The admin paths `admin_mode` loopback serves: what monitoring reads. Left out: /config_dump (configuration and
secrets' metadata), /logging (a POST raises the level: debug logs print clients' headers), /quitquitquit,
/drain_listeners, /healthcheck/fail and /healthcheck/ok, /runtime_modify, /reset_counters, /heapprofiler,
/cpuprofiler, /tap, /init_dump, /contention and anything added later (a path must be listed to be served)."""


def _extproc_token_secret(s: EnvoySettings) -> Secret | None:
    """The ext_proc token as an Envoy secret: the file's path (Envoy reads it; the rendered configuration holds no
    token), else the inline token; None without one. Envoy strips nothing: a file's surrounding whitespace is
    refused here (a trailing newline would become part of the header)."""
    if s.extproc_auth_token:
        return Secret(name=EXTPROC_TOKEN_SECRET,
                      generic_secret=GenericSecret(secret=DataSource(inline_string=s.extproc_auth_token)))
    if s.extproc_auth_token_file:
        raw = Path(s.extproc_auth_token_file).read_bytes()
        if not raw.strip():
            raise ValueError(f"extproc_auth_token_file {s.extproc_auth_token_file} is empty")
        if raw != raw.strip():
            # Envoy would send the newline too: the stripped token goes inline (still a secret, redacted from
            # dumps, but in the rendered file: write the token file without a trailing newline to avoid that).
            return Secret(name=EXTPROC_TOKEN_SECRET, generic_secret=GenericSecret(
                secret=DataSource(inline_string=raw.strip().decode("utf-8", "replace"))))
        return Secret(name=EXTPROC_TOKEN_SECRET,
                      generic_secret=GenericSecret(secret=DataSource(filename=s.extproc_auth_token_file)))
    return None


RECORDS_CLUSTER = "prefixroute_records_otlp"
RECORDS_TOKEN_SECRET = "prefixroute_records_token"
RECORD_ATTRIBUTES = {
    "prefixroute.envoy_record": "1", "prefixroute.request_id": "%REQ(X-REQUEST-ID)%", "prefixroute.path": "%PATH%",
    "prefixroute.status": "%RESPONSE_CODE%", "prefixroute.latency_ms": "%DURATION%",
    "prefixroute.start_time": "%START_TIME(%s.%6f)%", "prefixroute.endpoint": "%UPSTREAM_HOST%",
    "prefixroute.response_flags": "%RESPONSE_FLAGS%", "prefixroute.route": "%ROUTE_NAME%"}
"""What Envoy's record of a request says (telemetry/receiver.py `envoy_log_to_row` reads these names)."""


def _records_access_log(s: EnvoySettings) -> tuple[list[AccessLog], Cluster | None, Secret | None]:
    """Envoy's own record of every routed request, as OTLP logs to `records_otlp_address` (issue 27: requests in
    flight when the router died had no record). Not for Envoy's health route and the paths it refuses itself."""
    if not s.records_otlp_address:
        return [], None, None
    token = None
    if s.records_otlp_token_file:
        token = Secret(name=RECORDS_TOKEN_SECRET,
                       generic_secret=GenericSecret(secret=DataSource(filename=s.records_otlp_token_file)))
    cluster = _strict_dns_cluster(RECORDS_CLUSTER, [s.records_otlp_address], 1.0, typed_extension_protocol_options={
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": ProtoAny.pack(HttpProtocolOptions(
            explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(http2_protocol_options=Http2ProtocolOptions()),
            http_filters=_credential_filters(RECORDS_TOKEN_SECRET) if token is not None else []))})
    config = OpenTelemetryAccessLogConfig(
        log_name="prefixroute.requests", buffer_flush_interval=_duration(1),
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=RECORDS_CLUSTER)),
        attributes=KeyValueList(values=[KeyValue(key=k, value=AnyValue(string_value=v))
                                        for k, v in RECORD_ATTRIBUTES.items()]))
    skip = " || ".join(f"xds.route_name == '{r}'" for r in ("gateway_health", "path_not_allowed",
                                                            "connect_not_allowed"))
    log = AccessLog(name="envoy.access_loggers.open_telemetry", typed_config=ProtoAny.pack(config),
                    filter=AccessLogFilter(extension_filter=ExtensionFilter(
                        name="envoy.access_loggers.extension_filters.cel",
                        typed_config=ProtoAny.pack(ExpressionFilter(expression=f"!({skip})")))))
    return [log], cluster, token


def _credential_filters(secret: str = EXTPROC_TOKEN_SECRET) -> list[HttpFilter]:
    """Upstream filters of a gRPC cluster: the token `secret` as ``authorization: Bearer ...`` on every stream
    (credential_injector), then the codec (which must come last)."""
    return [
        HttpFilter(name="envoy.filters.http.credential_injector", typed_config=ProtoAny.pack(CredentialInjector(
            overwrite=True,
            credential=TypedExtensionConfig(name="envoy.http.injected_credentials.generic", typed_config=ProtoAny.pack(
                GenericCredential(credential=SdsSecretConfig(name=secret), header="authorization",
                                  header_value_prefix="Bearer ")))))),
        HttpFilter(name="envoy.filters.http.upstream_codec", typed_config=ProtoAny.pack(UpstreamCodec())),
    ]


def _admin(s: EnvoySettings) -> Admin | None:
    if s.admin_mode == "off":
        return None
    if s.admin_mode == "unix":
        if not s.admin_socket_path:
            raise ValueError("admin_mode unix needs admin_socket_path")
        return Admin(address=Address(pipe=Pipe(path=s.admin_socket_path, mode=0o600)))
    if s.admin_mode == "loopback":
        # Envoy matches allow_paths against the path with its query string: each path, then any query.
        paths = "|".join(re.escape(p) for p in ADMIN_READ_ONLY_PATHS)
        return Admin(address=_address(f"127.0.0.1:{s.admin_port}"),
                     allow_paths=[StringMatcher(safe_regex=RegexMatcher(regex=f"^({paths})(\\?[^#]*)?$"))])
    raise ValueError(f"admin_mode must be loopback, unix or off, got {s.admin_mode!r}")


def _allowed_path_matches(s: EnvoySettings) -> list[RouteMatch]:
    """The allowlist as route matches: exact paths, then prefixes. ValueError for a path that is not in
    normalised form (it could never match: Envoy matches the normalised path) or an empty allowlist."""
    for p in (*s.allowed_paths, *s.allowed_path_prefixes):
        if not _PATH_RE.match(p) or "//" in p or "/./" in p or "/../" in p or p.endswith(("/.", "/..")):
            raise ValueError(f"allowed path {p!r} must be a normalised absolute path (no '%', ';', '?', '#', "
                             "'//' or dot segments)")
    if not s.allowed_paths and not s.allowed_path_prefixes:
        raise ValueError("allowed_paths and allowed_path_prefixes are both empty: the gateway would route nothing")
    return [*(RouteMatch(path=p) for p in dict.fromkeys(s.allowed_paths)),
            *(RouteMatch(prefix=p) for p in dict.fromkeys(s.allowed_path_prefixes))]


def _match_text(m: RouteMatch) -> str:
    return m.path if m.path is not None else f"{m.prefix}*"


def _not_found_route(name: str, match: RouteMatch, status: int, message: str, filters: Sequence[str]) -> Route:
    # Answered by Envoy with neither ext_proc filter running: the router never spends a decision (or a
    # telemetry record) on a path it does not serve.
    return _direct_route(name, match, status, _error_json(status, message), filters)


def _direct_route(name: str, match: RouteMatch, status: int, body: str, filters: Sequence[str]) -> Route:
    return Route(
        name=name, match=match,
        direct_response=DirectResponseAction(status=status, body=DataSource(inline_string=body)),
        response_headers_to_add=[_set_header("content-type", "application/json")],
        typed_per_filter_config={f: ProtoAny.pack(ExtProcPerRoute(disabled=True)) for f in filters},
    )


def _extproc_health_check() -> HealthCheck:
    """The replicas' health check: the picker's gRPC health service (extproc/health.py), asked for
    envoy.service.ext_proc.v3.ExternalProcessor, which is SERVING only while the replica can route (an endpoint
    healthy in its pool), so Envoy prefers the replicas that can; all not ready: Envoy's panic mode uses them all,
    and they answer 503 themselves. Exempt from the bearer token; over the cluster's TLS when it has one."""
    return HealthCheck(timeout=_duration(0.25), interval=_duration(0.25), no_traffic_interval=_duration(0.25),
                       unhealthy_threshold=1, healthy_threshold=1, grpc_health_check=HealthCheckGrpcHealthCheck(
                           service_name="envoy.service.ext_proc.v3.ExternalProcessor"))


def _extproc_transport_socket(s: EnvoySettings) -> TransportSocket | None:
    if not (s.extproc_tls_ca_file or s.extproc_tls_cert_file or s.extproc_tls_key_file):
        return None
    if not s.extproc_tls_ca_file:
        raise ValueError("extproc_tls_cert_file/extproc_tls_key_file need extproc_tls_ca_file (Envoy must verify "
                         "the ext_proc service's certificate)")
    if bool(s.extproc_tls_cert_file) != bool(s.extproc_tls_key_file):
        raise ValueError("extproc_tls_cert_file and extproc_tls_key_file go together")
    server_name = s.extproc_tls_server_name or extproc_addresses(s)[0].rpartition(":")[0]
    try:
        ipaddress.ip_address(server_name)
        san_type = SubjectAltNameMatcherSanType.IP_ADDRESS
    except ValueError:
        san_type = SubjectAltNameMatcherSanType.DNS
    common = CommonTlsContext(
        # gRPC servers negotiate HTTP/2 by ALPN.
        alpn_protocols=["h2"],
        tls_certificates=[TlsCertificate(certificate_chain=DataSource(filename=s.extproc_tls_cert_file),
                                         private_key=DataSource(filename=s.extproc_tls_key_file))]
        if s.extproc_tls_cert_file else [],
        # A CA alone checks the chain, not whose certificate it is: the SAN must name the service too.
        validation_context=CertificateValidationContext(
            trusted_ca=DataSource(filename=s.extproc_tls_ca_file),
            match_typed_subject_alt_names=[SubjectAltNameMatcher(
                san_type=san_type, matcher=StringMatcher(exact=server_name))]),
    )
    tls = UpstreamTlsContext(common_tls_context=common,
                             sni="" if san_type == SubjectAltNameMatcherSanType.IP_ADDRESS else server_name)
    return TransportSocket(name="envoy.transport_sockets.tls", typed_config=ProtoAny.pack(tls))


# Local replies that are Envoy's own: not the router's (an ext_proc ImmediateResponse, whose details the
# servicer sets to "prefixroute_<status>", already carries its OpenAI body) and not a route's direct_response
# (written in OpenAI format here). CEL runs only when Envoy composes a local reply, never on routed traffic.
ENVOY_OWN_REPLY = ("!(response.code_details.startsWith('prefixroute_') || "
                   "response.code_details == 'direct_response')")


def _cel_filter(expression: str) -> AccessLogFilter:
    return AccessLogFilter(extension_filter=ExtensionFilter(
        name="envoy.access_loggers.extension_filters.cel",
        typed_config=ProtoAny.pack(ExpressionFilter(expression=expression))))


# Envoy's reason tokens (%RESPONSE_CODE_DETAILS%) that get a sentence of their own; the others fall to their
# status's mapper. Exact tokens from Envoy's source (StreamInfo::ResponseCodeDetails). No literal '%' in a
# message: Envoy reads '%...%' as a substitution command.
_DETAIL_REPLIES: tuple[tuple[int, str, str, dict[str, str]], ...] = (
    (400, "path_normalization_failed",
     "Invalid request path: it cannot be normalised (a malformed percent-encoding or a character a path may not "
     "hold). Send the OpenAI API path, e.g. /v1/chat/completions (a model id's slash may be sent percent-encoded).",
     {}),
    (503, "no_healthy_upstream",
     "No healthy endpoint: no model server behind this gateway can be reached (none resolved, or each one is "
     "failing); retry shortly.", {"retry-after": "1"}),
)


def _local_reply_config(s: EnvoySettings) -> LocalReplyConfig:
    own = _cel_filter(ENVOY_OWN_REPLY)

    def mapper(status: int | None, message: str, headers: dict[str, str] | None = None, *,
               details: str | None = None) -> ResponseMapper:
        if status is None:  # any other status: the code is Envoy's, filled in at reply time
            body = _error_json(500, message).replace('"type":"InternalServerError"', '"type":"Error"').replace(
                '"code":500', '"code":%RESPONSE_CODE%')
            filt = own
        else:
            body = _error_json(status, message)
            conditions = [own, AccessLogFilter(status_code_filter=StatusCodeFilter(comparison=ComparisonFilter(
                op=ComparisonFilterOp.EQ,
                value=RuntimeUInt32(default_value=status, runtime_key=f"prefixroute.local_reply.{status}"))))]
            if details is not None:
                conditions.append(_cel_filter(f"response.code_details == '{details}'"))
            filt = AccessLogFilter(and_filter=AndFilter(filters=conditions))
        return ResponseMapper(
            filter=filt,
            body_format_override=SubstitutionFormatString(text_format_source=DataSource(inline_string=body),
                                                          content_type="application/json"),
            headers_to_add=[_set_header(k, v) for k, v in (headers or {}).items()])

    def unavailable(route: str, message: str) -> ResponseMapper:
        # The 503 of a route to UNAVAILABLE_CLUSTER (the routing service is down): its own message.
        return ResponseMapper(
            filter=AccessLogFilter(and_filter=AndFilter(filters=[
                own, AccessLogFilter(status_code_filter=StatusCodeFilter(comparison=ComparisonFilter(
                    op=ComparisonFilterOp.EQ,
                    value=RuntimeUInt32(default_value=503, runtime_key="prefixroute.local_reply.503")))),
                _cel_filter(f"xds.route_name.startsWith('{route}')")])),
            body_format_override=SubstitutionFormatString(
                text_format_source=DataSource(inline_string=_error_json(503, message)),
                content_type="application/json"),
            headers_to_add=[_set_header("retry-after", "1")])

    # The first mapper that matches wins: reason-specific ones first (the routing-unavailable routes' own 503s,
    # then Envoy's details). %RESPONSE_CODE_DETAILS% / %RESPONSE_FLAGS% are Envoy's short reason tokens (e.g.
    # http1.codec_error, UF), kept in parentheses for the operator after a sentence for the client.
    return LocalReplyConfig(mappers=[
        unavailable(UNAVAILABLE_STATEFUL_ROUTE, "The routing service is unavailable and a Responses API request must "
                    "reach the endpoint that holds its conversation; retry shortly."),
        unavailable(UNAVAILABLE_CLOSED_ROUTE, "The routing service is unavailable; retry shortly."),
        *(mapper(status, message, headers, details=details) for status, details, message, headers in _DETAIL_REPLIES),
        mapper(400, "Malformed HTTP request (%RESPONSE_CODE_DETAILS%)."),
        mapper(403, "Refused (%RESPONSE_CODE_DETAILS%): CONNECT and protocol upgrades are not supported."),
        mapper(404, "No such path on this gateway (%RESPONSE_CODE_DETAILS%)."),
        mapper(408, "The request did not arrive in time (%RESPONSE_CODE_DETAILS%)."),
        mapper(413, f"Request body too large: the limit is {s.max_request_body_bytes} bytes."),
        mapper(426, "HTTP/1.0 is not supported: use HTTP/1.1 or HTTP/2."),
        mapper(431, f"Request headers too large: the limit is {s.max_request_headers_kb} KiB."),
        mapper(501, "Not implemented (%RESPONSE_CODE_DETAILS%)."),
        mapper(502, "Bad response from the endpoint (%RESPONSE_FLAGS%)."),
        mapper(503, "No endpoint could serve the request: each one tried refused or dropped the connection; retry "
                    "shortly (%RESPONSE_FLAGS%).", {"retry-after": "1"}),
        mapper(504, "The endpoint did not answer in time (%RESPONSE_FLAGS%)."),
        mapper(None, "Gateway error (%RESPONSE_CODE_DETAILS%)."),
    ])


def _circuit_breakers() -> CircuitBreakers:
    # Envoy's default max_retries (3 concurrent) would silently drop failover retries under load.
    return CircuitBreakers(thresholds=[CircuitBreakersThresholds(
        priority=RoutingPriority.DEFAULT, max_connections=100000, max_pending_requests=100000,
        max_requests=100000, max_retries=100000)])


def _original_dst_cluster(name: str, header: str, connect_timeout_s: float, buffer_bytes: int) -> Cluster:
    return Cluster(
        name=name,
        per_connection_buffer_limit_bytes=buffer_bytes,
        type=ClusterDiscoveryType.ORIGINAL_DST,
        lb_policy=ClusterLbPolicy.CLUSTER_PROVIDED,
        connect_timeout=_duration(connect_timeout_s),
        cleanup_interval=_duration(60),
        original_dst_lb_config=ClusterOriginalDstLbConfig(use_http_header=True, http_header_name=header),
        circuit_breakers=_circuit_breakers(),
    )


def _strict_dns_cluster(name: str, hostports: Sequence[str], connect_timeout_s: float, **fields: Any) -> Cluster:
    # STRICT_DNS: accepts IPs, and also compose service names (the ext_proc container, model servers).
    return Cluster(
        name=name,
        type=ClusterDiscoveryType.STRICT_DNS,
        connect_timeout=_duration(connect_timeout_s),
        circuit_breakers=_circuit_breakers(),
        load_assignment=ClusterLoadAssignment(cluster_name=name, endpoints=[LocalityLbEndpoints(
            lb_endpoints=[LbEndpoint(endpoint=Endpoint(address=_address(h))) for h in hostports])]),
        **fields,
    )


def extproc_addresses(s: EnvoySettings) -> tuple[str, ...]:
    """The ext_proc replicas' addresses, replica index order: `extproc_replica_addresses`, else `extproc_address`."""
    return s.extproc_replica_addresses or (s.extproc_address,)


def _extproc_retry_policy(num_replicas: int) -> CoreRetryPolicy | None:
    """A routing stream that cannot start on one replica (refused, reset before any answer: it died or is
    restarting) is retried on another, so a request not yet routed meets no error; a stream that a replica
    answered is never retried (Envoy's async gRPC client retries only before the first response message)."""
    if num_replicas < 2:
        return None
    return CoreRetryPolicy(
        retry_on="connect-failure,refused-stream,reset,unavailable", num_retries=3,
        retry_back_off=CoreBackoffStrategy(base_interval=_duration(0.002), max_interval=_duration(0.02)),
        retry_host_predicate=[CoreRetryHostPredicate(
            name="envoy.retry_host_predicates.previous_hosts", typed_config=ProtoAny.pack(PreviousHostsPredicate()))],
        host_selection_retry_max_attempts=5)


def _retry_policy(s: EnvoySettings, num_retries: int, **fields: Any) -> RetryPolicy:
    # Envoy retries only while no response byte has gone to the client, so a streamed answer is never replayed.
    retry_on = "connect-failure,refused-stream,reset-before-request" + (",reset" if s.retry_on_reset else "")
    return RetryPolicy(retry_on=retry_on, num_retries=num_retries, **fields,
                       retry_back_off=RetryPolicyRetryBackOff(base_interval=_duration(0.002),
                                                              max_interval=_duration(0.01)))


def build_config(s: EnvoySettings) -> Bootstrap:
    """The Envoy bootstrap as a typed message (envoy-data-plane). Raises ValueError on invalid settings,
    and pydantic's ValidationError (a ValueError) when a message gets a field its API version lacks or a value
    of the wrong type: nothing is dropped silently. Each call builds new messages (no shared state)."""
    if s.failure_mode not in ("open", "closed"):
        raise ValueError(f"failure_mode must be 'open' or 'closed', got {s.failure_mode!r}")
    if not 0 <= s.num_fallbacks <= MAX_FALLBACKS:
        raise ValueError(f"num_fallbacks must be in 0..{MAX_FALLBACKS}, got {s.num_fallbacks}")
    if s.connection_buffer_bytes < 16 * 1024:
        raise ValueError(f"connection_buffer_bytes must be at least 16384 (Envoy's flow-control chunk), got "
                         f"{s.connection_buffer_bytes}")
    stripped = [*route_headers(MAX_FALLBACKS), SERVED_HEADER, REPLICA_HEADER, "x-envoy-original-dst-host"]
    replicas = extproc_addresses(s)
    served_header = [_set_header(SERVED_HEADER, "%UPSTREAM_HOST%")]
    upstream_timeout = _duration(s.upstream_timeout_s)
    allowed = _allowed_path_matches(s)
    token_secret = _extproc_token_secret(s)

    # Every route that reaches an endpoint matches one allowlisted path (exact or prefix, on the normalised
    # path, query string aside), so only those are ever forwarded, whether or not ext_proc answered.
    def picked_route(match: RouteMatch, replica: int | None = None) -> Route:
        # With several replicas, replica k's picks (its x-prefixroute-replica header) take the route whose
        # observing filter talks to replica k alone: the filter resolves its per-route configuration at its own
        # request headers, after the routing filter's header mutation cleared the route cache, so the observing
        # stream reaches the replica holding the pick it reports on (tracking.py correlates only its own picks).
        headers = [HeaderMatcher(name=DESTINATION_HEADER, present_match=True)]
        per_filter: dict[str, ProtoAny] = {}
        name = f"picked_endpoint {_match_text(match)}"
        if replica is not None:
            headers.append(HeaderMatcher(name=REPLICA_HEADER, string_match=StringMatcher(exact=str(replica))))
            name += f" replica {replica}"
            if s.observe_responses:
                per_filter[OBSERVE_FILTER] = ProtoAny.pack(ExtProcPerRoute(overrides=ExtProcOverrides(
                    grpc_service=GrpcService(
                        envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=f"{EXTPROC_REPLICA_CLUSTER_PREFIX}{replica}")))))
        return Route(
            name=name,
            match=RouteMatch(path=match.path, prefix=match.prefix, headers=headers),
            route=RouteAction(cluster=PICKED_CLUSTER, timeout=upstream_timeout,
                              retry_policy=_retry_policy(s, s.num_fallbacks)),
            response_headers_to_add=served_header,
            request_headers_to_remove=[REPLICA_HEADER] if replica is not None else [],
            typed_per_filter_config=per_filter,
        )

    def unpicked_route(match: RouteMatch) -> Route:
        stateful = match.path == RESPONSES_PATH or (match.prefix or "").startswith(RESPONSES_PREFIX)
        # These routes are what Envoy matches at request headers, before the picker set its header, so their
        # body limit is what the ext_proc filter may buffer. A direct-response route takes no body limit (only
        # a route with an action does): its requests were buffered to the connection's 32 KiB and a 33 KB
        # Responses body got Envoy's 413 (issue 27). So they route to a cluster without endpoints, and the
        # 503 that Envoy then answers gets its message from the local reply mapper of its route (UNAVAILABLE_*).
        if stateful:  # module docstring: the Responses API fails closed whatever failure_mode says
            return Route(name=f"{UNAVAILABLE_STATEFUL_ROUTE} {_match_text(match)}", match=match,
                         route=RouteAction(cluster=UNAVAILABLE_CLUSTER))
        if s.failure_mode == "open" and s.endpoints:
            return Route(
                name=f"extproc_unavailable_round_robin {_match_text(match)}",
                match=match,
                route=RouteAction(cluster=POOL_CLUSTER, timeout=upstream_timeout, retry_policy=_retry_policy(
                    s, max(1, len(s.endpoints) - 1),
                    retry_host_predicate=[RetryPolicyRetryHostPredicate(
                        name="envoy.retry_host_predicates.previous_hosts",
                        typed_config=ProtoAny.pack(PreviousHostsPredicate()))],
                    host_selection_retry_max_attempts=5)),
                response_headers_to_add=served_header,
            )
        return Route(name=f"{UNAVAILABLE_CLOSED_ROUTE} {_match_text(match)}", match=match,
                     route=RouteAction(cluster=UNAVAILABLE_CLUSTER))

    http_filters: list[HttpFilter] = []
    if s.extproc_enabled:
        http_filters.append(HttpFilter(name=ROUTING_FILTER, typed_config=ProtoAny.pack(ExternalProcessor(
            # No grpc_service timeout: one stream lives as long as its HTTP request (long streams);
            # message_timeout bounds each answer instead. The initial metadata tells the service that an
            # observing filter follows (so it waits for that stream's report before emitting a record).
            grpc_service=GrpcService(
                envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=EXTPROC_CLUSTER),
                # The GrpcService's own policy (EnvoyGrpc.retry_policy is for xDS streams only).
                retry_policy=_extproc_retry_policy(len(replicas)),
                initial_metadata=[HeaderValue(key=OBSERVED_METADATA, value="1")] if s.observe_responses else []),
            failure_mode_allow=s.failure_mode == "open",
            status_on_error=HttpStatus(code=StatusCode.ServiceUnavailable),
            message_timeout=_duration(s.extproc_message_timeout_ms / 1000),
            processing_mode=ProcessingMode(
                # Headers must be sent (and answered at once) for the body to reach us before routing.
                request_header_mode=HeaderSendMode.SEND,
                # The served header is needed once: the observing filter, when present, sees it without making
                # Envoy wait, so this filter's blocking response-headers round trip is skipped then.
                response_header_mode=HeaderSendMode.SEND if s.report_served and not s.observe_responses
                else HeaderSendMode.SKIP,
                # BUFFERED, measured faster here than FULL_DUPLEX_STREAMED (which saves the CONTINUE round
                # trip but makes the picker hand the whole body back). send_body_without_waiting_for_
                # header_response has no effect with BUFFERED in Envoy 1.40 (checked): not set.
                request_body_mode=BodySendMode.BUFFERED,
                # Responses (incl. SSE streams) flow through unbuffered and unseen.
                response_body_mode=BodySendMode.NONE,
                request_trailer_mode=HeaderSendMode.SKIP,
                response_trailer_mode=HeaderSendMode.SKIP,
            ),
            metadata_options=MetadataOptions(
                receiving_namespaces=MetadataOptionsMetadataNamespaces(untyped=[LB_METADATA_NAMESPACE])),
        ))))
    if s.extproc_enabled and s.observe_responses:
        http_filters.append(HttpFilter(name=OBSERVE_FILTER, typed_config=ProtoAny.pack(ExternalProcessor(
            grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=EXTPROC_CLUSTER)),
            # Send-and-go: Envoy never waits for an answer, so the token stream is not slowed; a telemetry
            # failure never fails a request.
            observability_mode=True,
            failure_mode_allow=True,
            # After the HTTP stream ends Envoy keeps the side stream this long so queued messages (the
            # last body chunk) still reach the service; the service itself stops waiting after 2 s.
            deferred_close_timeout=_duration(2),
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
    http_filters.append(HttpFilter(name="envoy.filters.http.router", typed_config=ProtoAny.pack(Router())))

    if s.extproc_enabled:
        # The picked route first: it matches only once the picker has set its header.
        per_replica = range(len(replicas)) if len(replicas) > 1 else ()
        routes = [r for m in allowed
                  for r in (*(picked_route(m, k) for k in per_replica), picked_route(m), unpicked_route(m))]
    else:
        routes = [Route(name=f"direct {_match_text(m)}", match=m,
                        route=RouteAction(cluster=POOL_CLUSTER, timeout=upstream_timeout),
                        response_headers_to_add=served_header) for m in allowed]
    ext_proc_filters = [f.name for f in http_filters if f.name != "envoy.filters.http.router"]
    if s.health_path:
        # Answered by Envoy alone, so it says whether the listener serves (issue 27); no allowlisted path is it.
        routes.append(_direct_route("gateway_health", RouteMatch(path=s.health_path), 200,
                                    orjson.dumps({"status": "ok"}).decode(), ext_proc_filters))
    routes += [
        # CONNECT matches only routes with a connect_matcher; without this one an HTTP/1 CONNECT went to the
        # ext_proc filter as a tunnel whose body never ends (no answer at all).
        _not_found_route("connect_not_allowed", RouteMatch(connect_matcher=RouteMatchConnectMatcher()), 405,
                         "CONNECT is not supported: this is an OpenAI API gateway.", ext_proc_filters),
        _not_found_route("path_not_allowed", RouteMatch(prefix="/"), 404,
                         "No such path on this gateway; it serves the OpenAI inference API.", ext_proc_filters),
    ]

    records_log, records_cluster, records_secret = _records_access_log(s)
    hcm = HttpConnectionManager(
        access_log=records_log,
        stat_prefix="gateway",
        codec_type=HttpConnectionManagerCodecType.AUTO,
        early_header_mutation_extensions=[TypedExtensionConfig(
            name="envoy.http.early_header_mutation.header_mutation",
            typed_config=ProtoAny.pack(EarlyHeaderMutation(mutations=[HeaderMutation(remove=h) for h in stripped])))],
        route_config=RouteConfiguration(name="gateway", virtual_hosts=[VirtualHost(
            name="inference", domains=["*"], routes=routes,
            # What a BUFFERED ext_proc body may grow to (413 above it), apart from the small per-connection
            # buffers: a slow client then costs connection_buffer_bytes, not max_request_body_bytes.
            request_body_buffer_limit=s.max_request_body_bytes)]),
        http_filters=http_filters,
        local_reply_config=_local_reply_config(s),
        # Route on the path the endpoint will see: escaped slashes decoded first (Envoy unescapes before it
        # normalises), then dot segments resolved and '//' merged; the path forwarded is that normalised one, so an
        # endpoint never decodes a %2F into a path other than the one matched. Model ids hold slashes, and SDKs
        # send them escaped (GET /v1/models/meta-llama%2FLlama-3.1-8B-Instruct): refusing them would refuse those.
        normalize_path=True,
        merge_slashes=True,
        path_with_escaped_slashes_action=HttpConnectionManagerPathWithEscapedSlashesAction.UNESCAPE_AND_FORWARD,
        request_headers_timeout=_duration(s.request_headers_timeout_s),
        request_timeout=_duration(s.request_timeout_s),
        stream_idle_timeout=_duration(s.stream_idle_timeout_s),
        common_http_protocol_options=CoreHttpProtocolOptions(idle_timeout=_duration(s.idle_timeout_s)),
        max_request_headers_kb=s.max_request_headers_kb,
        # HTTP/1.0 is refused with 426 (accept_http_10 off, Envoy's default): it has no chunked encoding, so
        # a token stream could only be close-delimited; every OpenAI client speaks HTTP/1.1 or HTTP/2.
        http_protocol_options=Http1ProtocolOptions(accept_http_10=False),
        # HTTP/2 clients: per-stream window = what one stream may buffer here (Envoy's edge recommendation).
        http2_protocol_options=Http2ProtocolOptions(
            max_concurrent_streams=100, initial_stream_window_size=64 * 1024,
            initial_connection_window_size=1024 * 1024),
    )

    clusters: list[Cluster] = []
    if s.extproc_enabled:
        sub = [_original_dst_cluster(f"{PICKED_CLUSTER}_{i}", h, s.connect_timeout_s, s.connection_buffer_bytes)
               for i, h in enumerate(route_headers(s.num_fallbacks))]
        clusters.append(Cluster(
            name=PICKED_CLUSTER,
            connect_timeout=_duration(s.connect_timeout_s),
            lb_policy=ClusterLbPolicy.CLUSTER_PROVIDED,
            cluster_type=ClusterCustomClusterType(name="envoy.clusters.composite", typed_config=ProtoAny.pack(
                CompositeClusterConfig(clusters=[ClusterConfigClusterEntry(name=c.name) for c in sub]))),
            circuit_breakers=_circuit_breakers(),
        ))
        clusters.extend(sub)
        # Every in-flight HTTP request holds one gRPC stream (two with the observing filter): Envoy's default
        # of 1024 concurrent requests per cluster would fail requests open beyond that (hence the breakers).
        tls_socket = _extproc_transport_socket(s)
        grpc_fields: dict[str, Any] = {
            **({"transport_socket": tls_socket} if tls_socket is not None else {}),
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": ProtoAny.pack(HttpProtocolOptions(
                    explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(
                        http2_protocol_options=Http2ProtocolOptions()),
                    # The token on every stream to a replica, from the secret (never initial metadata).
                    http_filters=_credential_filters() if token_secret is not None else []))}}
        if len(replicas) > 1:
            # Least request: a replica busy with long streams gets fewer new ones. A replica that refuses
            # connections is ejected after two local-origin failures (its streams are retried elsewhere:
            # _extproc_retry_policy) and stays out until a gRPC health check (every 0.25 s) finds it ready
            # again (_extproc_health_check): a restarted replica listens only once it is ready to route.
            grpc_fields |= {
                "lb_policy": ClusterLbPolicy.LEAST_REQUEST,
                "outlier_detection": OutlierDetection(
                    split_external_local_origin_errors=True, consecutive_local_origin_failure=2,
                    enforcing_consecutive_local_origin_failure=100, interval=_duration(0.25),
                    base_ejection_time=_duration(10), max_ejection_time=_duration(30), max_ejection_percent=100),
                "health_checks": [_extproc_health_check()]}
        clusters.append(_strict_dns_cluster(EXTPROC_CLUSTER, replicas, 0.25, **grpc_fields))
        if len(replicas) > 1:
            clusters += [_strict_dns_cluster(f"{EXTPROC_REPLICA_CLUSTER_PREFIX}{k}", [a], 0.25, **grpc_fields)
                         for k, a in enumerate(replicas) if s.observe_responses]
    if s.extproc_enabled:  # the unavailable routes' target: no endpoint, so Envoy answers 503 (mapped below)
        clusters.append(Cluster(name=UNAVAILABLE_CLUSTER, type=ClusterDiscoveryType.STATIC,
                                connect_timeout=_duration(s.connect_timeout_s),
                                per_connection_buffer_limit_bytes=s.connection_buffer_bytes,
                                load_assignment=ClusterLoadAssignment(cluster_name=UNAVAILABLE_CLUSTER)))
    if records_cluster is not None:
        clusters.append(records_cluster)
    if s.endpoints and (s.failure_mode == "open" or not s.extproc_enabled):
        clusters.append(_strict_dns_cluster(POOL_CLUSTER, s.endpoints, s.connect_timeout_s,
                                            lb_policy=ClusterLbPolicy.ROUND_ROBIN,
                                            per_connection_buffer_limit_bytes=s.connection_buffer_bytes))

    return Bootstrap(
        admin=_admin(s),
        overload_manager=OverloadManager(resource_monitors=[ResourceMonitor(
            name="envoy.resource_monitors.global_downstream_max_connections",
            typed_config=ProtoAny.pack(DownstreamConnectionsConfig(
                max_active_downstream_connections=s.max_downstream_connections)))]),
        static_resources=BootstrapStaticResources(
            listeners=[Listener(
                name="gateway",
                address=_address(f"{s.listen_address}:{s.gateway_port}"),
                # Read-ahead per client connection (the request body limit is the virtual host's).
                per_connection_buffer_limit_bytes=s.connection_buffer_bytes,
                filter_chains=[FilterChain(filters=[Filter(
                    name="envoy.filters.network.http_connection_manager", typed_config=ProtoAny.pack(hcm))])],
            )],
            clusters=clusters,
            secrets=[*([token_secret] if token_secret is not None and s.extproc_enabled else []),
                     *([records_secret] if records_secret is not None else [])],
        ),
    )


HEADER = """Envoy configuration of the prefixroute gateway. GENERATED: do not edit by hand.
Rendered by `prefixroute envoy-config --out envoy/envoy.yaml` with default settings; a test asserts
this file equals the rendering. See extproc/envoy_config.py for the design:
- early header mutation strips client-supplied routing headers (a client never picks an address);
- ext_proc (our endpoint picker) sets x-gateway-destination-endpoint + ordered fallback headers, and
  traceparent (its span) for the model server;
- a second ext_proc filter in observability mode (never waited on) streams the response to the picker
  for per-request telemetry: gateway TTFT, latency, token usage, served endpoint;
- route `picked_endpoint` (only when that header is present) -> composite cluster: attempt k goes to
  the ORIGINAL_DST sub-cluster keyed on the k-th header; retried only before any response byte;
- ext_proc down: fail-open to round-robin over the configured endpoints (failure_mode=open),
  or an OpenAI-format 503 (failure_mode=closed);
- only allowlisted OpenAI paths are routed (normalised first); any other path gets a 404 from Envoy;
- bodies over max_request_body_bytes get 413; Envoy's own error replies use the OpenAI JSON error format;
- small per-connection buffers, request-headers/request/idle timeouts (slow clients cost little)."""


def render(s: EnvoySettings | None = None) -> str:
    """The configuration as YAML text, `HEADER` as leading comment lines. Deterministic: keys in the order of
    the messages' field declarations, never sorted; values in the proto3 JSON mapping (snake_case, default values
    omitted, durations as "1.500s", 64-bit integers as strings)."""
    data = build_config(s or EnvoySettings()).to_dict(casing=betterproto2.Casing.SNAKE)
    # No line width: a folded scalar (an error-body template) would be valid YAML but unreadable.
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=sys.maxsize)
    return "".join(f"# {line}".rstrip() + "\n" for line in HEADER.splitlines()) + body


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="Write to this file instead of stdout.")
    settings.add_arguments(parser, EnvoySettings)


def main(args: argparse.Namespace) -> int:
    try:
        s = settings.from_namespace(EnvoySettings, args)
        text = render(s)
    except (ValueError, OSError) as exc:
        print(f"prefixroute envoy-config: {exc}", file=sys.stderr)
        return 2
    if args.out:
        if extproc_auth_token(s):
            # The bearer token is in it: owner-only, whatever the umask (and tightened if the file existed).
            fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        else:
            args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0
