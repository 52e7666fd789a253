"""The agents workload through real processes: the simulated servers' Responses API, the gateway, a peer router."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from prefixroute.bench import client, report, results, runner, upper_bound, workloads
from prefixroute.bench.agents_workload import agents
from prefixroute.bench.fleet import FleetConfig, served_model, start_fleet
from prefixroute.bench.routers import parse_router
from prefixroute.procs import ProcessGroup

pytestmark = pytest.mark.integration

FAST = ("--time-scale", "0.2")
TINY = dict(num_agents=4, num_turns=4, num_apps=2, instructions_tokens=256, task_tokens=32, min_tool_output_tokens=32,
            max_tool_output_tokens=64, output_tokens=4, max_active_agents=2, seed=2)


@pytest.fixture
def group(tmp_path):
    with ProcessGroup(tmp_path / "logs") as g:
        yield g


@pytest.mark.timeout(60)
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_one_server_serves_every_turn_and_meets_the_bound_exactly(group, api):
    # One server (it holds every previous response), one request at a time: every follow-up is served, and the
    # server's prompt and cached tokens add up to the bound computed offline from the chat `messages` + tools.
    # So the Responses form and its chat equivalent are the same prompts, token for token.
    (ep,) = start_fleet(group, FleetConfig(1, server_args=FAST))
    wl = workloads.apply_arrivals(agents(**TINY), "closed")
    res = asyncio.run(client.run_workload(f"http://{ep}", wl.requests, model=served_model(ep), concurrency=1,
                                          api=api))
    assert all(r.ok for r in res), [r.error for r in res]
    bound = upper_bound.upper_bound(wl)
    assert sum(r.prompt_tokens for r in res) == bound.prompt_tokens
    assert sum(r.cached_tokens for r in res) == bound.cached_tokens > 0
    if api == "responses":
        assert all(r.response_id and r.response_id.startswith("resp") for r in res)
        # Every turn but the last ends in a function call whose id the next turn answered.
        last = TINY["num_turns"] - 1
        assert all((r.call_id is not None) == (r.turn < last) for r in res)
    a = results.agent_summary(res, api)
    assert a["follow_ups_sent"] == a["follow_ups_served"] == 4 * 3 and a["not_found"] == 0


@pytest.mark.timeout(90)
def test_bench_agents_ours_serves_every_follow_up_random_loses_them(tmp_path):
    out = tmp_path / "out"
    routers = ["prefixroute:prefix", "prefixroute:random/chat"]
    peer = runner.unavailable_reason(parse_router("vllm-router:random"), False) is None
    if peer:
        routers.append("vllm-router:random/responses")
    argv = [sys.executable, "-m", "prefixroute", "bench", "--workload", "agents", "--num-agents", "8",
            "--num-turns", "3", "--agent-num-apps", "2", "--agent-instructions-tokens", "512", "--output-tokens", "4",
            "--rate-rps", "8", "--servers", "4", "--profile", "llama-3.1-8b-h200", "--server-args=--time-scale=0.3",
            "--no-progress", "--routers", ",".join(routers), "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=85)
    doc = json.loads((out / "results.json").read_text())
    assert results.validate_document(doc) == [], proc.stderr[-2000:]
    runs = {r["router"]: r for r in doc["runs"]}
    ours = runs["prefixroute:prefix"]["extra"]["agents"]
    assert ours["api"] == "responses"
    # Every follow-up reached the endpoint holding its previous response.
    assert ours["follow_ups_sent"] == ours["follow_ups_served"] == 8 * 2, runs["prefixroute:prefix"]["extra"]
    assert ours["not_found"] == 0 and runs["prefixroute:prefix"]["errors"] == 0
    chat = runs["prefixroute:random/chat"]["extra"]["agents"]
    assert chat["api"] == "chat" and chat["follow_ups_served"] == 16
    ub = doc["upper_bound_hit_ratio"]
    assert runs["prefixroute:prefix"]["hit_ratio"] <= ub + 1e-6
    assert runs["prefixroute:prefix"]["hit_ratio"] > runs["prefixroute:random/chat"]["hit_ratio"]
    if peer:
        rnd = runs["vllm-router:random/responses"]["extra"]["agents"]
        # Random over 4 endpoints: a follow-up finds its previous response with probability 1/4.
        assert rnd["not_found"] >= 3 and rnd["follow_up_success_ratio"] < 0.75
    md = (out / "report.md").read_text()
    assert "Design targets for prefixroute:prefix (agents)" in md and "| prefixroute:prefix | responses |" in md
    assert report.agent_checks(doc)[0][2] is True
    assert proc.returncode == 0, proc.stderr[-2000:]
