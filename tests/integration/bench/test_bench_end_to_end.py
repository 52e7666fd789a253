"""`prefixroute bench` end to end: real model servers, the real gateway (Envoy + ext_proc), real files."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
import time
import urllib.request

import jsonschema
import pytest

from prefixroute.bench import report, results, runner, workloads
from prefixroute.bench.fleet import (FleetConfig, KVEventsPlan, resolve_kv_events, scrape_server_counters,
                                     served_model, start_fleet)
from prefixroute.bench.routers import parse_router
from prefixroute.procs import ProcessGroup

pytestmark = pytest.mark.integration

SMALL = ["--workload", "shared-prompts", "--num-requests", "16", "--num-groups", "2", "--prefix-tokens", "2048",
         "--question-tokens", "16", "--output-tokens", "4", "--rate-rps", "10", "--servers", "2",
         "--profile", "llama-3.1-8b-h200", "--server-args=--time-scale=0.2", "--no-progress"]


@pytest.mark.timeout(90)
def test_bench_two_policies_through_the_gateway(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "prefixroute", "bench", *SMALL,
                           "--routers", "prefixroute:random,prefixroute:prefix", "--out", str(out)],
                          capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    assert results.validate_document(doc) == []
    jsonschema.Draft202012Validator(results.schema()).validate(doc)
    assert [r["router"] for r in doc["runs"]] == ["prefixroute:random", "prefixroute:prefix"]
    ub = doc["upper_bound_hit_ratio"]
    assert 0.5 < ub < 1.0
    by_router = {r["router"]: r for r in doc["runs"]}
    for run in doc["runs"]:
        assert run["requests"] == 16 and run["errors"] == 0
        assert 0.0 <= run["hit_ratio"] <= ub + 1e-6  # no router beats one infinite cache
        assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p90"] <= run["ttft_ms"]["p99"]
        assert run["ttft_ms"]["p50"] < run["e2e_ms"]["p50"]
        assert run["throughput_rps"] > 0
        assert 0 <= run["extra"]["send_lag_ms"]["p99"] < 500  # the client kept to the Poisson schedule
        # Endpoints come from the gateway's response headers and are the fleet's host:port ids.
        assert len(run["endpoint_share"]) == 2 and sum(run["endpoint_share"].values()) == pytest.approx(1.0)
        assert all(k.startswith("127.0.0.1:") for k in run["endpoint_share"])
        # The servers' own counters agree with what the client measured.
        assert run["extra"]["server_hit_ratio"] == pytest.approx(run["hit_ratio"], abs=1e-6)
    # Both runs used the same server ports (fresh processes), so endpoint shares compare.
    shares = [set(r["endpoint_share"]) for r in doc["runs"]]
    assert shares[0] == shares[1]
    # Balance limits may spill a hot group once in so small a run (one extra prefill is ~6% of tokens).
    assert by_router["prefixroute:prefix"]["hit_ratio"] >= 0.75 * ub
    assert by_router["prefixroute:prefix"]["hit_ratio"] >= by_router["prefixroute:random"]["hit_ratio"]
    md = (out / "report.md").read_text()
    assert "| prefixroute:random |" in md and "| prefixroute:prefix |" in md and "1.00x" in md
    for name in report.PLOT_FILES:
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert (out / "logs").is_dir()


def test_bad_arguments_exit_2_with_a_message(tmp_path):
    for extra, fragment in ((["--routers", "nginx"], "unknown router"),
                            (["--routers", "prefixroute:fastest"], "policy must be one of"),
                            (["--trace", str(tmp_path / "missing.jsonl")], "No such file"),
                            (["--arrival", "sometimes"], "--arrival")):
        proc = subprocess.run([sys.executable, "-m", "prefixroute", "bench", *SMALL, *extra, "--out",
                               str(tmp_path / "o")], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and fragment in proc.stderr, (extra, proc.stderr)


@pytest.mark.timeout(60)
def test_sglang_router_in_front_of_the_same_fleet(tmp_path):
    # The test extra installs the [peers] extra: a missing peer router is a broken environment, not a skip.
    assert importlib.util.find_spec("sglang_router") is not None, "sglang-router missing: pip install -e '.[test]'"
    wl = workloads.apply_arrivals(workloads.shared_prompts(num_requests=8, num_groups=2, prefix_tokens=128,
                                                           question_tokens=8, output_tokens=4), "closed")
    fleet = FleetConfig(2, "llama-3.1-8b-h200", ("--time-scale", "0.2"), startup_timeout_s=30)
    out = runner.run_router(parse_router("sglang-router"), wl.requests, fleet, tmp_path, seed=0,
                            concurrency=4, max_connections=16, request_timeout_s=20, max_duration_s=30,
                            progress=False)
    assert out.summary["requests"] == 8 and out.summary["errors"] == 0
    assert out.summary["hit_ratio"] > 0
    assert sum(out.summary["endpoint_share"].values()) == pytest.approx(1.0)


def _small_peer_run(tmp_path, name: str):
    wl = workloads.apply_arrivals(workloads.shared_prompts(num_requests=8, num_groups=2, prefix_tokens=128,
                                                           question_tokens=8, output_tokens=4), "closed")
    fleet = FleetConfig(2, "llama-3.1-8b-h200", ("--time-scale", "0.2"), startup_timeout_s=30)
    return runner.run_router(parse_router(name), wl.requests, fleet, tmp_path, seed=0, concurrency=4,
                             max_connections=16, request_timeout_s=20, max_duration_s=30, progress=False)


@pytest.mark.timeout(90)
def test_vllm_router_kv_aware_is_fed_the_servers_kv_events(tmp_path):
    """vllm-router 0.1.17's kv_aware policy, given each server's publisher and replay socket and the fleet's
    block size and model: it subscribes to every server and routes the run."""
    out = _small_peer_run(tmp_path, "vllm-router:kv_aware")
    assert out.summary["requests"] == 8 and out.summary["errors"] == 0 and out.summary["hit_ratio"] > 0
    log = next((tmp_path / "vllm-router-kv_aware").glob("router-*.log")).read_text(errors="replace")
    assert log.count("kv_index subscriber for http://127.0.0.1:") == 2, log[-3000:]


def _chat(base_url: str, model: str, content: str) -> int:
    body = json.dumps({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": content}]})
    req = urllib.request.Request(f"{base_url}/v1/chat/completions", body.encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as resp:
        return resp.status


@pytest.mark.timeout(90)
def test_vllm_router_kv_aware_routes_to_the_server_whose_events_hold_the_prompt(tmp_path):
    """kv_aware credits only the blocks its servers' events report: a prompt first sent straight to one server of
    three goes, through the router, to that server. Blind (no events received, as when the fleet publishes on a
    topic vllm-router 0.1.17 does not take) it falls back to load and picks a server without regard to the cache,
    so the four prompts below would all land on their warm servers with a chance of about 1 in 81."""
    fleet = resolve_kv_events(FleetConfig(3, "llama-3.1-8b-h200", ("--time-scale", "0.2"), startup_timeout_s=30))
    assert fleet.kv_events
    events = KVEventsPlan.allocate(3)
    with ProcessGroup(tmp_path / "logs") as group, contextlib.ExitStack() as stack:
        endpoints = start_fleet(group, fleet, events)
        model = served_model(endpoints[0])
        handle = runner.start_router(group, stack, parse_router("vllm-router:kv_aware"), endpoints, seed=0,
                                     startup_timeout_s=30, gateway_endpoints=events.gateway_endpoints(endpoints),
                                     kv_block_size=runner.fleet_block_size(fleet), model=model)
        for k, warm in enumerate((1, 2, 0, 2)):
            prompt = " ".join(f"doc{k}-word{i}" for i in range(400))  # ~1,000 tokens: dozens of full blocks
            assert _chat(f"http://{endpoints[warm]}", model, prompt) == 200
            time.sleep(0.5)  # its BlockStored event reaches the router
            before = scrape_server_counters(endpoints)
            assert _chat(handle.base_url, model, prompt) == 200
            after = scrape_server_counters(endpoints)
            served = [ep for ep in endpoints
                      if after[ep].get("request_success", 0) > before[ep].get("request_success", 0)]
            assert served == [endpoints[warm]], (k, served, endpoints)


@pytest.mark.timeout(300)
def test_smg_in_front_of_the_same_fleet(tmp_path):
    """smg 1.13.0 (the SGLang Model Gateway) from its own venv (made on first use: a pip install), cache_aware."""
    assert runner.unavailable_reason(parse_router("smg")) is None
    out = _small_peer_run(tmp_path, "smg")
    assert out.summary["requests"] == 8 and out.summary["errors"] == 0 and out.summary["hit_ratio"] > 0
