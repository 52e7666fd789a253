"""Names shared by the Envoy configuration (the envoy_config package) and the ext_proc hot path (servicer.py,
tracking.py): headers, metadata keys and the fallback limit. A leaf module: importing it costs nothing, so
the routing process never loads the typed Envoy configuration classes.

Protocol facts (Gateway API Inference Extension endpoint picker): the picker names the endpoint in
`DESTINATION_HEADER` and in dynamic metadata `LB_METADATA_NAMESPACE` / `DESTINATION_HEADER`, with the same
value (GIE: one ``ip:port`` or an ordered comma list); the proxy reports the endpoint that served in
`SERVED_HEADER` (our Envoy) or in the request's metadata `LB_METADATA_NAMESPACE` / `SERVED_HEADER` (GIE), and
may restrict the pick to a subset (`SUBSET_NAMESPACE` / `SUBSET_KEY`, a list of ``ip:port``).
"""

from __future__ import annotations

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SERVED_HEADER = "x-gateway-destination-endpoint-served"
LB_METADATA_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
FALLBACK_HEADER_PREFIX = "x-prefixroute-fallback-endpoint-"
TRACEPARENT_HEADER = "traceparent"
REFUSED_HEADER = "x-prefixroute-refused"
"""Set on the router's own refusals (its ImmediateResponse): the observing filter's stream of such a request
starts at these response headers, and the routing stream has already recorded it."""
REPLICA_HEADER = "x-prefixroute-replica"
"""Set by ext_proc replica k (of several) on the requests it routes, value ``k``: Envoy's route for it sends the
request's observing stream to replica k (envoy_config/routes.py). Stripped from client requests, and removed before the
request goes to the endpoint."""
OBSERVED_METADATA = "x-prefixroute-observed"
"""gRPC initial metadata of the routing filter's stream when an observing filter follows it (so the service
waits for that stream's report before emitting a record)."""
AUTHZ_CHECK_PATH_PREFIX = "/check"
"""Envoy's ext_authz HTTP ``path_prefix`` (extproc/authz_http.py): a check's path is this and the client's path, so
the router's own paths (``/health``) can never be a client's."""
AUTHZ_TOKEN_HEADER = "x-prefixroute-router-token"
"""Where Envoy puts the router's bearer token on an ext_authz HTTP check (its credential injector): not
``authorization``, which carries the client's own key to the Responses API lookups."""
HANDOFF_HEADER = "x-prefixroute-handoff"
"""ext_authz routing (authz.py): on a check, Envoy says with it (value ``ext_proc``) that its configuration has the
handoff route; on the router's answer, the request is handed to the ext_proc routing filter, which that route runs
(a request flow control would hold, or a large body parsed off the router's loop: both may outlast the ext_authz
timeout, which cannot be extended per request). Stripped from client requests; removed before the endpoint."""
HANDOFF_VALUE = "ext_proc"
PARTIAL_BODY_HEADER = "x-envoy-auth-partial-body"
"""Envoy's ext_authz filter says with it (``true``) that the check carries only the first max_request_bytes of the
body (with_request_body.allow_partial_message). Not always: Envoy 1.40 says ``false`` when its buffer held exactly
max_request_bytes as it sent the check (it compares the two lengths), so `AUTHZ_BODY_BYTES_HEADER` says the limit."""
AUTHZ_BODY_BYTES_HEADER = "x-prefixroute-authz-body-bytes"
"""On a check from our configuration: the ext_authz filter's max_request_bytes. A body that long may have been cut
whatever PARTIAL_BODY_HEADER says, so the router hands it off (authz.py)."""
TRANSPORTED_5XX = (500, 501, 502, 503, 504)
"""The 5xx refusals that travel as `transport_status`; Envoy's local reply mapping restores each. Another 5xx
(none is raised today) travels as 500's."""


def transport_status(status: int) -> int:
    """The status a refusal travels with from the router to Envoy: a 5xx as 470 + its last digit (Envoy would
    take a 5xx for the service's failure), any other as itself."""
    if status < 500:
        return status
    return 470 + (status - 500 if status in TRANSPORTED_5XX else 0)


EXT_PROC_ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"
"""Key of `ProcessingRequest.attributes` under which Envoy's ext_proc filter sends the attributes it was told to."""
OBSERVE_ATTRIBUTES = {"request.headers['traceparent']": TRACEPARENT_HEADER, "request.id": "x-request-id",
                      "request.url_path": ":path"}
"""The observing filter's response_attributes (Envoy CEL attribute -> the request header it stands for): sent
with its first message, the response headers, so that stream skips the request headers message and still
carries the correlation key (the routing filter's traceparent), the request id and the path."""

MAX_FALLBACKS = 4
"""Most fallback attempts the Envoy config may have. The picker always sets this many fallback headers, so
an Envoy rendered with any num_fallbacks <= MAX_FALLBACKS never meets an attempt without its header, whatever
num_fallbacks the picker itself was started with."""


def fallback_header(k: int) -> str:
    """Header carrying the k-th fallback endpoint (k >= 1)."""
    return f"{FALLBACK_HEADER_PREFIX}{k}"


def route_headers(num_fallbacks: int) -> tuple[str, ...]:
    """Headers the picker sets, in attempt order: the primary, then each fallback (0 <= num_fallbacks)."""
    return (DESTINATION_HEADER, *(fallback_header(k) for k in range(1, num_fallbacks + 1)))


# Who a request is from (extproc/tenants.py). A client never sets these: prefixroute's Envoy configuration strips
# every client copy at ingress (envoy_config/listener.py), except those an ingress in front is trusted to set
# (EnvoySettings.trusted_ingress_headers), and sets the fairness header itself.
PRIORITY_HEADER = "x-prefixroute-priority"
TENANT_HEADER = "x-prefixroute-tenant"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
"""GIE's InferenceObjective name; its priority comes from the operator's table (objective_priorities) only."""
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
"""GIE's fairness id header: the request's flow in the gateway queue."""
FLOW_HEADER_VALUE = "address:%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%"
"""What prefixroute's Envoy sets `FAIRNESS_HEADER` to on every request (an Envoy format string): the client
connection's peer address, which a client cannot choose per request (new connections are free to open, new
addresses are not); removed before the request reaches an endpoint."""
SCHEDULING_HEADERS = (PRIORITY_HEADER, TENANT_HEADER, OBJECTIVE_HEADER, FAIRNESS_HEADER)
