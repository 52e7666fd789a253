"""The facts path's Envoy configuration (envoy_config/facts.py) and its choice by `--response-path` (gateway.py)."""

from __future__ import annotations

import pytest

from prefixroute.extproc.envoy_config.response_headers import RESPONSE_HEADERS_FILTER
from prefixroute.extproc.envoy_config import EnvoySettings, build_config
from prefixroute.extproc.envoy_config.common import OBSERVE_FILTER, ROUTING_FILTER
from prefixroute.extproc.envoy_config.facts import RESPONSE_FACTS_LUA, facts_access_logs
from prefixroute.extproc.envoy_config.listener import ROUTER_FILTER, http_filters
from prefixroute.extproc.envoy_config.routes import allowed_path_matches, gateway_routes
from prefixroute.extproc.envoy_config.timing import TIMING_FILTER
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.facts_fields import (FACTS_NAMESPACE, FIRST_TOKEN_KEY, OBSERVED_FACTS, RESPONSE_ID_KEY,
                                              TIMING_NAMESPACE, USAGE_KEY)
from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings
from prefixroute.extproc.headers import HANDOFF_HEADER, OBSERVED_METADATA
from prefixroute.extproc.routing.settings import RoutingSettings

FACTS = {"observe_responses": False, "response_facts_lua": True}


def test_the_facts_filter_replaces_the_observing_one_and_runs_last_before_the_router() -> None:
    names = [f.name for f in http_filters(EnvoySettings(**FACTS), 1)]
    assert names == [RESPONSE_HEADERS_FILTER, ROUTING_FILTER, TIMING_FILTER, ROUTER_FILTER]
    assert OBSERVE_FILTER not in names
    routing = http_filters(EnvoySettings(**FACTS), 1)[1]
    text = str(routing.typed_config.value)
    assert OBSERVED_METADATA in text and OBSERVED_FACTS in text  # the service waits for a record, not a stream


def test_the_lua_script_writes_the_keys_the_record_reads() -> None:
    assert f'set("{TIMING_NAMESPACE}", "{FIRST_TOKEN_KEY}"' in RESPONSE_FACTS_LUA
    for key in (USAGE_KEY, RESPONSE_ID_KEY):
        assert f'set("{FACTS_NAMESPACE}", "{key}"' in RESPONSE_FACTS_LUA
    assert "bodyChunks" in RESPONSE_FACTS_LUA and "body()" not in RESPONSE_FACTS_LUA  # never buffers a body


@pytest.mark.parametrize("replicas", [1, 3])
def test_one_facts_logger_per_replica_to_its_own_port_with_the_flush_in_common_config(replicas: int) -> None:
    addresses = tuple(f"127.0.0.1:{50051 + k}" for k in range(replicas))
    s = EnvoySettings(**FACTS, facts_flush_interval_ms=20,
                      extproc_replica_addresses=addresses if replicas > 1 else ())
    logs = facts_access_logs(s, addresses)
    assert len(logs) == replicas
    text = [log.to_json() for log in logs]
    for k, t in enumerate(text):
        assert "0.020s" in t and "commonConfig" in t
        if replicas > 1:
            assert f"prefixroute_extproc_replica_{k}" in t and f"replica {k}" in t
        else:
            assert "prefixroute_extproc" in t
    assert facts_access_logs(EnvoySettings(response_facts_lua=False), addresses) == []
    assert len(facts_access_logs(EnvoySettings(), addresses)) == replicas  # the default path
    with pytest.raises(ValueError, match="facts_flush_interval_ms"):
        facts_access_logs(EnvoySettings(**FACTS, facts_flush_interval_ms=0), addresses)
    assert build_config(s)  # the whole bootstrap builds


def test_the_routing_filter_skips_response_headers_on_the_facts_path() -> None:
    # The served endpoint comes in the record: no blocking response-headers round trip.
    routing = http_filters(EnvoySettings(**FACTS, report_served=True), 1)[1].to_json()
    assert "SEND" not in routing.split("responseHeaderMode", 1)[1][:20]


@pytest.mark.parametrize(("path", "records", "expected"), [
    ("auto", True, "facts"), ("auto", False, "facts"), ("facts", False, "facts"), ("observe", True, "observe"),
    ("observe", False, "observe")])
def test_response_path_resolves(path: str, records: bool, expected: str) -> None:
    gw = GatewayProcesses(GatewaySettings(response_path=path), RoutingSettings(),
                          PoolSettings(endpoints=("127.0.0.1:9",)),
                          records_to=("127.0.0.1:4317", "t") if records else None)
    s = gw.envoy_settings()
    assert gw.response_path == expected
    assert (s.response_facts_lua, s.observe_responses) == (expected == "facts", expected == "observe")
    # Telemetry off exports no span, but the router still learns each response's facts by the same path.
    off = GatewayProcesses(GatewaySettings(response_path=path, telemetry=False), RoutingSettings(),
                           PoolSettings(endpoints=("127.0.0.1:9",))).envoy_settings()
    assert (off.response_facts_lua, off.observe_responses) == (expected == "facts", expected == "observe")


