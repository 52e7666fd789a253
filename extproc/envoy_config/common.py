"""Names and small message builders shared by the parts of the Envoy configuration (clusters, routes, filters)."""

from __future__ import annotations

from datetime import timedelta

import orjson
from envoy_data_plane.envoy.config.core.v3 import (Address, HeaderValue, HeaderValueOption,
                                                   HeaderValueOptionHeaderAppendAction, SocketAddress)

from prefixroute.extproc.envoy_config.envoy_settings import EnvoySettings
from prefixroute.openai_errors import ERROR_TYPES

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
AUTHZ_FILTER = "envoy.filters.http.ext_authz"
"""The routing filter when it is Envoy's ext_authz (EnvoySettings.routing_processing 'authz-http')."""
AUTHZ_PROCESSING = ("authz-http",)
"""The routing_processing modes that route by Envoy's ext_authz filter (with the ext_proc filter on the handoff
route)."""
AUTHZ_HTTP_CLUSTER = "prefixroute_authz_http"
"""The replicas' ext_authz HTTP ports (routing_processing 'authz-http'; extproc/authz_http.py)."""
DEFAULT_AUTHZ_HTTP_PORT = 9004
"""The replicas' ext_authz HTTP port when `extproc_authz_http_addresses` is not given (the ext_proc hosts')."""


def duration(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def address(hostport: str) -> Address:
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {hostport!r}")
    return Address(socket_address=SocketAddress(address=host, port_value=int(port)))


def set_header(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, value=value),
                             append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD)


# Statuses only Envoy itself answers, named like openai_errors.ERROR_TYPES names the others.
ENVOY_ERROR_TYPES = {**ERROR_TYPES, 408: "RequestTimeoutError", 426: "UpgradeRequiredError",
                     431: "RequestHeaderFieldsTooLargeError", 501: "NotImplementedError"}


def error_json(status: int, message: str) -> str:
    # Same shape as prefixroute.openai_errors.error_body; Envoy fills %...% operators at reply time.
    return orjson.dumps({"error": {"message": message, "type": ENVOY_ERROR_TYPES[status], "param": None,
                                   "code": status}}).decode()


def extproc_addresses(s: EnvoySettings) -> tuple[str, ...]:
    """The ext_proc replicas' addresses, replica index order: `extproc_replica_addresses`, else `extproc_address`."""
    return s.extproc_replica_addresses or (s.extproc_address,)


def authz_http_addresses(s: EnvoySettings) -> tuple[str, ...]:
    """The replicas' ext_authz HTTP addresses, replica index order: `extproc_authz_http_addresses`, else each
    ext_proc replica's host at `DEFAULT_AUTHZ_HTTP_PORT`. ValueError when their number differs from the replicas'
    (the records of a request must go back to the replica that routed it: the same index)."""
    replicas = extproc_addresses(s)
    given = s.extproc_authz_http_addresses
    if not given:
        return tuple(f"{a.rpartition(':')[0]}:{DEFAULT_AUTHZ_HTTP_PORT}" for a in replicas)
    if len(given) != len(replicas):
        raise ValueError(f"extproc_authz_http_addresses names {len(given)} address(es) for {len(replicas)} ext_proc "
                         "replica(s): one per replica, in the same order")
    return given
