"""The rendered Envoy configuration: committed file in sync, accepted by the real Envoy, and safe by design."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from prefixroute.extproc.envoy_config import (DESTINATION_HEADER, MAX_FALLBACKS, OBSERVE_FILTER, PICKED_CLUSTER,
                                              POOL_CLUSTER, SERVED_HEADER, EnvoySettings, build_config,
                                              fallback_header, render, route_headers)
from prefixroute.extproc.gateway import envoy_binary, settings_argv

REPO = Path(__file__).resolve().parents[3]


def _hcm(cfg: dict) -> dict:
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def _routes(cfg: dict) -> list[dict]:
    return _hcm(cfg)["route_config"]["virtual_hosts"][0]["routes"]


def _clusters(cfg: dict) -> dict[str, dict]:
    return {c["name"]: c for c in cfg["static_resources"]["clusters"]}


def test_committed_envoy_yaml_is_the_default_rendering() -> None:
    assert (REPO / "envoy" / "envoy.yaml").read_text() == render(EnvoySettings()), (
        "envoy/envoy.yaml is stale: run `prefixroute envoy-config --out envoy/envoy.yaml`")


@pytest.mark.parametrize("overrides", [
    {},
    {"failure_mode": "closed"},
    {"num_fallbacks": 0},
    {"num_fallbacks": 4, "report_served": False},
    {"extproc_enabled": False},
    {"endpoints": ()},
    {"observe_responses": False},
], ids=["default", "fail-closed", "no-fallback", "four-fallbacks", "no-extproc", "no-endpoints", "no-observe"])
def test_real_envoy_accepts_the_rendering(tmp_path: Path, overrides: dict) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(render(EnvoySettings(**overrides)))
    proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("num_fallbacks", [0, 1, 2, 4])
def test_each_attempt_has_an_original_dst_sub_cluster_on_its_own_header(num_fallbacks: int) -> None:
    cfg = build_config(EnvoySettings(num_fallbacks=num_fallbacks))
    clusters = _clusters(cfg)
    subs = [e["name"] for e in clusters[PICKED_CLUSTER]["cluster_type"]["typed_config"]["clusters"]]
    assert len(subs) == 1 + num_fallbacks
    headers = [clusters[n]["original_dst_lb_config"]["http_header_name"] for n in subs]
    assert headers == list(route_headers(num_fallbacks))
    assert headers[0] == DESTINATION_HEADER
    for n in subs:
        assert clusters[n]["type"] == "ORIGINAL_DST" and clusters[n]["lb_policy"] == "CLUSTER_PROVIDED"
    retry = _routes(cfg)[0]["route"]["retry_policy"]
    assert retry["num_retries"] == num_fallbacks
    assert set(retry["retry_on"].split(",")) == {"connect-failure", "refused-stream", "reset-before-request",
                                                 "reset"}
    strict = build_config(EnvoySettings(num_fallbacks=num_fallbacks, retry_on_reset=False))
    # Without retry_on_reset only failures before the endpoint saw the request are retried.
    assert set(_routes(strict)[0]["route"]["retry_policy"]["retry_on"].split(",")) == {
        "connect-failure", "refused-stream", "reset-before-request"}


@pytest.mark.parametrize("failure_mode", ["open", "closed"])
def test_client_cannot_choose_an_address(failure_mode: str) -> None:
    cfg = build_config(EnvoySettings(failure_mode=failure_mode, num_fallbacks=3))
    removed = {m["remove"] for m in _hcm(cfg)["early_header_mutation_extensions"][0]["typed_config"]["mutations"]}
    assert set(route_headers(MAX_FALLBACKS)) | {SERVED_HEADER} <= removed
    routes = _routes(cfg)
    # The ORIGINAL_DST route needs the picker's header; the other route never reaches an ORIGINAL_DST cluster.
    assert routes[0]["match"]["headers"] == [{"name": DESTINATION_HEADER, "present_match": True}]
    clusters = _clusters(cfg)
    for r in routes[1:]:
        target = r.get("route", {}).get("cluster")
        assert target is None or clusters[target]["type"] != "ORIGINAL_DST"


def test_failure_mode_open_round_robins_over_configured_endpoints_and_closed_answers_503() -> None:
    eps = ("10.0.0.1:8000", "10.0.0.2:8000")
    open_cfg = build_config(EnvoySettings(failure_mode="open", endpoints=eps))
    assert _routes(open_cfg)[1]["route"]["cluster"] == POOL_CLUSTER
    pool = _clusters(open_cfg)[POOL_CLUSTER]
    addrs = [(e["endpoint"]["address"]["socket_address"]["address"],
              e["endpoint"]["address"]["socket_address"]["port_value"])
             for e in pool["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert addrs == [("10.0.0.1", 8000), ("10.0.0.2", 8000)]
    ext = _hcm(open_cfg)["http_filters"][0]["typed_config"]
    assert ext["failure_mode_allow"] is True
    closed_cfg = build_config(EnvoySettings(failure_mode="closed", endpoints=eps))
    assert _routes(closed_cfg)[1]["direct_response"]["status"] == 503
    assert _hcm(closed_cfg)["http_filters"][0]["typed_config"]["failure_mode_allow"] is False
    assert POOL_CLUSTER not in _clusters(closed_cfg)


@pytest.mark.parametrize("bad", [{"failure_mode": "sometimes"}, {"extproc_address": "no-port"},
                                 {"num_fallbacks": MAX_FALLBACKS + 1}, {"num_fallbacks": -1},
                                 {"endpoints": ("host-without-port",)}])
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


def _filters(cfg: dict) -> list[dict]:
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm["http_filters"]


@pytest.mark.parametrize(("overrides", "observed"), [
    ({}, True), ({"observe_responses": False}, False), ({"extproc_enabled": False}, False)])
def test_observing_filter_follows_the_routing_filter_in_observability_mode(overrides: dict, observed: bool) -> None:
    names = [f["name"] for f in _filters(build_config(EnvoySettings(**overrides)))]
    assert (OBSERVE_FILTER in names) is observed
    if overrides.get("extproc_enabled", True):
        # The routing filter tells the service whether an observation will follow.
        routing = _filters(build_config(EnvoySettings(**overrides)))[0]["typed_config"]["grpc_service"]
        assert ("initial_metadata" in routing) is observed
    if observed:
        # After the picker (so it sees the picker's traceparent), before the router.
        assert names.index("envoy.filters.http.ext_proc") < names.index(OBSERVE_FILTER) < len(names) - 1
        obs = _filters(build_config(EnvoySettings(**overrides)))[names.index(OBSERVE_FILTER)]["typed_config"]
        assert obs["observability_mode"] is True and obs["failure_mode_allow"] is True
        mode = obs["processing_mode"]
        assert (mode["request_header_mode"], mode["response_header_mode"], mode["response_body_mode"],
                mode["request_body_mode"]) == ("SEND", "SEND", "STREAMED", "NONE")
