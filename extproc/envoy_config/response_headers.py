"""What reaches a client: the response headers Envoy removes from every answer, whatever a server sends.

The router's own headers travel on the request to the endpoint (destination, fallbacks, replica, handoff, the
router-drawn ``traceparent`` whose span id keys the facts records), and Envoy names the endpoint that served on
every routed response (`SERVED_HEADER`: the router and the facts path read it on the way back). None of it is the
client's business, and some of it is a capability (the span id let a forged facts record find its pick). A server
that echoes request headers (the simulated servers did, vLLM 0.32 echoes ``X-Request-Id``, Envoy's request id,
with ``--enable-request-id-headers``) would hand them to the client: so Envoy removes each of `INTERNAL_RESPONSE_HEADERS`
from every response, in a header mutation filter first in the chain, which on the response path runs last, after
the filters that read them, and on Envoy's local replies from any later filter too. `SERVED_HEADER` stays when the
operator asks (EnvoySettings.expose_served_endpoint).
"""

from __future__ import annotations

from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutation as MutationRule
from envoy_data_plane.envoy.extensions.filters.http.header_mutation.v3 import HeaderMutation, Mutations
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import HttpFilter
from envoy_data_plane.google.protobuf import Any as ProtoAny

from prefixroute.extproc.envoy_config.envoy_settings import EnvoySettings
from prefixroute.extproc.headers import (AUTHZ_BODY_BYTES_HEADER, AUTHZ_TOKEN_HEADER, HANDOFF_HEADER, MAX_FALLBACKS,
                                         OBSERVED_METADATA, REPLICA_HEADER, SERVED_HEADER, TRACEPARENT_HEADER,
                                         route_headers)

RESPONSE_HEADERS_FILTER = "prefixroute.strip_internal_response_headers"
INTERNAL_RESPONSE_HEADERS = (*route_headers(MAX_FALLBACKS), REPLICA_HEADER, HANDOFF_HEADER, OBSERVED_METADATA,
                             AUTHZ_TOKEN_HEADER, AUTHZ_BODY_BYTES_HEADER, TRACEPARENT_HEADER, "tracestate",
                             "traceresponse", "x-prefixroute-traceparent", "x-envoy-original-dst-host")
"""Removed from every response (module docstring), `SERVED_HEADER` too unless exposed. Not among them: the router's
``x-prefixroute-refused`` on its own refusals (documented for clients), Envoy's ``x-request-id`` and
``x-envoy-upstream-service-time`` (random or a duration: no routing secret)."""


def removed_response_headers(s: EnvoySettings) -> tuple[str, ...]:
    """The headers Envoy removes from every response under `s`."""
    return INTERNAL_RESPONSE_HEADERS + (() if s.expose_served_endpoint else (SERVED_HEADER,))


def response_headers_filter(s: EnvoySettings) -> HttpFilter:
    """The header mutation filter that removes `removed_response_headers` (first in the chain)."""
    return HttpFilter(name=RESPONSE_HEADERS_FILTER, typed_config=ProtoAny.pack(HeaderMutation(mutations=Mutations(
        response_mutations=[MutationRule(remove=h) for h in removed_response_headers(s)]))))
