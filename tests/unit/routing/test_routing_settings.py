"""RoutingSettings: validation and flag/env plumbing."""

from __future__ import annotations

import argparse

import pytest

from prefixroute import settings as settings_mod
from prefixroute.extproc.routing.settings import RoutingSettings


@pytest.mark.parametrize("kwargs", [
    {"policy": "fastest"}, {"block_chars": 0}, {"max_blocks": 0}, {"num_fallbacks": -1},
    {"chars_per_token": 0.0}, {"max_body_bytes": 0}, {"decode_cost_tokens": -1.0}, {"ttft_work_weight": -1.0},
    {"ttft_prior_tokens_per_s": 0.0}, {"ttft_rate_window": 0.5}, {"ttft_prior_base_s": -0.1},
])
def test_invalid_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        RoutingSettings(**kwargs)


def test_flag_beats_env_beats_default():
    parser = argparse.ArgumentParser()
    settings_mod.add_arguments(parser, RoutingSettings)
    ns = parser.parse_args(["--policy", "least-load"])
    env = {"PREFIXROUTE_POLICY": "random", "PREFIXROUTE_MAX_BLOCKS": "32", "PREFIXROUTE_RNG_SEED": "7"}
    s = settings_mod.from_namespace(RoutingSettings, ns, environ=env)
    assert (s.policy, s.max_blocks, s.rng_seed, s.block_chars) == ("least-load", 32, 7, 64)
    assert s.max_prompt_chars == 32 * 64


def test_every_field_is_documented():
    for f, _ in settings_mod.fields(RoutingSettings):
        assert len(f.metadata.get("help", "")) > 40, f.name


def test_every_declared_policy_is_accepted_and_listed_wherever_policies_are_listed():
    import dataclasses

    from prefixroute.bench.routers import parse_router
    from prefixroute.bench.settings import DEFAULT_ROUTERS, BenchSettings
    from prefixroute.extproc.routing.settings import POLICIES

    def help_of(cls, name):
        return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)

    assert RoutingSettings().policy == next(iter(POLICIES)) == "prefix"
    for name in POLICIES:
        assert RoutingSettings(policy=name).policy == name
        assert name in help_of(RoutingSettings, "policy") and name in help_of(BenchSettings, "routers")
        assert parse_router(f"prefixroute:{name}").policy == name
    # the bench compares every policy by default, the default one last (the report's reference row)
    assert [r.removeprefix("prefixroute:") for r in DEFAULT_ROUTERS if r.startswith("prefixroute:")] == \
        list(reversed(POLICIES))
    with pytest.raises(ValueError, match="policy must be one of prefix, consistent-hash"):
        RoutingSettings(policy="fastest")
