"""Issue 26: Envoy's records carry its own timing (envoy_config/timing.py); the Lua filter that stamps a Responses
stream's first token sits last before the router, and exists only when Envoy sends records."""

from __future__ import annotations

from prefixroute.extproc.envoy_config import EnvoySettings
from prefixroute.extproc.envoy_config.listener import ROUTER_FILTER, http_filters
from prefixroute.extproc.envoy_config.records import RECORD_ATTRIBUTES
from prefixroute.extproc.envoy_config.timing import FIRST_TOKEN_KEY, FIRST_TOKEN_LUA, TIMING_FILTER, TIMING_NAMESPACE


def test_the_timing_filter_runs_last_before_the_router_and_only_when_records_are_sent() -> None:
    # Without the facts path (whose filter takes this one's place: test_envoy_facts_config.py).
    on = [f.name for f in http_filters(EnvoySettings(records_otlp_address="127.0.0.1:4317", response_facts_lua=False), 1)]
    assert on[-2:] == [TIMING_FILTER, ROUTER_FILTER]
    assert TIMING_FILTER not in [f.name for f in http_filters(EnvoySettings(response_facts_lua=False), 1)]
    off = EnvoySettings(records_otlp_address="127.0.0.1:4317", first_token_lua=False, response_facts_lua=False)
    assert TIMING_FILTER not in [f.name for f in http_filters(off, 1)]


def test_the_record_reads_the_stamp_the_lua_script_sets() -> None:
    assert f"%DYNAMIC_METADATA({TIMING_NAMESPACE}:{FIRST_TOKEN_KEY})%" in RECORD_ATTRIBUTES.values()
    assert f'set("{TIMING_NAMESPACE}", "{FIRST_TOKEN_KEY}"' in FIRST_TOKEN_LUA
    assert RECORD_ATTRIBUTES["prefixroute.ttft_us"] == "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)%"
