"""The dashboard's KV-tier panel (dashboard/tiers_panel.py; issue 25): a virtual server with a CPU tier serves
prompts its GPU cannot hold together, the router's real metrics export its pool's scrape, the dashboard parses
them into the hit ratio by tier."""

from __future__ import annotations

import orjson
from prometheus_client import generate_latest

from prefixroute.bench.sim_pool import SimulatedPool
from prefixroute.dashboard import tiers_panel
from prefixroute.dashboard.router_metrics import EndpointLive, parse_router_metrics
from prefixroute.model_servers.profiles import EngineSpec
from prefixroute.model_servers.server import ServerSettings
from prefixroute.model_servers.virtual_fleet import SimRequest, VirtualFleet
from prefixroute.telemetry.metrics import RouterMetrics


def _run(spec: EngineSpec) -> dict[str, EndpointLive]:
    fleet = VirtualFleet(spec, num_servers=2)
    docs = ["alpha ", "bravo ", "charlie "]

    def req(i: int) -> SimRequest:
        body = orjson.dumps({"prompt": docs[i % 3] * 1000 + f"question {i}", "max_tokens": 4})
        return SimRequest.from_body(str(i), i * 2.0, "/v1/completions", body, spec)

    fleet.run([req(i) for i in range(12)], lambda r, f: int(r.request_id) % 3 // 2)  # docs 0, 1 -> 0; 2 -> 1
    pool = SimulatedPool(fleet)
    metrics = RouterMetrics(endpoint_states=pool.snapshot)
    return parse_router_metrics(generate_latest(metrics.registry).decode())


def test_hit_ratio_by_tier_per_endpoint_from_the_servers_counters():
    tiered = EngineSpec.from_settings(ServerSettings(num_gpu_blocks=130, kv_offloading_size=1.0))
    live = _run(tiered)
    frame = tiers_panel.tier_frame(live).set_index("endpoint")
    assert len(frame) == 2 and tiers_panel.has_tiers(frame.reset_index())
    busy, alone = frame.iloc[0], frame.iloc[1]
    # two documents alternate on a GPU that holds about one: their repeats come mostly from the host tier
    assert busy["CPU-tier hit"] > 0.4 and busy["CPU-tier hit"] > busy["GPU hit"]
    # one document on the other: its repeats stay on the GPU
    assert alone["GPU hit"] > 0.7 and alone["CPU-tier hit"] == 0
    for _, row in frame.iterrows():
        assert abs(row["GPU hit"] + row["CPU-tier hit"] + row["computed"] - 1.0) < 1e-9
    # without a tier there is nothing to split: no panel
    plain = _run(EngineSpec.from_settings(ServerSettings(num_gpu_blocks=130)))
    assert not tiers_panel.has_tiers(tiers_panel.tier_frame(plain))
    assert tiers_panel.tier_frame({}).empty
