"""The ext_proc server's gRPC options (defaults, overrides from --grpc-options, refusals, the message and window
bounds) and the refusal to serve an address others reach without a way to tell Envoy from them."""

from __future__ import annotations

import pytest

from prefixroute.extproc.server import (GRPC_OPTIONS, MESSAGE_HEADROOM_BYTES, ExtprocSettings, check_exposure,
                                        grpc_options, is_loopback)
from prefixroute.extproc.servicer import DEFAULT_MAX_BODY_BYTES


def test_defaults_unchanged_without_overrides():
    assert dict(grpc_options(())) == GRPC_OPTIONS


def test_override_and_addition_typed():
    got = dict(grpc_options(("grpc.optimization_target=throughput", "grpc.http2.lookahead_bytes=65536",
                             "grpc.keepalive_time_ms=-1")))
    assert got["grpc.optimization_target"] == "throughput"
    assert got["grpc.http2.lookahead_bytes"] == 65536
    assert got["grpc.keepalive_time_ms"] == -1
    assert got["grpc.max_concurrent_streams"] == GRPC_OPTIONS["grpc.max_concurrent_streams"]


@pytest.mark.parametrize("bad", ["grpc.so_reuseport", "so_reuseport=1", "grpc.x=", "=1"])
def test_bad_entries_refused_at_settings_time(bad):
    with pytest.raises(ValueError, match="grpc_options"):
        ExtprocSettings(grpc_options=(bad,))


def test_one_message_is_bounded_by_the_body_limit_and_never_unbounded():
    """One message at most the body limit + 1 MiB (main: -1, any size), the stream window a fraction of it (what a
    caller without the token can push per stream before its refusal; main: 16 MiB)."""
    assert GRPC_OPTIONS["grpc.max_receive_message_length"] == DEFAULT_MAX_BODY_BYTES + MESSAGE_HEADROOM_BYTES
    assert dict(grpc_options((), 1 << 20))["grpc.max_receive_message_length"] == (1 << 20) + MESSAGE_HEADROOM_BYTES
    assert GRPC_OPTIONS["grpc.http2.lookahead_bytes"] <= 256 * 1024
    assert dict(grpc_options(("grpc.max_receive_message_length=1000",)))["grpc.max_receive_message_length"] == 1000
    for unbounded in ("-1", "0"):
        with pytest.raises(ValueError, match="max_receive_message_length"):
            ExtprocSettings(grpc_options=(f"grpc.max_receive_message_length={unbounded}",))


@pytest.mark.parametrize(("address", "loopback"), [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                                    ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                                    ("::", False), ("10.0.0.5", False), ("extproc", False)])
def test_loopback_addresses(address: str, loopback: bool):
    assert is_loopback(address) is loopback


def test_an_address_others_reach_needs_a_token_a_client_ca_or_an_explicit_waiver(tmp_path):
    check_exposure(ExtprocSettings(listen_address="127.0.0.1"))  # loopback: a developer's machine
    with pytest.raises(ValueError, match="not loopback"):  # main: served anyone who reached it
        check_exposure(ExtprocSettings(listen_address="0.0.0.0"))
    check_exposure(ExtprocSettings(listen_address="0.0.0.0", auth_token="t0k"))
    token = tmp_path / "token"
    token.write_text("t0k\n")
    check_exposure(ExtprocSettings(listen_address="10.0.0.5", auth_token_file=str(token)))
    check_exposure(ExtprocSettings(listen_address="0.0.0.0", tls_cert_file="c", tls_key_file="k",
                                   tls_client_ca_file="ca"))
    check_exposure(ExtprocSettings(listen_address="0.0.0.0", allow_unauthenticated=True))
    with pytest.raises(ValueError, match="not loopback"):  # TLS alone tells no caller apart
        check_exposure(ExtprocSettings(listen_address="0.0.0.0", tls_cert_file="c", tls_key_file="k"))
