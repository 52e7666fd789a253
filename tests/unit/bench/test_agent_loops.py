"""The agent-loops workloads (bench/agent_loops.py) and the balance the prefix policy keeps on them: agents that
re-send a growing context behind one shared tool preamble are not piled onto the preamble's holder."""

from __future__ import annotations

import collections
import dataclasses
import statistics

import pytest

from prefixroute.bench import virtual_run, workloads
from prefixroute.bench.agent_loops import SHAPES, AgentLoopShape, agent_loops
from prefixroute.extproc.routing.settings import RoutingSettings


def _text(r) -> str:  # noqa: ANN001
    return "".join(m["content"] for m in r.messages)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_turn_extends_its_previous_turn_and_waits_its_think_time(name):
    shape = SHAPES[name]
    wl = agent_loops(shape, num_requests=400, seed=1, name=name)
    by_index = {r.index: r for r in wl.requests}
    assert len(wl.requests) == 400 and wl.name == name
    for r in wl.requests:
        assert shape.min_output_tokens <= r.max_tokens <= shape.max_output_tokens
        assert r.approx_prompt_tokens() <= shape.max_context_tokens + shape.subtask_tokens + 32
        if r.after_index is None:
            assert r.think_s == 0.0 and r.turn == 0
            continue
        prev = by_index[r.after_index]
        assert prev.index < r.index and _text(r).startswith(_text(prev))  # its history, re-sent whole
        assert shape.min_think_s <= r.think_s <= shape.max_think_s
        if prev.session_id == r.session_id:
            grown = r.approx_prompt_tokens() - prev.approx_prompt_tokens()
            assert shape.min_turn_tokens - 1 <= grown <= shape.max_turn_tokens + 1
    preambles = {r.messages[0]["content"] for r in wl.requests}
    assert len(preambles) == shape.num_preambles  # the tool preamble every agent of it shares
    if shape.fanout_every:
        subs = [r for r in wl.requests if ".sub" in (r.session_id or "") and r.turn == 0]
        assert subs and all(by_index[r.after_index].session_id != r.session_id for r in subs)
    assert agent_loops(shape, num_requests=400, seed=1, name=name).requests == wl.requests


def test_shape_arguments_are_checked():
    assert AgentLoopShape().with_args("num_agents=48,max_think_s=5").num_agents == 48
    assert AgentLoopShape().with_args(("max-think-s=5",)).max_think_s == 5.0
    for bad in ("num_agents", "agents=3", "num_agents=x", "min_think_s=4", "max_context_tokens=1000"):
        with pytest.raises(ValueError):
            AgentLoopShape().with_args(bad)
    wl = workloads.make_workload("agent-loops", num_requests=50, seed=0, output_tokens=1, prefix_tokens=1,
                                 num_groups=1, question_tokens=1, num_sessions=1, num_turns=1, document_tokens=1,
                                 num_documents=1, agent_loop_args="num_agents=3")
    assert wl.params["num_agents"] == 3 and len({r.session_id for r in wl.requests}) >= 3


def test_a_follow_up_waits_its_think_time_in_the_virtual_fleet():
    wl = workloads.apply_arrivals(agent_loops(AgentLoopShape(num_agents=4), num_requests=60, seed=0), "poisson",
                                  rate_rps=100.0, seed=0)
    spec = virtual_run.engine_spec("llama-3.1-70b-h200-tp4")
    res, _, _ = virtual_run.simulate_policy(wl, "random", num_servers=2, spec=spec, seed=0)
    ended = {r.index: r.start_s + r.e2e_ms / 1000.0 for r in res}
    for spec_r, r in zip(wl.requests, res):
        if spec_r.after_index is not None:
            assert r.start_s >= ended[spec_r.after_index] + spec_r.think_s - 1e-9


