"""Flow control on the virtual fleet (bench/flow_virtual.py, issue 24), with the oracle's view: below
saturation nothing is held and the results equal a run without flow control; past it, the queue holds, orders
by predicted prefill and the median TTFT falls; a short deadline sheds with 429 and the wait counts in TTFT."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from prefixroute.bench import virtual_run, workloads as wl_mod
from prefixroute.bench.capacity import find_capacity, retimed
from prefixroute.bench.flow_virtual import FleetFlow, OracleFlow
from prefixroute.extproc.flow.settings import FlowSettings
from prefixroute.model_servers.virtual_fleet import VirtualFleet

N = 4


@pytest.fixture(scope="module")
def setup():
    wl = wl_mod.shared_prompts(num_groups=40, prefix_tokens=4096, question_tokens=64, num_requests=240,
                               output_tokens=32, seed=0)
    spec = virtual_run.engine_spec("", ["--time-scale=1.8"])
    sims0 = virtual_run.build_sim_requests(wl_mod.apply_arrivals(wl, "poisson", rate_rps=1.0, seed=0), spec)
    cap = find_capacity(wl, spec, N, seed=0, sims=sims0)
    return wl, spec, sims0, cap


def _run(setup, pct: float, settings: FlowSettings | None):
    wl, spec, sims0, cap = setup
    sims = retimed(sims0, wl_mod.apply_arrivals(wl, "poisson", rate_rps=cap.rps * pct / 100, seed=0))
    fleet = VirtualFleet(spec, N)
    oracle = virtual_run.OracleModel(fleet)
    route, on_step, flow = oracle.choose, None, None
    if settings is not None:
        view = OracleFlow(fleet, oracle._time_s, oracle._own.get)
        flow = FleetFlow(fleet, lambda req, fl: oracle.choose(req), settings, loads=view.loads,
                         cost_of=view.cost_of, group_of=view.group_of)
        route, on_step = flow.route, flow.on_step
    else:
        route = lambda req, fl: oracle.choose(req)  # noqa: E731

    def on_finish(res, fl):
        oracle.forget(res.request_id, ended=True)
        return []

    res = fleet.run([dataclasses.replace(s) for s in sims], route, on_finish=on_finish, on_step=on_step)
    return res, flow


def _p50(res) -> float:
    return statistics.median(r.ttft_s for r in res if r.status == 200)


def test_below_saturation_nothing_is_held_and_nothing_changes(setup) -> None:
    plain, _ = _run(setup, 40, None)
    held, flow = _run(setup, 40, FlowSettings())
    assert flow.control.stats.num_held == 0 and flow.waits_s == {}
    assert [(r.request_id, r.server, r.first_token_s) for r in held] == \
        [(r.request_id, r.server, r.first_token_s) for r in plain]


def test_past_saturation_the_queue_cuts_the_median(setup) -> None:
    plain, _ = _run(setup, 150, None)
    held, flow = _run(setup, 150, FlowSettings())
    assert flow.control.stats.num_held > 0 and flow.control.stats.released
    assert all(r.status == 200 for r in held)
    assert _p50(held) < 0.7 * _p50(plain)


def test_a_short_deadline_sheds_with_429_after_waiting(setup) -> None:
    res, flow = _run(setup, 150, FlowSettings(deadline_s=0.2))
    shed = [r for r in res if r.status != 200]
    assert shed and all(r.status == 429 for r in shed)
    stats = flow.control.stats.shed
    assert stats[("deadline", 429)] > 0  # some waited to their deadline (others were shed at arrival)
    for r in shed:  # answered when shed: at arrival (predicted), or after waiting up to the deadline
        assert r.finished_s - r.arrival_s == pytest.approx(flow.waits_s.get(r.request_id, 0.0))
        assert r.finished_s - r.arrival_s <= 0.2 + 1e-9
    assert '"RateLimitError"' in shed[0].error


@pytest.mark.parametrize(("name", "flow", "policy", "source", "replicas"), [
    ("prefixroute:prefix", None, "prefix", "", 1),
    ("prefixroute:prefix+flow", True, "prefix", "", 1),
    ("prefixroute:prefix-flow", False, "prefix", "", 1),
    ("prefixroute:prefix@events#2+flow", True, "prefix", "events", 2),
    ("prefixroute:random-flow", False, "random", "", 1),
])
def test_router_names_say_whether_flow_control_runs(name, flow, policy, source, replicas) -> None:
    from prefixroute.bench.routers import parse_router

    r = parse_router(name)
    assert (r.flow, r.policy, r.index_source, r.replicas, r.name) == (flow, policy, source, replicas, name)


@pytest.mark.parametrize(("name", "routing_filter", "flow", "policy"), [
    ("prefixroute:prefix", "", None, "prefix"),
    ("prefixroute:prefix@events#2+flow+authz-http", "ext_authz_http", True, "prefix"),
    ("prefixroute:prefix+authz-http", "ext_authz_http", None, "prefix"),
    ("prefixroute:prefix-flow+authz-http", "ext_authz_http", False, "prefix"),
    ("prefixroute:prefix+extproc", "ext_proc", None, "prefix"),
])
def test_router_names_say_whether_envoy_routes_by_ext_authz(name, routing_filter, flow, policy) -> None:
    from prefixroute.bench.routers import parse_router

    r = parse_router(name)
    assert (r.routing_filter, r.flow, r.policy, r.name) == (routing_filter, flow, policy, name)
