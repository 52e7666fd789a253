"""The rendered Envoy configuration's hardening (issue 11): allowlist-only routes, path normalisation, local
replies, timeouts, buffers, ext_proc TLS and token. Behaviour is tested through real Envoy in
tests/integration/gateway/test_gateway_hardening_*.py; this checks the configuration's invariants for every
settings combination (real Envoy accepts the TLS rendering: tests/integration/extproc/
test_envoy_accepts_renderings.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import betterproto2
import pytest
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ExternalProcessor
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
    HttpConnectionManager, HttpConnectionManagerPathWithEscapedSlashesAction)
from envoy_data_plane.envoy.extensions.transport_sockets.tls.v3 import SubjectAltNameMatcherSanType

from prefixroute.extproc.envoy_config.response_headers import RESPONSE_HEADERS_FILTER
from prefixroute import cli
from prefixroute.extproc.envoy_config import (DEFAULT_ALLOWED_PATH_PREFIXES, DEFAULT_ALLOWED_PATHS, ENVOY_OWN_REPLY,
                                              EXTPROC_CLUSTER, OBSERVE_FILTER, ROUTING_FILTER, EnvoySettings,
                                              build_config, render)

# The combinations tests/integration/extproc/test_envoy_accepts_renderings.py runs through real Envoy, plus the
# new knobs.
COMBINATIONS = {
    "default": {}, "fail-closed": {"failure_mode": "closed"}, "no-fallback": {"num_fallbacks": 0},
    "no-extproc": {"extproc_enabled": False},
    "fail-closed-no-extproc": {"failure_mode": "closed", "extproc_enabled": False},
    "no-endpoints": {"endpoints": ()}, "no-facts": {"response_facts_lua": False},
    "observe": {"observe_responses": True, "response_facts_lua": False},
}
ALL = {**COMBINATIONS, "extra-paths": {"allowed_paths": ("/v1/audio/transcriptions",), "allowed_path_prefixes": ()},
       "token": {"extproc_auth_token": "tok"}}


def _hcm(cfg) -> HttpConnectionManager:  # noqa: ANN001
    return cfg.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.unpack()


def _vhost(cfg):  # noqa: ANN001, ANN202
    return _hcm(cfg).route_config.virtual_hosts[0]


@pytest.mark.parametrize("overrides", list(ALL.values()), ids=list(ALL))
def test_only_allowlisted_paths_reach_a_cluster(overrides: dict) -> None:
    s = EnvoySettings(**overrides)
    cfg = build_config(s)
    routes = _vhost(cfg).routes
    for r in routes:
        if r.route is not None:  # forwards to a cluster: must match one allowlisted path, never a catch-all
            assert (r.match.path in s.allowed_paths) != (r.match.prefix in s.allowed_path_prefixes), r.name
            assert r.match.safe_regex is None and r.match.path_separated_prefix is None
    forwarded = {r.match.path or r.match.prefix for r in routes if r.route is not None}
    assert forwarded == set(s.allowed_paths) | set(s.allowed_path_prefixes)
    # Last: everything else gets a 404 direct response, and neither ext_proc filter runs for it.
    last = routes[-1]
    assert last.match.prefix == "/" and last.direct_response.status == 404
    # (the removal of internal response headers runs on every route, Envoy's own answers too)
    filters = [f.name for f in _hcm(cfg).http_filters
               if f.name not in ("envoy.filters.http.router", RESPONSE_HEADERS_FILTER)]
    assert set(last.typed_per_filter_config) == set(filters)
    assert all(v.unpack().disabled for v in last.typed_per_filter_config.values())
    # CONNECT (matched only by connect_matcher routes) is answered by Envoy too, never by a cluster.
    connect = [r for r in routes if r.match.connect_matcher is not None]
    assert len(connect) == 1 and connect[0].direct_response is not None


def test_default_allowlist_is_the_openai_inference_api() -> None:
    s = EnvoySettings()
    assert set(s.allowed_paths) == {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
                                    "/v1/models", "/tokenize", "/detokenize"}
    assert set(s.allowed_path_prefixes) == {"/v1/responses/", "/v1/models/"}
    assert (s.allowed_paths, s.allowed_path_prefixes) == (DEFAULT_ALLOWED_PATHS, DEFAULT_ALLOWED_PATH_PREFIXES)


@pytest.mark.parametrize("bad", [{"allowed_paths": ("admin",)}, {"allowed_paths": ("/v1/../admin",)},
                                 {"allowed_paths": ("/v1/a%2Fb",)}, {"allowed_paths": ("/v1/models?x",)},
                                 {"allowed_paths": ("//admin",)}, {"allowed_path_prefixes": ("/v1/./",)},
                                 {"allowed_paths": ("/v1/x;y",)}, {"allowed_paths": (), "allowed_path_prefixes": ()},
                                 {"connection_buffer_bytes": 1024},
                                 {"extproc_tls_cert_file": "c.pem", "extproc_tls_key_file": "k.pem"},
                                 {"extproc_tls_ca_file": "ca.pem", "extproc_tls_cert_file": "c.pem"}])
def test_invalid_hardening_settings_are_rejected(bad: dict) -> None:
    with pytest.raises(ValueError):
        build_config(EnvoySettings(**bad))


def test_paths_are_normalised_before_matching_and_escaped_slashes_decoded_first() -> None:
    hcm = _hcm(build_config(EnvoySettings()))
    assert hcm.normalize_path is True and hcm.merge_slashes is True
    # Decoded, then normalised and matched: the endpoint gets the path that was matched (model ids hold slashes).
    assert (hcm.path_with_escaped_slashes_action
            == HttpConnectionManagerPathWithEscapedSlashesAction.UNESCAPE_AND_FORWARD)
    assert hcm.http_protocol_options.accept_http_10 is not True


def test_timeouts_and_buffers_are_set_on_purpose() -> None:
    s = EnvoySettings()
    cfg = build_config(s)
    hcm = _hcm(cfg)
    assert hcm.request_headers_timeout.total_seconds() == s.request_headers_timeout_s > 0
    assert hcm.request_timeout.total_seconds() == s.request_timeout_s > 0
    assert hcm.stream_idle_timeout.total_seconds() == s.stream_idle_timeout_s
    # A first token near saturation can take tens of seconds; a non-streamed completion is silent for minutes.
    assert 120 <= s.stream_idle_timeout_s <= s.upstream_timeout_s
    assert hcm.common_http_protocol_options.idle_timeout.total_seconds() == s.idle_timeout_s > 0
    assert hcm.max_request_headers_kb == s.max_request_headers_kb
    # Per-connection buffers small, request bodies bounded separately by max_request_body_bytes.
    listener = cfg.static_resources.listeners[0]
    assert listener.per_connection_buffer_limit_bytes == s.connection_buffer_bytes <= 1024 * 1024
    assert _vhost(cfg).request_body_buffer_limit == s.max_request_body_bytes
    for c in cfg.static_resources.clusters:
        if c.name != EXTPROC_CLUSTER and c.cluster_type is None:  # the endpoint clusters
            assert c.per_connection_buffer_limit_bytes == s.connection_buffer_bytes, c.name


def test_every_local_reply_mapper_spares_router_and_direct_replies() -> None:
    mappers = _hcm(build_config(EnvoySettings())).local_reply_config.mappers
    statuses = set()
    for m in mappers:
        filt = m.filter
        parts = filt.and_filter.filters if filt.and_filter is not None else [filt]
        cel = [p.extension_filter.typed_config.unpack().expression for p in parts if p.extension_filter is not None]
        # Every mapper spares the router's replies; a reason-specific one adds its reason (Envoy's details, or the
        # routing-unavailable route it answers for) to match.
        assert cel[0] == ENVOY_OWN_REPLY and all(
            c.startswith(("response.code_details == '", "xds.route_name.startsWith('")) for c in cel[1:]), cel
        statuses |= {p.status_code_filter.comparison.value.default_value for p in parts if p.status_code_filter}
        assert m.body_format_override.content_type == "application/json"
    assert {400, 403, 404, 408, 413, 426, 431, 501, 502, 503, 504} <= statuses
    assert mappers[-1].filter.extension_filter is not None  # the catch-all comes last


def _filters(cfg) -> dict[str, ExternalProcessor]:  # noqa: ANN001
    return {f.name: f.typed_config.unpack() for f in _hcm(cfg).http_filters
            if f.name not in ("envoy.filters.http.router", RESPONSE_HEADERS_FILTER)}


@pytest.mark.parametrize("observe", [True, False])
@pytest.mark.parametrize("replicas", [1, 2])
def test_token_is_a_secret_every_ext_proc_cluster_injects(tmp_path: Path, observe: bool, replicas: int) -> None:
    """Issue 27: the token is never gRPC initial metadata (Envoy's /config_dump printed it); it is an Envoy secret
    (a file Envoy reads, or inline: redacted from dumps) that a credential_injector on every ext_proc cluster
    (the replicas' own clusters included) sends as ``authorization: Bearer ...``. End to end with real Envoy:
    tests/integration/gateway/test_gateway_hardening_admin.py."""
    token_file = tmp_path / "token"
    token_file.write_text("file-token")
    addresses = {"extproc_replica_addresses": ("127.0.0.1:1", "127.0.0.1:2")} if replicas > 1 else {}
    for s, source in ((EnvoySettings(observe_responses=observe, response_facts_lua=False, extproc_auth_token="t0k", **addresses),
                       {"inline_string": "t0k"}),
                      (EnvoySettings(observe_responses=observe, response_facts_lua=False,
                                     extproc_auth_token_file=str(token_file), **addresses),
                       {"filename": str(token_file)})):
        cfg = build_config(s)
        for f in _filters(cfg).values():
            assert "authorization" not in {h.key for h in f.grpc_service.initial_metadata}
        (secret,) = cfg.static_resources.secrets
        assert secret.generic_secret.secret.to_dict(casing=betterproto2.Casing.SNAKE) == source
        grpc_clusters = [c for c in cfg.static_resources.clusters if c.name.startswith("prefixroute_extproc")]
        assert len(grpc_clusters) == (1 + replicas * observe if replicas > 1 else 1)
        for c in grpc_clusters:
            opts = c.typed_extension_protocol_options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].unpack()
            injector, codec = opts.http_filters
            cred = injector.typed_config.unpack().credential.typed_config.unpack()
            assert (cred.credential.name, cred.header, cred.header_value_prefix) == (
                secret.name, "authorization", "Bearer ")
            assert codec.name == "envoy.filters.http.upstream_codec"
        assert "t0k" not in render(s) or "inline_string: t0k" in render(s)  # only ever inside the secret
        assert "file-token" not in render(s)  # a file's token never enters the configuration
    cfg = build_config(EnvoySettings(observe_responses=observe, response_facts_lua=False))
    assert not cfg.static_resources.secrets


def test_token_file_with_a_trailing_newline_is_inlined_stripped(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("tok\n")  # Envoy would send the newline as part of the header
    (secret,) = build_config(EnvoySettings(extproc_auth_token_file=str(token_file))).static_resources.secrets
    assert secret.generic_secret.secret.inline_string == "tok"
    token_file.write_text(" \n")
    with pytest.raises(ValueError, match="empty"):
        build_config(EnvoySettings(extproc_auth_token_file=str(token_file)))


@pytest.mark.parametrize(("address", "server_name", "san_type", "sni"), [
    ("127.0.0.1:9002", "", SubjectAltNameMatcherSanType.IP_ADDRESS, ""),
    ("extproc:9002", "", SubjectAltNameMatcherSanType.DNS, "extproc"),
    ("10.0.0.7:9002", "router.internal", SubjectAltNameMatcherSanType.DNS, "router.internal")])
def test_ext_proc_cluster_verifies_the_service_certificate(address: str, server_name: str,
                                                           san_type: SubjectAltNameMatcherSanType, sni: str) -> None:
    cfg = build_config(EnvoySettings(extproc_address=address, extproc_tls_ca_file="/ca.pem",
                                     extproc_tls_cert_file="/c.pem", extproc_tls_key_file="/k.pem",
                                     extproc_tls_server_name=server_name))
    cluster = next(c for c in cfg.static_resources.clusters if c.name == EXTPROC_CLUSTER)
    tls = cluster.transport_socket.typed_config.unpack()
    common = tls.common_tls_context
    assert common.validation_context.trusted_ca.filename == "/ca.pem"
    [san] = common.validation_context.match_typed_subject_alt_names
    assert san.san_type == san_type and san.matcher.exact == (server_name or address.rpartition(":")[0])
    assert common.tls_certificates[0].certificate_chain.filename == "/c.pem"
    assert (tls.sni or "") == sni
    assert "h2" in common.alpn_protocols
    plain = build_config(EnvoySettings())
    assert next(c for c in plain.static_resources.clusters if c.name == EXTPROC_CLUSTER).transport_socket is None


def test_envoy_config_out_is_private_when_it_holds_a_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "envoy.yaml"
    out.write_text("old")
    os.chmod(out, 0o644)
    monkeypatch.setenv("PREFIXROUTE_ENVOY_EXTPROC_AUTH_TOKEN", "env-token")
    assert cli.main(["envoy-config", "--out", str(out)]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert "inline_string: env-token" in out.read_text()


def test_a_held_request_may_extend_its_answer_up_to_max_hold_but_nothing_else_waits_longer() -> None:
    """Flow control (issue 24): Envoy lets the service extend one answer up to extproc_max_hold_s
    (max_message_timeout) while every answer still times out after extproc_message_timeout_ms unless extended;
    a hold fits within request_timeout_s, which runs while the request is held."""
    def routing_filter(s: EnvoySettings) -> ExternalProcessor:
        hcm = _hcm(build_config(s))
        return next(f for f in hcm.http_filters if f.name == ROUTING_FILTER).typed_config.unpack()

    s = EnvoySettings()
    ext = routing_filter(s)
    assert ext.message_timeout.total_seconds() == s.extproc_message_timeout_ms / 1000 < 1.0
    assert ext.max_message_timeout.total_seconds() == s.extproc_max_hold_s
    assert s.extproc_max_hold_s < s.request_timeout_s
    assert routing_filter(EnvoySettings(extproc_max_hold_s=0)).max_message_timeout is None
