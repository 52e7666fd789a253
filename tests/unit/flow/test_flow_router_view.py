"""Flow control's view of the live router (extproc/flow/router.py, issue 24): a real PoolRouter over a simulated
pool; a pick shows as queued seconds on its endpoint, and a second request of the same prefix costs less than
a cold one once the first is placed (its prefix is pending there)."""

from __future__ import annotations

import orjson

from prefixroute.bench.sim_pool import SimulatedPool
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.flow.router import RouterView
from prefixroute.extproc.routing.request import parse_request
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.service import PoolRouter
from prefixroute.model_servers.virtual_fleet import VirtualFleet

HEADERS = {"content-type": "application/json"}


def _body(system: str, question: str) -> bytes:
    return orjson.dumps({"messages": [{"role": "system", "content": system},
                                                     {"role": "user", "content": question}]})


def test_loads_and_costs_follow_the_router() -> None:
    fleet = VirtualFleet(num_servers=2)
    pool = SimulatedPool(fleet, PoolSettings(), seed=0)
    settings = RoutingSettings(policy="prefix", ttft_prior_tokens_per_s=10_000.0, ttft_prior_base_s=0.0, rng_seed=0)
    router = PoolRouter(RouterCore(settings, track_prefill=True), pool, clock=lambda: fleet.now_s)
    view = RouterView(router, stale_after_s=1.0)
    assert [x.queued_s for x in view.loads()] == [0.0, 0.0]
    system = "You are a careful assistant. " * 400
    first = parse_request("POST", "/v1/chat/completions", HEADERS, _body(system, "q1"), router.settings)
    sibling = parse_request("POST", "/v1/chat/completions", HEADERS, _body(system, "q2"), router.settings)
    cold = parse_request("POST", "/v1/chat/completions", HEADERS, _body("Other. " * 1700, "q3"), router.settings)
    assert view.group_of(first) == view.group_of(sibling) != view.group_of(cold)
    before = view.cost_of(sibling)
    pick = router.route("POST", "/v1/chat/completions", HEADERS, first)
    loads = {x.endpoint: x for x in view.loads()}
    held = loads[pick.endpoint_ids[0]]
    assert held.queued_s > 0.2 and held.num_in_flight == 1  # ~12k characters of prefill at 10k tokens/s
    assert sum(x.queued_s for x in loads.values()) == held.queued_s
    assert view.cost_of(sibling) < 0.1 * before  # its prefix is now pending on the first one's endpoint
    assert view.cost_of(cold) > 0.5 * before


def _one_pick(stream: bool, drain: bool, first_token_live: bool = True):
    now = [0.0]
    fleet = VirtualFleet(num_servers=2)
    pool = SimulatedPool(fleet, PoolSettings(), seed=0)
    settings = RoutingSettings(policy="prefix", ttft_prior_tokens_per_s=10_000.0, ttft_prior_base_s=0.0, rng_seed=0)
    router = PoolRouter(RouterCore(settings, track_prefill=True), pool, clock=lambda: now[0])
    view = RouterView(router, stale_after_s=1.0, drain=drain)
    body = orjson.dumps({"messages": [{"role": "user", "content": "Tell me more. " * 800}], "stream": stream})
    pick = router.route("POST", "/v1/chat/completions", HEADERS,
                        parse_request("POST", "/v1/chat/completions", HEADERS, body, router.settings),
                        first_token_live=first_token_live)
    return router, view, pick, now


def _queued(view: RouterView, pick) -> float:
    return {x.endpoint: x.queued_s for x in view.loads()}[pick.endpoint_ids[0]]


def test_a_streamed_picks_prefill_stays_outstanding_until_its_first_token() -> None:
    router, view, pick, now = _one_pick(stream=True, drain=False)
    assert _queued(view, pick) > 0.2
    now[0] = 30.0  # far past its predicted prefill: a slow server has not reported a first token yet
    assert _queued(view, pick) > 0.2
    router.first_token(pick, 30.0)
    assert _queued(view, pick) < 0.001  # only its decoding share of the steps is left


def test_a_non_streamed_pick_and_the_drain_setting_drain_at_the_predicted_rate() -> None:
    # A non-streamed response reports no first token: its prefill drains as predicted instead of holding the
    # gate until the response ends. --saturation-drain drains every pick so.
    for stream, drain in ((False, False), (True, True)):
        router, view, pick, now = _one_pick(stream=stream, drain=drain)
        assert _queued(view, pick) > 0.2
        now[0] = 30.0
        assert _queued(view, pick) == 0.0, (stream, drain)


def test_on_the_facts_path_a_streamed_pick_drains_at_the_predicted_rate() -> None:
    # The facts path reports a first token only with the request's end (Envoy's record): waiting on it would
    # hold the gate through every decode, so such a pick drains as predicted.
    router, view, pick, now = _one_pick(stream=True, drain=False, first_token_live=False)
    assert not pick.first_token_live and _queued(view, pick) > 0.2
    now[0] = 30.0
    assert _queued(view, pick) == 0.0
