"""overhead-bench --extproc-variants: names and grpc:NAME=VALUE entries -> `prefixroute extproc` arguments, which
the extproc settings accept (a variant that would fail at start is refused before anything starts)."""

from __future__ import annotations

import pytest

from prefixroute.bench.overhead import (EXTPROC_VARIANT_ENV, EXTPROC_VARIANTS, GRPC_EE_LISTENER_VARIANT,
                                       extproc_variant_args)
from prefixroute.grpc_runtime import GRPC_EXPERIMENTS_ENV
from prefixroute.extproc.server import ExtprocSettings


@pytest.mark.parametrize("name", sorted(EXTPROC_VARIANTS))
def test_named_variants_are_valid_extproc_settings(name):
    args = extproc_variant_args(name)
    if not args:
        assert name in EXTPROC_VARIANT_ENV  # a variant of the environment alone
    elif args[0] == "--grpc-options":
        ExtprocSettings(grpc_options=tuple(args[1].split(",")))
    else:
        assert args == ["--no-uvloop"]


def test_event_engine_listener_variant_runs_grpcs_own_defaults():
    # An empty GRPC_EXPERIMENTS is a user's setting, kept as it is: gRPC's defaults, not prefixroute's.
    assert EXTPROC_VARIANT_ENV[GRPC_EE_LISTENER_VARIANT] == {GRPC_EXPERIMENTS_ENV: ""}


def test_grpc_entry_passes_through():
    assert extproc_variant_args("grpc:grpc.minimal_stack=1") == ["--grpc-options", "grpc.minimal_stack=1"]


def test_unknown_variant_refused():
    with pytest.raises(ValueError, match="unknown ext_proc variant"):
        extproc_variant_args("fastest")
