"""The ext_proc server's gRPC options: defaults, overrides from --grpc-options, and refusals."""

from __future__ import annotations

import pytest

from prefixroute.extproc.server import GRPC_OPTIONS, ExtprocSettings, grpc_options


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
