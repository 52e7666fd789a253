"""The dashboard's KV-tier panel (dashboard/tiers_panel.py; issue 25): a virtual server with a CPU tier serves
prompts its GPU cannot hold together, the router's real metrics export its pool's scrape, the dashboard parses
them into the hit ratio by tier."""

from __future__ import annotations

import orjson
from prometheus_client import generate_latest

from types import SimpleNamespace

from prefixroute.bench.sim_pool import SimulatedPool
from prefixroute.dashboard import tiers_panel
from prefixroute.dashboard.router_metrics import EndpointLive, parse_router_metrics
from prefixroute.extproc.lifecycle_listeners import TierPredictionCollector, TierPredictionListener
from prefixroute.model_servers.profiles import EngineSpec
from prefixroute.model_servers.server import ServerSettings
from prefixroute.model_servers.virtual_fleet import SimRequest, VirtualFleet
from prefixroute.telemetry.metrics import RouterMetrics


def _run(spec: EngineSpec, prediction: TierPredictionListener | None = None) -> dict[str, EndpointLive]:
    fleet = VirtualFleet(spec, num_servers=2)
    docs = ["alpha ", "bravo ", "charlie "]

    def req(i: int) -> SimRequest:
        body = orjson.dumps({"prompt": docs[i % 3] * 1000 + f"question {i}", "max_tokens": 4})
        return SimRequest.from_body(str(i), i * 2.0, "/v1/completions", body, spec)

    fleet.run([req(i) for i in range(12)], lambda r, f: int(r.request_id) % 3 // 2)  # docs 0, 1 -> 0; 2 -> 1
    pool = SimulatedPool(fleet)
    metrics = RouterMetrics(endpoint_states=pool.snapshot)
    if prediction is not None:
        metrics.registry.register(TierPredictionCollector(prediction))
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


def test_the_routers_prediction_by_tier_sits_beside_what_each_server_served():
    tiered = EngineSpec.from_settings(ServerSettings(num_gpu_blocks=130, kv_offloading_size=1.0))
    plain_live = _run(tiered)
    busy_name = tiers_panel.tier_frame(plain_live)["endpoint"].iloc[0]
    core = SimpleNamespace(settings=SimpleNamespace(kv_block_tokens=16), sourced=SimpleNamespace(event_endpoints=()))
    listener = TierPredictionListener(core, None)  # type: ignore[arg-type]
    listener.tokens = {busy_name: [1000.0, 250.0, 500.0]}  # what its usages would have counted
    frame = tiers_panel.tier_frame(_run(tiered, listener)).set_index("endpoint")
    assert frame.loc[busy_name, "predicted GPU hit"] == 0.25 and frame.loc[busy_name, "predicted CPU-tier hit"] == 0.5
    other = [e for e in frame.index if e != busy_name][0]
    assert frame.loc[other, ["predicted GPU hit", "predicted CPU-tier hit"]].isna().all()  # predicted nothing there
    # the served shares are the servers' own, unchanged by the prediction beside them
    assert frame.loc[busy_name, "CPU-tier hit"] == tiers_panel.tier_frame(plain_live).set_index("endpoint").loc[
        busy_name, "CPU-tier hit"]
