"""`prefixroute bench --sweep-load-percents` on real processes: model servers, the gateway (Envoy + ext_proc) and
the streaming client at two load points, the capacity from the virtual fleet of the same servers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prefixroute.bench import capacity, sweep_report, virtual_run, workloads

pytestmark = pytest.mark.integration

ROUTERS = ("prefixroute:random", "prefixroute:prefix")
# 24 requests of 8 groups x 2k tokens on 2 servers of the 8B profile, slowed 5x: capacity ~23 req/s, so the
# points take 1-3 s of requests each and the run is mostly the 4 fleets' start-up.
WORKLOAD = dict(num_requests=24, num_groups=8, prefix_tokens=2048, question_tokens=16, output_tokens=4)
ARGS = ["--workload", "shared-prompts", "--num-requests", "24", "--num-groups", "8", "--prefix-tokens", "2048",
        "--question-tokens", "16", "--output-tokens", "4", "--servers", "2", "--profile", "llama-3.1-8b-h200",
        "--server-args=--time-scale=5", "--no-progress", "--routers", ",".join(ROUTERS),
        "--sweep-load-percents", "40,120"]


@pytest.mark.timeout(90)
def test_real_sweep_two_points_two_routers(tmp_path):
    out = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "prefixroute", "bench", *ARGS, "--out", str(out)],
                          capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["kind"] == "sweep" and doc["virtual"] is False and doc["time_scale"] == 5.0
    # The capacity is the virtual fleet's for the same workload and servers (one definition of 100%).
    wl = workloads.shared_prompts(seed=0, **WORKLOAD)
    cap = capacity.find_capacity(wl, virtual_run.engine_spec("llama-3.1-8b-h200", ["--time-scale=5"]), 2)
    assert doc["capacity_rps"] == pytest.approx(cap.rps, rel=1e-3)
    assert [p["load_percent"] for p in doc["points"]] == [40, 120]
    assert doc["points"][1]["rate_rps"] == pytest.approx(3 * doc["points"][0]["rate_rps"], rel=1e-3)
    ub = doc["upper_bound_hit_ratio"]
    for p in doc["points"]:
        assert list(p["runs"]) == list(ROUTERS)
        for name, e in p["runs"].items():
            assert e["requests"] == 24 and e["errors"] == 0, (p["load_percent"], name, e)
            assert 0 < e["ttft_ms"]["p50"] <= e["ttft_ms"]["p90"] <= e["ttft_ms"]["p99"]
            assert 0 <= e["hit_ratio"] <= ub + 1e-6
            assert e["server_hit_ratio"] == pytest.approx(e["hit_ratio"], abs=1e-6)  # the servers agree
            assert 0 < e["host_cpu_busy_ratio"] <= 1
            assert e["virtual_estimate"]["ttft_ms"]["p50"] > 0
            # The client kept to the point's Poisson schedule (the rate is the point's, not a closed loop).
            assert e["send_lag_p99_ms"] < 500
        # Each point's own run document and logs, per router.
        point = json.loads((out / "points" / f"{p['load_percent']:g}pct" / "results.json").read_text())
        assert [r["router"] for r in point["runs"]] == list(ROUTERS)
        for r in point["runs"]:
            # Where the run's CPU went, by process (our gateway: its ext_proc and Envoy; the servers; the client).
            cpu = r["extra"]["cpu_ms_per_request"]
            assert all(cpu[k] > 0 for k in ("router", "envoy", "servers", "client")), cpu
        assert point["workload"]["rate_rps"] == pytest.approx(p["rate_rps"], rel=1e-3)
        assert {r["ttft_ms"]["p50"] for r in point["runs"]} == {e["ttft_ms"]["p50"] for e in p["runs"].values()}
        assert (out / "points" / f"{p['load_percent']:g}pct" / "logs").is_dir()
    md = (out / "report.md").read_text()
    assert sum(line.startswith(("| 40% |", "| 120% |")) for line in md.splitlines()) == 4
    assert "real processes" in md and "--sweep-load-percents 40,120" in md
    for name in sweep_report.PLOT_FILES:
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "ETA" in proc.stderr and "capacity of shared-prompts" in proc.stderr
