"""One name per routing filter in help and docs (ext_authz_http, ext_authz, ext_proc: `gateway --routing-filter`);
`envoy-config --routing-processing` accepts them, and the gateway accepts envoy-config's older names."""

from __future__ import annotations

import dataclasses

import pytest

from prefixroute.extproc.envoy_config.envoy_settings import EnvoySettings
from prefixroute.extproc.gateway import GatewaySettings


@pytest.mark.parametrize("name, processing", [("ext_authz_http", "authz-http"), ("authz-http", "authz-http"),
                                              ("ext_proc", "buffered"), ("buffered", "buffered"),
                                              ("full-duplex", "full-duplex")])
def test_envoy_config_takes_the_filter_names(name, processing):
    assert EnvoySettings(routing_processing=name).routing_processing == processing
    assert dataclasses.replace(EnvoySettings(), routing_processing=name).routing_processing == processing


@pytest.mark.parametrize("name, routing_filter", [("authz-http", "ext_authz_http"),
                                                  ("buffered", "ext_proc"), ("ext_authz_http", "ext_authz_http"),
                                                  ("auto", "auto")])
def test_gateway_takes_envoy_configs_names(name, routing_filter):
    assert GatewaySettings(routing_filter=name).routing_filter == routing_filter


def test_help_names_the_filters_as_the_docs_do():
    help_text = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(EnvoySettings)}
    text = str(help_text.get("routing_processing") or EnvoySettings.__dataclass_fields__["routing_processing"])
    assert "'ext_authz_http' (also 'authz-http')" in text and "'ext_authz' (also" not in text


@pytest.mark.parametrize("name", ["authz", "ext_authz"])
def test_envoy_config_says_the_grpc_ext_authz_is_gone(name):
    from prefixroute.extproc.envoy_config.listener import http_filters

    with pytest.raises(ValueError, match="ext_authz over gRPC is no longer offered"):
        http_filters(EnvoySettings(routing_processing=name), 1)
