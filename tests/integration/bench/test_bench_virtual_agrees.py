"""`prefixroute bench --virtual` agrees with the real-process bench (Envoy + ext_proc + simulated model servers)
on the same workload: the simulation runs the live router's code on the live request bytes, so the figures
routing decides (the hit ratio) must come out the same."""

from __future__ import annotations

import pytest

from prefixroute.bench import runner, upper_bound, virtual_run, workloads
from prefixroute.bench.fleet import FleetConfig

pytestmark = pytest.mark.integration

PROFILE = "llama-3.1-8b-h200"
SERVER_ARGS = ("--max-num-seqs=64",)  # passed to both fleets: the real servers' flags, parsed the same way
ROUTERS = ["prefixroute:prefix", "prefixroute:random"]

HIT_RATIO_TOLERANCE = 0.02
"""80 requests over 4 groups x 2,048-token prefixes on 2 servers at 10 req/s. Prefix: both runs make the same
placement decisions (below), so the ratio is fixed by the token counts. Random: its draws differ (the real
gateway also spends some on readiness probes), but it visits every (group, server) pair within a few requests,
so the ratio is nearly fixed too. One decision placed differently costs one 2,048-token prefix, ~1.2 points of
the ~170k prompt tokens; 2 points allows that one and fails on two, or on any systematic difference in
tokenization, templates, cache accounting or routing."""

PLACEMENT_ONLY = {"PREFIXROUTE_TTFT_WORK_WEIGHT": "100"}
"""For both runs (the gateway and the simulation read the same environment variables). At this size a decision
that weighs queues turns on a few milliseconds of timing (is a request's first token out when the next one
arrives?), which a real and a virtual run cannot share. A work weight of 100 prices any extra prefill far above
any queue here, and puts every endpoint within the policy's tie margin for a new prefix, so placement is affinity
+ plain rendezvous, the same request for request: what is compared is the data path (request bytes,
tokenization, cache accounting, index updates, releases). docs/benchmarks.md's comparisons run the defaults."""


@pytest.mark.timeout(90)
def test_virtual_and_real_runs_agree_on_hit_ratio(tmp_path, monkeypatch):
    for name, value in PLACEMENT_ONLY.items():
        monkeypatch.setenv(name, value)
    wl = workloads.apply_arrivals(workloads.shared_prompts(num_requests=80, num_groups=4, prefix_tokens=2048,
                                                           question_tokens=16, output_tokens=4, seed=5),
                                  "poisson", rate_rps=10.0, seed=5)
    bound = upper_bound.upper_bound(wl).hit_ratio
    fleet = FleetConfig(2, PROFILE, SERVER_ARGS, startup_timeout_s=30)
    real, _ = runner.run_bench(wl, bound, ROUTERS, fleet, tmp_path, log=lambda _m: None, seed=0, concurrency=16,
                               max_connections=64, request_timeout_s=30, max_duration_s=40, progress=False)
    # The real run's endpoint ids: same names, same rendezvous placement, so endpoint shares compare too.
    endpoint_ids = list(real["runs"][0]["endpoint_share"])
    sim, _ = virtual_run.run_virtual(wl, bound, ROUTERS, num_servers=2, spec=virtual_run.engine_spec(PROFILE, SERVER_ARGS),
                                 seed=0, endpoint_ids=endpoint_ids, log=lambda _m: None)
    real_runs = {r["router"]: r for r in real["runs"]}
    sim_runs = {r["router"]: r for r in sim["runs"]}
    assert sorted(real_runs) == sorted(sim_runs) == sorted(ROUTERS)
    for name in ROUTERS:
        r, s = real_runs[name], sim_runs[name]
        assert r["requests"] == s["requests"] == 80 and r["errors"] == s["errors"] == 0, name
        assert r["extra"]["prompt_tokens"] == s["extra"]["prompt_tokens"], name  # same bytes, same tokenizer
        assert abs(r["hit_ratio"] - s["hit_ratio"]) <= HIT_RATIO_TOLERANCE, (name, r["hit_ratio"], s["hit_ratio"])
    # Prefix placement is the same request for request (same ids, same rendezvous): every endpoint's share within
    # two requests (2/80) of the real one. Random's draws differ between the runs, so its shares are not compared.
    real_share = real_runs["prefixroute:prefix"]["endpoint_share"]
    sim_share = sim_runs["prefixroute:prefix"]["endpoint_share"]
    assert real_share.keys() == sim_share.keys()
    assert all(abs(real_share[ep] - sim_share[ep]) <= 2 / 80 + 1e-9 for ep in real_share), (real_share, sim_share)
    # The workload tells the policies apart, so agreeing is not trivial.
    assert sim_runs["prefixroute:prefix"]["hit_ratio"] - sim_runs["prefixroute:random"]["hit_ratio"] > 0.02
