"""Where endpoints come from: --endpoints, --endpoints-file, env; PoolSettings validation."""

from __future__ import annotations

import argparse

import pytest

from prefixroute import settings as settings_mod
from prefixroute.extproc.endpoints.pool import EndpointPool, endpoints_from_settings
from prefixroute.extproc.endpoints.settings import PoolSettings


def from_cli(argv: list[str], env: dict[str, str] | None = None) -> PoolSettings:
    parser = argparse.ArgumentParser()
    settings_mod.add_arguments(parser, PoolSettings)
    return settings_mod.from_namespace(PoolSettings, parser.parse_args(argv), environ=env or {})


def test_flag_list_and_file_combine_in_order(tmp_path):
    f = tmp_path / "fleet.yaml"
    f.write_text("# GPUs\n- 10.0.0.3:8000\n- 10.0.0.4:8000\n")
    s = from_cli(["--endpoints", "10.0.0.1:8000, 10.0.0.2:8000", "--endpoints-file", str(f)])
    assert endpoints_from_settings(s) == ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000")


def test_env_var():
    s = from_cli([], {"PREFIXROUTE_ENDPOINTS": "h1:1,h2:2", "PREFIXROUTE_SCRAPE_INTERVAL_S": "0.5"})
    assert endpoints_from_settings(s) == ("h1:1", "h2:2") and s.scrape_interval_s == 0.5


@pytest.mark.parametrize("argv,fragment", [
    ([], "no endpoints configured"),
    (["--endpoints", "h1"], "not host:port"),
    (["--endpoints", "h1:1,h1:1"], "twice"),
    (["--endpoints-file", "/nonexistent/prefixroute-fleet.txt"], "cannot read endpoints file"),
])
def test_errors_are_clear(argv, fragment):
    with pytest.raises(ValueError, match=fragment):
        endpoints_from_settings(from_cli(argv))


def test_pool_validates_explicit_endpoints():
    with pytest.raises(ValueError, match="port"):
        EndpointPool(PoolSettings(), ["h:99999"])


@pytest.mark.parametrize("kwargs", [{"probe_interval_s": 0}, {"metrics_stale_after_s": -1},
                                    {"unhealthy_after_failures": 0}, {"max_connections_per_endpoint": 0}])
def test_invalid_settings(kwargs):
    with pytest.raises(ValueError):
        PoolSettings(**kwargs)


def test_every_field_is_documented():
    for f, _ in settings_mod.fields(PoolSettings):
        assert len(f.metadata.get("help", "")) > 40, f.name


@pytest.mark.parametrize("num_endpoints,interval_s,stale_s", [
    (4, 0.1, 1.0),  # 40 scrapes/s: within the budget, settings as given
    (20, 0.1, 1.0),
    (100, 0.5, 5.0),  # 1,000/s wanted: stretched to 200/s, staleness follows
    (256, 1.28, 12.8),
])
def test_scrape_budget_stretches_interval_and_staleness(num_endpoints, interval_s, stale_s):
    pool = EndpointPool(PoolSettings(), [f"10.0.0.{i % 250}:{8000 + i}" for i in range(num_endpoints)])
    assert pool.scrape_interval_s == pytest.approx(interval_s)
    assert pool.metrics_stale_after_s == pytest.approx(stale_s)


def test_the_panic_threshold_is_a_ratio_and_zero_turns_it_off():
    assert PoolSettings().healthy_panic_threshold_ratio == 0.5  # Envoy's healthy_panic_threshold default, 50%
    assert from_cli(["--healthy-panic-threshold-ratio", "0"]).healthy_panic_threshold_ratio == 0.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="healthy_panic_threshold_ratio"):
            PoolSettings(healthy_panic_threshold_ratio=bad)
