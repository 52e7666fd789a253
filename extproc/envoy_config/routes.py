"""The routes: for each allowlisted path, the picked route (to the endpoint the picker set, with its fallbacks) and
the route taken when the picker did not answer (fail open to round-robin, or a 503); Envoy's own health route;
and direct 404/405 replies for every other path and for CONNECT (both ext_proc filters disabled on them)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import orjson
from envoy_data_plane.envoy.config.core.v3 import DataSource, GrpcService, GrpcServiceEnvoyGrpc, HeaderValueOption
from envoy_data_plane.envoy.config.route.v3 import (DirectResponseAction, HeaderMatcher, RetryPolicy,
                                                    RetryPolicyRetryBackOff, RetryPolicyRetryHostPredicate, Route,
                                                    RouteAction, RouteMatch, RouteMatchConnectMatcher)
from envoy_data_plane.envoy.extensions.filters.http.ext_authz.v3 import ExtAuthzPerRoute
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ExtProcOverrides, ExtProcPerRoute
from envoy_data_plane.envoy.extensions.filters.http.lua.v3 import LuaPerRoute
from envoy_data_plane.envoy.extensions.retry.host.previous_hosts.v3 import PreviousHostsPredicate
from envoy_data_plane.envoy.type.matcher.v3 import StringMatcher
from envoy_data_plane.google.protobuf import Any as ProtoAny

from prefixroute.extproc.envoy_config.common import (AUTHZ_FILTER, AUTHZ_PROCESSING, EXTPROC_REPLICA_CLUSTER_PREFIX,
                                                     OBSERVE_FILTER, PICKED_CLUSTER, POOL_CLUSTER, ROUTING_FILTER,
                                                     UNAVAILABLE_CLOSED_ROUTE, UNAVAILABLE_CLUSTER,
                                                     UNAVAILABLE_STATEFUL_ROUTE, duration, error_json, set_header)
from prefixroute.extproc.envoy_config.envoy_settings import EnvoySettings
from prefixroute.extproc.envoy_config.timing import TIMING_FILTER
from prefixroute.extproc.headers import (DESTINATION_HEADER, FAIRNESS_HEADER, HANDOFF_HEADER, REPLICA_HEADER,
                                         SERVED_HEADER)
from prefixroute.responses_prompt import RESPONSES_PATH, RESPONSES_PREFIX

# Characters an allowlisted path may hold: RFC 3986 pchar without '%' (an escaped form never matches a
# normalised path) and without ';' (a path parameter would be a second spelling of the same path).
_PATH_RE = re.compile(r"^/[A-Za-z0-9._~!$&'()*+,=:@/-]*$")


def gateway_routes(s: EnvoySettings, allowed: Sequence[RouteMatch], num_replicas: int,
                   ext_proc_filters: Sequence[str]) -> list[Route]:
    """The virtual host's routes, first match wins. Every route that reaches an endpoint matches one allowlisted
    path (exact or prefix, on the normalised path, query string aside), so only those are ever forwarded, whether
    or not ext_proc answered; `ext_proc_filters` (the ext_proc filters and the Lua filter of timing.py or facts.py)
    are disabled on the routes Envoy answers itself."""
    if s.extproc_enabled:
        # The picked route first: it matches only once the picker has set its header.
        per_replica = range(num_replicas) if num_replicas > 1 else ()
        routes = [r for m in allowed
                  for r in (*(picked_route(s, m, k) for k in per_replica), picked_route(s, m),
                            *([handoff_route(s, m)] if s.routing_processing in AUTHZ_PROCESSING else []),
                            unpicked_route(s, m))]
    else:
        routes = [Route(name=f"direct {match_text(m)}", match=m,
                        route=RouteAction(cluster=POOL_CLUSTER, timeout=duration(s.upstream_timeout_s)),
                        response_headers_to_add=_served_header()) for m in allowed]
    if s.health_path:
        # Answered by Envoy alone, so it says whether the listener serves; no allowlisted path is it.
        routes.append(direct_route("gateway_health", RouteMatch(path=s.health_path), 200,
                                   orjson.dumps({"status": "ok"}).decode(), ext_proc_filters))
    routes += [
        # CONNECT matches only routes with a connect_matcher; without this one an HTTP/1 CONNECT went to the
        # ext_proc filter as a tunnel whose body never ends (no answer at all).
        not_found_route("connect_not_allowed", RouteMatch(connect_matcher=RouteMatchConnectMatcher()), 405,
                        "CONNECT is not supported: this is an OpenAI API gateway.", ext_proc_filters),
        not_found_route("path_not_allowed", RouteMatch(prefix="/"), 404,
                        "No such path on this gateway; it serves the OpenAI inference API.", ext_proc_filters),
    ]
    return routes


def _served_header() -> list[HeaderValueOption]:
    # Envoy names the endpoint that served on every routed response (the picker learns failovers from it).
    return [set_header(SERVED_HEADER, "%UPSTREAM_HOST%")]


def picked_route(s: EnvoySettings, match: RouteMatch, replica: int | None = None) -> Route:
    """The route of a request the picker routed (its header set; with several replicas, replica k's
    own route for each k): to the picked endpoint, failing over to the fallbacks in order."""
    # With several replicas, replica k's picks (its x-prefixroute-replica header) take the route whose
    # observing filter talks to replica k alone: the filter resolves its per-route configuration at its own
    # request headers, after the routing filter's header mutation cleared the route cache, so the observing
    # stream reaches the replica holding the pick it reports on (tracking.py correlates only its own picks).
    headers = [HeaderMatcher(name=DESTINATION_HEADER, present_match=True)]
    per_filter: dict[str, ProtoAny] = _handoff_only(s)
    name = f"picked_endpoint {match_text(match)}"
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
        route=RouteAction(cluster=PICKED_CLUSTER, timeout=duration(s.upstream_timeout_s),
                          retry_policy=retry_policy(s, s.num_fallbacks)),
        response_headers_to_add=_served_header(),
        # The client's address (the fairness header our listener sets) is the router's, not the endpoint's.
        request_headers_to_remove=[*([REPLICA_HEADER] if replica is not None else []),
                                   *([] if FAIRNESS_HEADER in s.trusted_ingress_headers else [FAIRNESS_HEADER]),
                                   *([HANDOFF_HEADER] if s.routing_processing in AUTHZ_PROCESSING else [])],
        typed_per_filter_config=per_filter,
    )


def _handoff_only(s: EnvoySettings) -> dict[str, ProtoAny]:
    """Routed by ext_authz, the ext_proc routing filter runs on the handoff route alone: disabled on the others
    (Envoy reads it when the filter's turn comes, after ext_authz's answer routed the request again)."""
    if s.routing_processing not in AUTHZ_PROCESSING:
        return {}
    return {ROUTING_FILTER: ProtoAny.pack(ExtProcPerRoute(disabled=True))}


def handoff_route(s: EnvoySettings, match: RouteMatch) -> Route:
    """Routed by ext_authz: the route of a request the router handed to the ext_proc routing filter (its answer
    set HANDOFF_HEADER alone: a request flow control holds, or a large body parsed off its loop; authz.py). That
    filter runs here, answers with the routing headers and routes the request again (to its picked route); if it
    fails, the request takes what an unpicked one would (round robin or 503, per failure_mode)."""
    unpicked = unpicked_route(s, match)
    return Route(
        name=f"handoff {match_text(match)}",
        match=RouteMatch(path=match.path, prefix=match.prefix,
                         headers=[HeaderMatcher(name=HANDOFF_HEADER, present_match=True)]),
        route=unpicked.route,
        response_headers_to_add=unpicked.response_headers_to_add,
    )


def unpicked_route(s: EnvoySettings, match: RouteMatch) -> Route:
    """The route of a request the picker did not route (the ext_proc service is down or timed out)."""
    stateful = match.path == RESPONSES_PATH or (match.prefix or "").startswith(RESPONSES_PREFIX)
    # These routes are what Envoy matches at request headers, before the picker set its header, so their
    # body limit is what the ext_proc filter may buffer. A direct-response route takes no body limit (only
    # a route with an action does): its requests were buffered to the connection's 32 KiB and a 33 KB
    # Responses body got Envoy's 413. So they route to a cluster without endpoints, and the
    # 503 that Envoy then answers gets its message from the local reply mapper of its route (UNAVAILABLE_*).
    if stateful:  # module docstring: the Responses API fails closed whatever failure_mode says
        return Route(name=f"{UNAVAILABLE_STATEFUL_ROUTE} {match_text(match)}", match=match,
                     route=RouteAction(cluster=UNAVAILABLE_CLUSTER), typed_per_filter_config=_handoff_only(s))
    if s.failure_mode == "open" and s.endpoints:
        return Route(
            name=f"extproc_unavailable_round_robin {match_text(match)}",
            match=match,
            route=RouteAction(cluster=POOL_CLUSTER, timeout=duration(s.upstream_timeout_s), retry_policy=retry_policy(
                s, max(1, len(s.endpoints) - 1),
                retry_host_predicate=[RetryPolicyRetryHostPredicate(
                    name="envoy.retry_host_predicates.previous_hosts",
                    typed_config=ProtoAny.pack(PreviousHostsPredicate()))],
                host_selection_retry_max_attempts=5)),
            response_headers_to_add=_served_header(),
            typed_per_filter_config=_handoff_only(s),
        )
    return Route(name=f"{UNAVAILABLE_CLOSED_ROUTE} {match_text(match)}", match=match,
                 route=RouteAction(cluster=UNAVAILABLE_CLUSTER), typed_per_filter_config=_handoff_only(s))


def retry_policy(s: EnvoySettings, num_retries: int, **fields: Any) -> RetryPolicy:
    # Envoy retries only while no response byte has gone to the client, so a streamed answer is never replayed.
    retry_on = "connect-failure,refused-stream,reset-before-request" + (",reset" if s.retry_on_reset else "")
    return RetryPolicy(retry_on=retry_on, num_retries=num_retries, **fields,
                       retry_back_off=RetryPolicyRetryBackOff(base_interval=duration(0.002),
                                                              max_interval=duration(0.01)))


def allowed_path_matches(s: EnvoySettings) -> list[RouteMatch]:
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


def match_text(m: RouteMatch) -> str:
    return m.path if m.path is not None else f"{m.prefix}*"


def not_found_route(name: str, match: RouteMatch, status: int, message: str, filters: Sequence[str]) -> Route:
    # Answered by Envoy with neither ext_proc filter nor the Lua filter running: the router never spends a
    # decision (or a telemetry record) on a path it does not serve.
    return direct_route(name, match, status, error_json(status, message), filters)


def direct_route(name: str, match: RouteMatch, status: int, body: str, filters: Sequence[str]) -> Route:
    return Route(
        name=name, match=match,
        direct_response=DirectResponseAction(status=status, body=DataSource(inline_string=body)),
        response_headers_to_add=[set_header("content-type", "application/json")],
        typed_per_filter_config={f: ProtoAny.pack(LuaPerRoute(disabled=True) if f == TIMING_FILTER
                                                  else ExtAuthzPerRoute(disabled=True) if f == AUTHZ_FILTER
                                                  else ExtProcPerRoute(disabled=True)) for f in filters},
    )
