"""--virtual: our policies' scheduling code on the model servers' virtual-time fleet (in process, no I/O)."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest

from prefixroute.bench import results, upper_bound, virtual, workloads


def _wl(num_requests=60, rate=20.0, **kw):
    base = dict(num_groups=4, prefix_tokens=512, question_tokens=16, output_tokens=8, seed=1)
    wl = workloads.shared_prompts(num_requests=num_requests, **{**base, **kw})
    return workloads.apply_arrivals(wl, "poisson", rate_rps=rate, seed=1)


def test_one_server_reaches_exactly_the_upper_bound():
    # One server with a huge cache sees every request: its hits are the infinite-cache bound, token for token.
    wl = _wl()
    res, endpoints, _ = virtual.simulate_policy(wl, "random", num_servers=1)
    bound = upper_bound.upper_bound(wl)
    assert len(endpoints) == 1 and all(r.ok for r in res)
    assert sum(r.prompt_tokens for r in res) == bound.prompt_tokens
    assert sum(r.cached_tokens for r in res) == bound.cached_tokens


def test_same_document_shape_peers_skipped_and_prefix_beats_random():
    wl = _wl(num_requests=120, num_groups=8)
    bound = upper_bound.upper_bound(wl).hit_ratio
    doc, ttfts = virtual.run_virtual(wl, bound, ["prefixroute:random", "prefixroute:prefix", "sglang-router"],
                                     num_servers=4, log=lambda _m: None)
    assert results.validate_document(json.loads(json.dumps(doc))) == []
    jsonschema.Draft202012Validator(results.schema()).validate(json.loads(json.dumps(doc)))
    assert [r["router"] for r in doc["runs"]] == ["prefixroute:random", "prefixroute:prefix"]
    assert "sglang-router" in doc["skipped"]
    runs = {r["router"]: r for r in doc["runs"]}
    assert all(r["requests"] == 120 and r["errors"] == 0 for r in runs.values())
    # (results round to 6 decimals)
    assert runs["prefixroute:random"]["hit_ratio"] < runs["prefixroute:prefix"]["hit_ratio"] <= bound + 1e-6
    assert sorted(runs["prefixroute:prefix"]["endpoint_share"]) == [f"sim-{i}:8000" for i in range(4)]
    assert len(ttfts["prefixroute:prefix"]) == 120


def test_same_seed_same_results_and_policies_share_prepared_requests():
    wl = _wl(num_requests=40)
    a, _, _ = virtual.simulate_policy(wl, "random", num_servers=3, seed=5)
    b, _, _ = virtual.simulate_policy(wl, "random", num_servers=3, seed=5)
    assert [(r.endpoint, r.ttft_ms, r.cached_tokens) for r in a] == [(r.endpoint, r.ttft_ms, r.cached_tokens)
                                                                     for r in b]


def test_closed_loop_is_refused_with_a_reason():
    wl = workloads.apply_arrivals(_wl(num_requests=4), "closed")
    with pytest.raises(virtual.VirtualFleetUnavailable, match="closed-loop"):
        virtual.simulate_policy(wl, "prefix", num_servers=2)


def test_prompt_longer_than_the_context_window_is_a_400_not_a_crash():
    recs = [workloads.TraceRecord(0, 600, 4, (1, 2)), workloads.TraceRecord(10, 600, 4, (1, 3))]
    wl = workloads.trace_workload(recs)
    res, _, _ = virtual.simulate_policy(wl, "prefix", num_servers=2, fleet_kwargs={"num_gpu_blocks": 36})
    # 36 blocks x 16 tokens = 576-token window: a 600-token prompt does not fit.
    assert [r.status for r in res] == [400, 400] and "context window" in res[0].error


@pytest.mark.parametrize("args,expected", [
    (("--time-scale=0.5",), {"time_scale": 0.5}),
    (("--time-scale", "2", "--num-gpu-blocks", "100"), {"time_scale": 2.0, "num_gpu_blocks": 100}),
    (("--seed", "3"), {}),
])
def test_server_flags_map_to_the_fleet(args, expected):
    assert virtual._fleet_kwargs(args) == expected


def test_cli_virtual_trace_writes_outputs(tmp_path):
    trace = tmp_path / "t.jsonl"
    workloads.write_trace(trace, [workloads.TraceRecord(i * 100, 700 + i, 8, (0, 10 + i % 3)) for i in range(30)])
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "prefixroute", "bench", "--virtual", "--trace", str(trace),
                           "--trace-stop", "20", "--trace-time-scale", "0.5", "--servers", "8", "--routers",
                           "prefixroute:round-robin,prefixroute:prefix", "--profile", "llama-3.1-8b-h200",
                           "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["workload"]["num_requests"] == 20 and doc["workload"]["duration_s"] == pytest.approx(0.95)
    assert doc["workload"]["virtual"] is True
    assert [r["requests"] for r in doc["runs"]] == [20, 20]
    assert (out / "report.md").exists() and (out / "ttft_cdf.png").exists()
