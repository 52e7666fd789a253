"""The virtual fleet with a CPU tier behind the live router's code (issue 25): hits by tier in the results, and the
tier-aware events index beating the same router blind to the tier on a set that only fits GPU + CPU."""

from __future__ import annotations

from prefixroute.bench import results as bench_results
from prefixroute.bench import workloads as w
from prefixroute.bench.virtual_run import engine_spec, simulate_policy
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute import settings as settings_mod

ARGS = ("--time-scale=0.2", "--num-gpu-blocks=100", "--kv-offloading-size=2")  # 70B: 2 GiB = 409 host blocks


def _run(load_us: float) -> dict:
    wl = w.capacity_pressure(num_groups=16, min_prefix_tokens=768, max_prefix_tokens=768, num_requests=96,
                             zipf_s=0.0, seed=3)
    wl = w.apply_arrivals(wl, "poisson", rate_rps=2.0, seed=3)
    spec = engine_spec("llama-3.1-70b-h200-tp4", ARGS)
    routing = settings_mod.from_namespace(RoutingSettings, policy="prefix", tokenizer="sim", index_source="events",
                                          kv_cpu_load_us_per_token=load_us)
    res, eps, _ = simulate_policy(wl, "prefix", num_servers=4, spec=spec, routing=routing, index_source="events")
    return bench_results.summarize_run("prefix@events", res, eps)


def test_tier_aware_index_keeps_prefixes_where_the_host_tier_holds_them():
    aware = _run(1.49)
    blind = _run(1e9)  # a CPU block worth nothing: the router sees only GPU residency, as before issue 25
    assert aware["errors"] == 0 and blind["errors"] == 0
    tiers = aware["extra"]["hit_ratio_by_tier"]
    assert tiers["cpu"] > 0 and abs(tiers["gpu"] + tiers["cpu"] - aware["hit_ratio"]) < 1e-3
    # the router's prediction by tier at its picks (issue 25: within 3 points of the actual)
    assert abs(tiers["predicted"]["gpu"] - tiers["gpu"]) < 0.03 and abs(tiers["predicted"]["cpu"] - tiers["cpu"]) < 0.03
    assert aware["hit_ratio"] > blind["hit_ratio"] + 0.05