def test_an_unknown_response_path_is_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="response_path must be one of facts, observe, auto"):
        GatewayProcesses(GatewaySettings(response_path="chunks"), RoutingSettings(),
                         PoolSettings(endpoints=("127.0.0.1:9",)))


@pytest.mark.parametrize(("gateway", "overrides", "resolved"), [
    ({}, {}, "ext_proc"),  # the default: the design's ext_proc filter
    ({"telemetry": False}, {}, "ext_proc"),
    ({"response_path": "observe"}, {}, "ext_proc"),
    ({}, {"response_facts_lua": False}, "ext_proc"),  # overhead-bench's variants: Envoy's own response path
    ({}, {"observe_responses": True, "response_facts_lua": False}, "ext_proc"),
    ({}, {"routing_processing": "skip-headers"}, "ext_proc"),
    ({"routing_filter": "ext_proc"}, {}, "ext_proc"),
    ({"routing_filter": "ext_authz_http"}, {}, "ext_authz_http"),
    ({"routing_filter": "ext_authz_http", "telemetry": False}, {}, "ext_authz_http"),
    ({"routing_filter": "ext_authz"}, {}, "ext_authz"),
])
def test_the_auto_routing_filter_is_ext_proc(gateway: dict, overrides: dict,
                                                                          resolved: str) -> None:
    gw = GatewayProcesses(GatewaySettings(**gateway), RoutingSettings(), PoolSettings(endpoints=("127.0.0.1:9",)),
                          envoy_overrides=overrides)
    assert gw.routing_filter == resolved
    gw.authz_http_ports = [9104] if resolved == "ext_authz_http" else []
    s = gw.envoy_settings()
    assert s.routing_processing == overrides.get("routing_processing", {"ext_proc": "buffered", "ext_authz": "authz",
                                                                        "ext_authz_http": "authz-http"}[resolved])
    http_filters(s, 1)  # renders: no refusal for a combination 'auto' chose


@pytest.mark.parametrize(("gateway", "message"), [
    ({"routing_filter": "ext_proxy"}, "routing_filter must be one of auto, ext_proc, ext_authz, ext_authz_http"),
    ({"routing_filter": "ext_authz", "response_path": "observe"}, "routing_filter ext_authz needs the facts path"),
    ({"routing_filter": "ext_authz_http", "response_path": "observe"},
     "routing_filter ext_authz_http needs the facts path"),
])
def test_a_routing_filter_that_cannot_work_is_refused_before_anything_starts(gateway: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GatewayProcesses(GatewaySettings(**gateway), RoutingSettings(), PoolSettings(endpoints=("127.0.0.1:9",)))


@pytest.mark.parametrize(("routing_filter", "processing"), [("ext_authz", "authz"), ("ext_authz_http", "authz-http")])
def test_the_ext_authz_routing_filter_renders_envoys_ext_authz_and_ext_proc_for_the_handoff_route(
        routing_filter: str, processing: str) -> None:
    gw = GatewayProcesses(GatewaySettings(routing_filter=routing_filter), RoutingSettings(),
                          PoolSettings(endpoints=("127.0.0.1:9",)))
    gw.authz_http_ports = [9104]
    s = gw.envoy_settings()
    assert s.routing_processing == processing and s.response_facts_lua
    names = [f.name for f in http_filters(s, 1)]
    # ext_authz first; the ext_proc routing filter after it, for the handoff route alone.
    assert names[:3] == [RESPONSE_HEADERS_FILTER, "envoy.filters.http.ext_authz", "envoy.filters.http.ext_proc"]
    routes = gateway_routes(s, allowed_path_matches(s), 1, names)
    by_name = {r.name: r for r in routes}
    handoff = by_name["handoff /v1/chat/completions"]
    assert [h.name for h in handoff.match.headers] == [HANDOFF_HEADER]
    assert "envoy.filters.http.ext_proc" not in handoff.typed_per_filter_config
    for name in ("picked_endpoint /v1/chat/completions", "extproc_unavailable_round_robin /v1/chat/completions"):
        per_route = by_name[name].typed_per_filter_config["envoy.filters.http.ext_proc"]
        assert per_route.unpack().disabled, name
    assert HANDOFF_HEADER in by_name["picked_endpoint /v1/chat/completions"].request_headers_to_remove
    # The handoff route comes after the picked one (the ext_proc filter's answer routes it there) and before the
    # unpicked one (which would match it too).
    order = [r.name for r in routes]
    assert order.index("picked_endpoint /v1/chat/completions") < order.index("handoff /v1/chat/completions") < \
        order.index("extproc_unavailable_round_robin /v1/chat/completions")
    if processing == "authz-http":
        assert s.extproc_authz_http_addresses == ("127.0.0.1:9104",)
    for mode in ("authz", "authz-http"):  # the Envoy setting alone, without facts
        with pytest.raises(ValueError, match="needs the facts path"):
            http_filters(EnvoySettings(routing_processing=mode, response_facts_lua=False), 1)