def _run(routing_overrides: dict) -> tuple[list, list[str], set[int]]:
    """Route the agents (700 requests at 10 req/s) on four virtual 70B TP4 servers: (results, endpoints, the
    indexes of the agents' first turns)."""
    wl = workloads.apply_arrivals(agent_loops(SHAPES["agent-loops"], num_requests=700, seed=0), "poisson",
                                  rate_rps=10.0, seed=0)
    spec = virtual_run.engine_spec("llama-3.1-70b-h200-tp4")
    rate, base = spec.time_model_prior()
    routing = RoutingSettings(policy="prefix", rng_seed=0, tokenizer="sim", ttft_prior_tokens_per_s=rate,
                              ttft_prior_base_s=base, **routing_overrides)
    res, eps, _ = virtual_run.simulate_policy(wl, "prefix", num_servers=4, spec=spec, seed=0, routing=routing)
    return res, eps, {r.index for r in wl.requests if r.turn == 0}


def _figures(res) -> tuple[float, float, float, float]:  # noqa: ANN001
    """(TTFT p50 ms, p90 ms, the busiest endpoint's share over its fair one, hit ratio)."""
    ttft = sorted(r.ttft_ms for r in res if r.ttft_ms is not None)
    shares = collections.Counter(r.endpoint for r in res)
    hit = sum(r.cached_tokens or 0 for r in res) / sum(r.prompt_tokens for r in res)
    return (statistics.median(ttft), ttft[int(0.9 * len(ttft))], max(shares.values()) / len(res) * 4, hit)


def test_balance_agents_behind_one_preamble_are_spread_not_piled_on_its_holder():
    """The rule (docs/routing.md, Balance): while an endpoint sits idle, a conversation joins a busier one only
    when moving is dearer than the waiting its remaining turns would add there. 24 agents behind one 4k-token
    tool preamble, 0.5-3 s of tool time between turns, about 10 requests a second, on four 70B TP4 servers: the
    router without the conversation-load term sends every one of them to the preamble's first holder (4x its fair
    share). With it, the agents that start before any has been seen to continue gather there too (the router
    cannot know yet), then some move; every agent that starts later (after the first 300 requests) goes
    elsewhere, the busiest endpoint's share falls, the median and P90 TTFT fall, and the hit ratio stays within
    0.01."""
    on, eps, first_turns = _run({})
    off, _, _ = _run({"conversation_horizon_turns": 0.0})
    p50, p90, busiest, hit = _figures(on)
    p50_off, p90_off, busiest_off, hit_off = _figures(off)
    assert busiest_off > 3.5  # the pile-up this guards against
    holder = collections.Counter(r.endpoint for r in on[:300]).most_common(1)[0][0]
    later = [r.endpoint for r in on[300:] if r.index in first_turns]
    assert later and holder not in later
    assert {r.endpoint for r in on} == set(eps)
    assert busiest < 0.6 * busiest_off and _figures(on[300:])[2] < 0.5 * busiest_off
    assert p50 <= 0.85 * p50_off and p90 <= 0.75 * p90_off
    assert hit >= hit_off - 0.01


def test_one_off_traffic_routes_as_without_the_conversation_term():
    """Questions behind shared system prompts continue no conversation: the term never applies, every pick is
    the one the router makes without it."""
    wl = workloads.apply_arrivals(workloads.shared_prompts(num_groups=6, prefix_tokens=2000, num_requests=200),
                                  "poisson", rate_rps=8.0, seed=0)
    spec = virtual_run.engine_spec("llama-3.1-70b-h200-tp4")
    picks = []
    for horizon in (32.0, 0.0):
        routing = RoutingSettings(policy="prefix", rng_seed=0, tokenizer="sim", conversation_horizon_turns=horizon)
        res, _, _ = virtual_run.simulate_policy(wl, "prefix", num_servers=4, spec=spec, seed=0, routing=routing)
        picks.append([r.endpoint for r in res])
    assert picks[0] == picks[1]


def test_shapes_are_named_workloads():
    assert set(SHAPES) <= set(workloads.WORKLOAD_NAMES)
    assert dataclasses.asdict(SHAPES["agent-loops"])["num_agents"] == 24
