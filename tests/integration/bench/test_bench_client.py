"""The streaming client against real simulated model servers (real processes, real HTTP on loopback)."""

from __future__ import annotations

import asyncio
import dataclasses
import io

import pytest

from prefixroute.bench import client, upper_bound, workloads
from prefixroute.bench.fleet import FleetConfig, served_model, start_fleet
from prefixroute.bench.workload_spec import Workload
from prefixroute.procs import ProcessGroup, free_port, http_get, prefixroute_argv

pytestmark = pytest.mark.integration

FAST = ("--time-scale", "0.2")  # modelled step times x0.2: same cache behaviour, 5x shorter test


@pytest.fixture
def group(tmp_path):
    with ProcessGroup(tmp_path / "logs") as g:
        yield g


def test_one_server_hits_exactly_the_upper_bound_and_reports_everything(group):
    # One server with a cache far larger than the workload, requests one at a time: the server's
    # cached_tokens must add up to the infinite-cache bound computed offline with the same tokenizer.
    (ep,) = start_fleet(group, FleetConfig(1, server_args=FAST))
    wl = workloads.shared_prompts(num_groups=3, prefix_tokens=256, question_tokens=16, num_requests=12,
                                  output_tokens=5, seed=4)
    wl = workloads.apply_arrivals(wl, "closed")
    stream = io.StringIO()
    res = asyncio.run(client.run_workload(f"http://{ep}", wl.requests, model=served_model(ep), concurrency=1,
                                          progress=client.Progress(len(wl.requests), stream=stream)))
    assert [r.index for r in res] == list(range(12))
    assert all(r.ok for r in res), [r.error for r in res]
    bound = upper_bound.upper_bound(wl)
    assert sum(r.prompt_tokens for r in res) == bound.prompt_tokens
    assert sum(r.cached_tokens for r in res) == bound.cached_tokens > 0
    for r in res:
        assert r.endpoint == ep
        assert r.completion_tokens == 5 and len(r.itl_ms) >= 1
        assert 0 < r.ttft_ms <= r.e2e_ms
    assert "12/12" in stream.getvalue()


def test_server_errors_are_recorded_with_status(group):
    port = free_port()
    group.start("failing", prefixroute_argv("model-server", "--port", str(port), "--fail-ratio", "1.0", *FAST),
                ready=lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200)
    wl = workloads.shared_prompts(num_requests=3, prefix_tokens=16, question_tokens=4, output_tokens=4)
    res = asyncio.run(client.run_workload(f"http://127.0.0.1:{port}", wl.requests,
                                          model=served_model(f"127.0.0.1:{port}"), concurrency=4))
    assert len(res) == 3
    assert all(r.status == 500 and not r.ok and r.error.startswith("http 500") for r in res)


def test_next_turn_waits_for_the_previous_one(group):
    (ep,) = start_fleet(group, FleetConfig(1, server_args=FAST))
    wl = workloads.multi_turn(num_sessions=3, num_turns=3, system_tokens=64, user_tokens=16, output_tokens=16)
    # Every request "arrives" at t=0: only after_index keeps a session's turns in order.
    wl = Workload(wl.name, wl.params, tuple(dataclasses.replace(r, arrival_s=0.0)
                                                        for r in wl.requests))
    res = asyncio.run(client.run_workload(f"http://{ep}", wl.requests, model=served_model(ep)))
    assert all(r.ok for r in res)
    by_index = {r.index: r for r in res}
    for spec in wl.requests:
        if spec.after_index is not None:
            prev = by_index[spec.after_index]
            assert by_index[spec.index].start_s >= prev.start_s + prev.e2e_ms / 1000.0
            # and the resent conversation hits the previous turn's prompt in the cache
            assert by_index[spec.index].cached_tokens >= prev.prompt_tokens // 16 * 16 - 16


def test_an_agent_turn_waits_its_think_time_after_the_previous_one(group):
    """agent-loops: a follow-up goes at its arrival time or `think_s` after its previous turn ends, whichever is
    later (the agent's tool running)."""
    from prefixroute.bench.agent_loops import AgentLoopShape, agent_loops

    (ep,) = start_fleet(group, FleetConfig(1, server_args=FAST))
    shape = AgentLoopShape(num_agents=2, preamble_tokens=64, task_tokens=16, min_turn_tokens=20, max_turn_tokens=40,
                           max_context_tokens=4096, min_think_s=0.3, max_think_s=0.5, min_output_tokens=4,
                           max_output_tokens=8)
    wl = agent_loops(shape, num_requests=8, seed=2)
    wl = Workload(wl.name, wl.params, tuple(dataclasses.replace(r, arrival_s=0.0) for r in wl.requests))
    res = asyncio.run(client.run_workload(f"http://{ep}", wl.requests, model=served_model(ep)))
    assert all(r.ok for r in res), [r.error for r in res]
    by_index = {r.index: r for r in res}
    waited = 0
    for spec in wl.requests:
        if spec.after_index is not None:
            prev = by_index[spec.after_index]
            assert by_index[spec.index].start_s >= prev.start_s + prev.e2e_ms / 1000.0 + spec.think_s - 0.005
            waited += 1
    assert waited == 6


def test_connection_refused_is_an_error_not_a_crash():
    port = free_port()  # nothing listens there
    wl = workloads.shared_prompts(num_requests=3, prefix_tokens=4, question_tokens=2)
    res = asyncio.run(client.run_workload(f"http://127.0.0.1:{port}", wl.requests, model="m", concurrency=2))
    assert len(res) == 3 and all(r.status == 0 and "Connect" in r.error for r in res)


def test_duration_bound_cancels_in_flight_and_skips_the_rest(group):
    # Slow server (time scale 20: a 2k-token prefill takes ~1 s): a 1.5 s bound must end the run early.
    (ep,) = start_fleet(group, FleetConfig(1, server_args=("--time-scale", "20")))
    wl = workloads.apply_arrivals(workloads.shared_prompts(num_requests=40, prefix_tokens=2048, output_tokens=64),
                                  "closed")
    res = asyncio.run(client.run_workload(f"http://{ep}", wl.requests, model=served_model(ep),
                                          concurrency=2, max_duration_s=1.5))
    assert 0 < len(res) < 40
    assert any(r.error == "deadline" for r in res)
