"""The rendered Envoy configuration: committed file in sync and safe by design (accepted and run by real Envoy:
tests/integration/extproc/test_envoy_accepts_renderings.py)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from envoy_data_plane.envoy.config.cluster.v3 import Cluster, ClusterDiscoveryType, ClusterLbPolicy
from envoy_data_plane.envoy.config.route.v3 import HeaderMatcher, Route
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ExternalProcessor
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ProcessingModeBodySendMode as BodySendMode
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ProcessingModeHeaderSendMode as HeaderSendMode
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (HttpConnectionManager,
                                                                                          HttpFilter)

from prefixroute.extproc.envoy_config.response_headers import RESPONSE_HEADERS_FILTER
from prefixroute.extproc.envoy_config import (DESTINATION_HEADER, MAX_FALLBACKS, OBSERVE_FILTER, PICKED_CLUSTER,
                                              POOL_CLUSTER, SERVED_HEADER, UNAVAILABLE_CLUSTER, EnvoySettings, build_config,
                                              fallback_header, render, route_headers)
from prefixroute.extproc.gateway import settings_argv

REPO = Path(__file__).resolve().parents[3]

# The two other ways the router learns each response (the default is the facts path: envoy_config/facts.py).
OBSERVE = {"observe_responses": True, "response_facts_lua": False}
NO_FACTS = {"observe_responses": False, "response_facts_lua": False}


def _hcm(cfg) -> HttpConnectionManager:
    return cfg.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.unpack()


def _routes(cfg) -> list[Route]:
    return _hcm(cfg).route_config.virtual_hosts[0].routes


def _filters(cfg) -> list[HttpFilter]:
    """The HTTP filters after the one that removes internal response headers (response_headers.py, always first)."""
    filters = _hcm(cfg).http_filters
    assert filters[0].name == RESPONSE_HEADERS_FILTER
    return filters[1:]


def _ext_proc(f: HttpFilter) -> ExternalProcessor:
    return f.typed_config.unpack()


def _clusters(cfg) -> dict[str, Cluster]:
    return {c.name: c for c in cfg.static_resources.clusters}


def test_committed_envoy_yaml_is_the_default_rendering() -> None:
    assert (REPO / "envoy" / "envoy.yaml").read_text() == render(EnvoySettings()), (
        "envoy/envoy.yaml is stale: run `prefixroute envoy-config --out envoy/envoy.yaml`")


def test_rendering_starts_with_the_header_comment_and_is_deterministic() -> None:
    text = render(EnvoySettings(failure_mode="closed"))
    assert text.startswith("# Envoy configuration of the prefixroute gateway. GENERATED")
    assert text == render(EnvoySettings(failure_mode="closed"))


@pytest.mark.parametrize("num_fallbacks", [0, 1, 2, 4])
def test_each_attempt_has_an_original_dst_sub_cluster_on_its_own_header(num_fallbacks: int) -> None:
    cfg = build_config(EnvoySettings(num_fallbacks=num_fallbacks))
    clusters = _clusters(cfg)
    subs = [e.name for e in clusters[PICKED_CLUSTER].cluster_type.typed_config.unpack().clusters]
    assert len(subs) == 1 + num_fallbacks
    headers = [clusters[n].original_dst_lb_config.http_header_name for n in subs]
    assert headers == list(route_headers(num_fallbacks))
    assert headers[0] == DESTINATION_HEADER
    for n in subs:
        assert clusters[n].type == ClusterDiscoveryType.ORIGINAL_DST
        assert clusters[n].lb_policy == ClusterLbPolicy.CLUSTER_PROVIDED
        assert clusters[n].original_dst_lb_config.use_http_header is True
    retry = _routes(cfg)[0].route.retry_policy
    assert retry.num_retries == num_fallbacks
    assert set(retry.retry_on.split(",")) == {"connect-failure", "refused-stream", "reset-before-request", "reset"}
    strict = build_config(EnvoySettings(num_fallbacks=num_fallbacks, retry_on_reset=False))
    # Without retry_on_reset only failures before the endpoint saw the request are retried.
    assert set(_routes(strict)[0].route.retry_policy.retry_on.split(",")) == {
        "connect-failure", "refused-stream", "reset-before-request"}


@pytest.mark.parametrize("failure_mode", ["open", "closed"])
def test_client_cannot_choose_an_address(failure_mode: str) -> None:
    cfg = build_config(EnvoySettings(failure_mode=failure_mode, num_fallbacks=3))
    mutation = _hcm(cfg).early_header_mutation_extensions[0].typed_config.unpack()
    removed = {m.remove for m in mutation.mutations}
    assert set(route_headers(MAX_FALLBACKS)) | {SERVED_HEADER} <= removed
    routes = _routes(cfg)
    # The ORIGINAL_DST route needs the picker's header; the other route never reaches an ORIGINAL_DST cluster.
    assert routes[0].match.headers == [HeaderMatcher(name=DESTINATION_HEADER, present_match=True)]
    clusters = _clusters(cfg)
    for r in routes[1:]:
        assert r.route is None or clusters[r.route.cluster].type != ClusterDiscoveryType.ORIGINAL_DST


def test_failure_mode_open_round_robins_over_configured_endpoints_and_closed_answers_503() -> None:
    eps = ("10.0.0.1:8000", "10.0.0.2:8000")
    open_cfg = build_config(EnvoySettings(failure_mode="open", endpoints=eps))
    assert _routes(open_cfg)[1].route.cluster == POOL_CLUSTER
    pool = _clusters(open_cfg)[POOL_CLUSTER]
    assert pool.lb_policy == ClusterLbPolicy.ROUND_ROBIN
    addrs = [(e.endpoint.address.socket_address.address, e.endpoint.address.socket_address.port_value)
             for e in pool.load_assignment.endpoints[0].lb_endpoints]
    assert addrs == [("10.0.0.1", 8000), ("10.0.0.2", 8000)]
    assert _ext_proc(_filters(open_cfg)[0]).failure_mode_allow is True
    closed_cfg = build_config(EnvoySettings(failure_mode="closed", endpoints=eps))
    # A route to the cluster without endpoints (a direct response would not take the body limit: issue 27);
    # Envoy's 503 for it gets its message from its local reply mapper.
    assert _routes(closed_cfg)[1].route.cluster == UNAVAILABLE_CLUSTER
    assert not _clusters(closed_cfg)[UNAVAILABLE_CLUSTER].load_assignment.endpoints
    assert _ext_proc(_filters(closed_cfg)[0]).failure_mode_allow is False
    assert POOL_CLUSTER not in _clusters(closed_cfg)


@pytest.mark.parametrize("bad", [{"failure_mode": "sometimes"}, {"extproc_address": "no-port"},
                                 {"num_fallbacks": MAX_FALLBACKS + 1}, {"num_fallbacks": -1},
                                 {"endpoints": ("host-without-port",)}, {"routing_processing": "streamed"}])
def test_invalid_settings_are_rejected(bad: dict) -> None:
    with pytest.raises(ValueError):
        build_config(EnvoySettings(**bad))


def test_fallback_header_names_are_distinct_and_ordered() -> None:
    names = route_headers(3)
    assert names == (DESTINATION_HEADER, fallback_header(1), fallback_header(2), fallback_header(3))
    assert len(set(names)) == 4


@pytest.mark.parametrize(("settings", "argv"), [
    (EnvoySettings(), []),
    (EnvoySettings(gateway_port=9000, report_served=False), ["--gateway-port", "9000", "--no-report-served"]),
    (EnvoySettings(endpoints=("a:1", "b:2")), ["--endpoints", "a:1,b:2"]),
])
def test_settings_argv_reproduces_non_default_fields(settings: EnvoySettings, argv: list[str]) -> None:
    assert settings_argv(settings) == argv


@pytest.mark.parametrize(("overrides", "served_on_routing_filter"), [
    ({}, False), (OBSERVE, False), (NO_FACTS, True), ({**NO_FACTS, "report_served": False}, False)])
def test_routing_filter_blocks_on_response_headers_only_when_nothing_else_reports_the_served_endpoint(
        overrides: dict, served_on_routing_filter: bool) -> None:
    mode = _ext_proc(_filters(build_config(EnvoySettings(**overrides)))[0]).processing_mode
    assert mode.response_header_mode == (HeaderSendMode.SEND if served_on_routing_filter else HeaderSendMode.SKIP)
    assert (mode.request_header_mode, mode.request_body_mode, mode.response_body_mode) == (
        HeaderSendMode.SEND, BodySendMode.BUFFERED, BodySendMode.NONE)


@pytest.mark.parametrize(("overrides", "observed"), [
    (OBSERVE, True), (NO_FACTS, False), ({**OBSERVE, "extproc_enabled": False}, False)])
def test_observing_filter_follows_the_routing_filter_in_observability_mode(overrides: dict, observed: bool) -> None:
    filters = _filters(build_config(EnvoySettings(**overrides)))
    names = [f.name for f in filters]
    assert (OBSERVE_FILTER in names) is observed
    if overrides.get("extproc_enabled", True):
        # The routing filter tells the service whether an observation will follow.
        assert bool(_ext_proc(filters[0]).grpc_service.initial_metadata) is observed
    if observed:
        # After the picker (so it sees the picker's traceparent), before the router.
        assert names.index("envoy.filters.http.ext_proc") < names.index(OBSERVE_FILTER) < len(names) - 1
        obs = _ext_proc(filters[names.index(OBSERVE_FILTER)])
        assert obs.observability_mode is True and obs.failure_mode_allow is True
        mode = obs.processing_mode
        # No request headers message: the correlation key (the picker's traceparent), id and path come as
        # attributes with the response headers.
        assert (mode.request_header_mode, mode.response_header_mode, mode.response_body_mode,
                mode.request_body_mode) == (HeaderSendMode.SKIP, HeaderSendMode.SEND, BodySendMode.STREAMED,
                                            BodySendMode.NONE)
        assert "request.headers['traceparent']" in obs.response_attributes


@pytest.mark.parametrize(("processing", "header", "body", "trailer", "early", "attributes"), [
    ("buffered", HeaderSendMode.SEND, BodySendMode.BUFFERED, HeaderSendMode.SKIP, False, False),
    ("buffered-partial", HeaderSendMode.SEND, BodySendMode.BUFFERED_PARTIAL, HeaderSendMode.SKIP, False, False),
    ("full-duplex", HeaderSendMode.SEND, BodySendMode.FULL_DUPLEX_STREAMED, HeaderSendMode.SEND, False, False),
    ("streamed-early", HeaderSendMode.SEND, BodySendMode.STREAMED, HeaderSendMode.SKIP, True, False),
    ("skip-headers", HeaderSendMode.SKIP, BodySendMode.BUFFERED, HeaderSendMode.SKIP, False, True)])
def test_routing_processing_sets_the_routing_filters_modes_and_buffered_is_the_default(
        processing: str, header: HeaderSendMode, body: BodySendMode, trailer: HeaderSendMode, early: bool,
        attributes: bool) -> None:
    """Each `routing_processing` choice (measured and checked: bench-results/routing-modes/) renders the filter
    options it names; the default is the one measured correct."""
    assert EnvoySettings().routing_processing == "buffered"
    routing = _ext_proc(_filters(build_config(EnvoySettings(routing_processing=processing)))[0])
    mode = routing.processing_mode
    assert (mode.request_header_mode, mode.request_body_mode, mode.request_trailer_mode) == (header, body, trailer)
    assert routing.send_body_without_waiting_for_header_response is early
    assert bool(routing.request_attributes) is attributes
