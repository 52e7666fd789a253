"""Render the Envoy configuration of the gateway from typed settings (`prefixroute envoy-config`).

`build_config` builds the bootstrap from envoy-data-plane's typed messages (every listener, filter and
cluster as its own message, each `typed_config` a packed `Any` of the extension's message), so a misspelt
field or a wrong type fails at build time, not when Envoy loads the file. `render` writes it as YAML (its
proto3 JSON mapping: snake_case, default values omitted). The committed `envoy/envoy.yaml` is this
rendering with default settings (a test asserts equality, so it cannot drift).

The package's modules, one concern each: envoy_settings.py (`EnvoySettings`), listener.py (the listener, its HTTP
connection manager and filters), routes.py, clusters.py, replies.py (Envoy's own replies), auth.py (the ext_proc
token secret and TLS), admin.py, records.py (Envoy's request records), timing.py (their TTFT and latency on
Envoy's clock), facts.py (the facts path: the router's response facts from Envoy), common.py (names and small builders); `build_config` composes them.

Only what renders the configuration imports this package (this command, `prefixroute gateway`, the overhead
bench): envoy-data-plane is slow to import and to build the first time (pydantic schemas), so the ext_proc
service never loads it; the names it shares with the hot path live in `headers.py`
(tests/unit/extproc/test_envoy_config_hot_path.py checks it).

Request path through Envoy:

    listener -> HCM early header mutation: strip every routing header a client may have sent
             -> ext_proc filter (our picker): headers SEND, request body BUFFERED, response headers SEND
                (SKIP on the facts path, whose record names the served endpoint)
             -> ext_proc filter in observability mode (observe_responses, off by default): response headers
                (the request's traceparent, id and path as attributes) and response body STREAMED, sent
                without waiting for answers
             -> Lua filter (with records_otlp_address and first_token_lua): stamps a Responses API stream's
                first token time for Envoy's request record (timing.py); on the facts path (response_facts_lua,
                the default, in place of the observing filter) the facts filter, which also takes each response's usage and
                id for one OTLP facts record per request to the replica that routed it (facts.py)
             -> router: route on the header the picker set, else the ext_proc-down route

Telemetry (extproc/tracking.py): the picker also sets ``traceparent`` (its own span, a child
of the client's) on the request; the facts record carries it back, which correlates the record with the pick
(envoy_facts.py). With observe_responses instead, the observing filter sees it in its request headers,
which correlates its stream with the picker's, then reports the response's first body chunk (gateway TTFT),
its end (latency) and its usage; observability mode means Envoy forwards every chunk to the client at once.

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
  that one is off) and reports the primary as failed when another endpoint served. The client does not: a
  header mutation filter first in the chain removes it and every other router-internal header from every
  response, whatever the server sent (response_headers.py; `expose_served_endpoint` keeps this one).
- SECURITY: a client can never choose the address: early header mutation removes the routing headers
  before any filter runs, the picker only writes addresses from its endpoint pool, and the ORIGINAL_DST
  route is reachable only with the picker's header.

Processing modes (measured with `prefixroute overhead-bench`): request headers SEND (answered at once,
or decided there when the request has no body), request body BUFFERED (FULL_DUPLEX_STREAMED saves the
CONTINUE round trip but makes the picker hand the body back: slower here; every Envoy 1.40 option is named by
routing_processing and measured in bench-results/routing-modes/), response headers SEND only
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

What the gateway serves: only the allowlist (`allowed_paths` exact, `allowed_path_prefixes`):
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
cannot be normalised 400, 403, 404, 408 timeouts, 413, 426 any version but HTTP/1.1, 431, 502, 503 (no healthy endpoint, none
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
nor its log at any level (debug and trace included) shows the token (the admin port printed it).

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
import os
import sys
from pathlib import Path

import betterproto2
import yaml
from envoy_data_plane.envoy.config.bootstrap.v3 import Bootstrap, BootstrapStaticResources

from prefixroute import settings
from prefixroute.extproc.envoy_config.admin import ADMIN_READ_ONLY_PATHS, admin
from prefixroute.extproc.envoy_config.auth import EXTPROC_TOKEN_SECRET, extproc_auth_token, extproc_token_secret
from prefixroute.extproc.envoy_config.clusters import gateway_clusters
from prefixroute.extproc.envoy_config.common import (AUTHZ_FILTER, DIRECT_CLUSTER, EXTPROC_CLUSTER, EXTPROC_REPLICA_CLUSTER_PREFIX,
                                                     OBSERVE_FILTER, PICKED_CLUSTER, POOL_CLUSTER, ROUTING_FILTER,
                                                     UNAVAILABLE_CLOSED_ROUTE, UNAVAILABLE_CLUSTER,
                                                     UNAVAILABLE_STATEFUL_ROUTE, extproc_addresses)
from prefixroute.extproc.envoy_config.envoy_settings import (DEFAULT_ALLOWED_PATH_PREFIXES, DEFAULT_ALLOWED_PATHS,
                                                             EnvoySettings)
from prefixroute.extproc.envoy_config.listener import (connection_manager, gateway_listener,
                                                       http_filters, overload_manager)
from prefixroute.extproc.envoy_config.facts import facts_access_logs
from prefixroute.extproc.envoy_config.records import (RECORD_ATTRIBUTES, RECORDS_CLUSTER, RECORDS_TOKEN_SECRET,
                                                      records_access_log)
from prefixroute.extproc.envoy_config.replies import ENVOY_OWN_REPLY
from prefixroute.extproc.envoy_config.routes import allowed_path_matches, gateway_routes
from prefixroute.extproc.envoy_config.timing import TIMING_FILTER
from prefixroute.extproc.headers import (DESTINATION_HEADER, LB_METADATA_NAMESPACE, MAX_FALLBACKS,  # noqa: F401
                                         OBSERVE_ATTRIBUTES, OBSERVED_METADATA, REPLICA_HEADER, SERVED_HEADER,
                                         fallback_header, route_headers)

__all__ = ["ADMIN_READ_ONLY_PATHS", "DEFAULT_ALLOWED_PATHS", "DEFAULT_ALLOWED_PATH_PREFIXES", "DESTINATION_HEADER",
           "DIRECT_CLUSTER", "ENVOY_OWN_REPLY", "EXTPROC_CLUSTER", "EXTPROC_REPLICA_CLUSTER_PREFIX",
           "EXTPROC_TOKEN_SECRET", "HEADER", "LB_METADATA_NAMESPACE", "MAX_FALLBACKS", "OBSERVED_METADATA",
           "OBSERVE_ATTRIBUTES", "OBSERVE_FILTER", "PICKED_CLUSTER", "POOL_CLUSTER", "RECORDS_CLUSTER",
           "RECORDS_TOKEN_SECRET", "RECORD_ATTRIBUTES", "REPLICA_HEADER", "ROUTING_FILTER", "SERVED_HEADER",
           "UNAVAILABLE_CLOSED_ROUTE", "UNAVAILABLE_CLUSTER", "UNAVAILABLE_STATEFUL_ROUTE", "EnvoySettings",
           "build_config", "configure_parser", "extproc_addresses", "extproc_auth_token", "fallback_header", "main",
           "render", "route_headers"]


def build_config(s: EnvoySettings) -> Bootstrap:
    """The Envoy bootstrap as a typed message (envoy-data-plane). Raises ValueError on invalid settings,
    and pydantic's ValidationError (a ValueError) when a message gets a field its API version lacks or a value
    of the wrong type: nothing is dropped silently. Each call builds new messages (no shared state).
    Parts are built in this order, so that of several invalid settings the same one is reported first."""
    if s.failure_mode not in ("open", "closed"):
        raise ValueError(f"failure_mode must be 'open' or 'closed', got {s.failure_mode!r}")
    if not 0 <= s.num_fallbacks <= MAX_FALLBACKS:
        raise ValueError(f"num_fallbacks must be in 0..{MAX_FALLBACKS}, got {s.num_fallbacks}")
    if s.connection_buffer_bytes < 16 * 1024:
        raise ValueError(f"connection_buffer_bytes must be at least 16384 (Envoy's flow-control chunk), got "
                         f"{s.connection_buffer_bytes}")
    if s.observe_responses and s.response_facts_lua:
        # Two takers of the same facts: each pick would be reported twice, and the per-chunk stream the facts
        # path exists to remove would still run.
        raise ValueError("observe_responses and response_facts_lua are two ways to take the same response facts: "
                         "set one (envoy-config --observe-responses --no-response-facts-lua for the observing "
                         "filter)")
    replicas = extproc_addresses(s)
    allowed = allowed_path_matches(s)
    token_secret = extproc_token_secret(s)
    filters = http_filters(s, len(replicas))
    routes = gateway_routes(s, allowed, len(replicas),
                            [f.name for f in filters if f.name in (ROUTING_FILTER, AUTHZ_FILTER, OBSERVE_FILTER,
                                                                           TIMING_FILTER)])
    records_log, records_cluster, records_secret = records_access_log(s)
    hcm = connection_manager(s, routes, filters, records_log + facts_access_logs(s, replicas))
    clusters = gateway_clusters(s, replicas, token_secret, records_cluster)
    return Bootstrap(
        admin=admin(s),
        overload_manager=overload_manager(s),
        static_resources=BootstrapStaticResources(
            listeners=[gateway_listener(s, hcm)],
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
- a Lua filter takes each response's facts in Envoy (first token time, usage with cached tokens, response id)
  and one OTLP log record per request carries them, with status, served endpoint and Envoy's timing, to the
  picker that routed it: nothing per response chunk reaches the picker;
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


HELP_ESSENTIALS = (
    "out", "gateway_port", "listen_address", "admin_mode", "admin_port",  # where Envoy listens
    "extproc_address", "extproc_replica_addresses", "routing_processing", "failure_mode",
    "extproc_message_timeout_ms",  # the router
    "extproc_auth_token_file", "extproc_tls_ca_file", "extproc_tls_cert_file", "extproc_tls_key_file",
    "extproc_tls_server_name",  # how Envoy proves itself to the router, and the router to it
    "endpoints", "num_fallbacks", "upstream_timeout_s",  # the model servers
    "trusted_ingress_headers", "records_otlp_address",
)
"""The settings `prefixroute envoy-config --help` lists; --help-all lists all of them."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="Write to this file instead of stdout.")
    settings.add_arguments(parser, EnvoySettings)
    settings.essential_help(parser, HELP_ESSENTIALS)


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
