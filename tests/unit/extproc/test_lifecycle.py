"""The request lifecycle (extproc/lifecycle.py): one record per request, one dispatcher, listeners told each
phase once, in registration order; the router service's own listeners learn without any telemetry."""

from __future__ import annotations

import random

import orjson

from helpers.picks import make_pick
from prefixroute.bench.decision_replay import ReplayPool
from prefixroute.extproc.lifecycle import Lifecycle, LifecycleListener, Phase, Pick
from prefixroute.extproc.factory import build_router
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.service import PoolRouter
from prefixroute.types import EndpointId


class Journal(LifecycleListener):
    """Writes down every hook it is called with, as (name, tag, figures)."""

    def __init__(self, tag: str, out: list[tuple]) -> None:
        self.tag = tag
        self.out = out

    def on_decided(self, pick: Pick) -> None:
        self.out.append(("decided", self.tag))

    def on_failed_over(self, pick: Pick, served: EndpointId) -> None:
        self.out.append(("failed_over", self.tag, served))

    def on_first_token(self, pick: Pick) -> None:
        self.out.append(("first_token", self.tag, pick.ttft_s))

    def on_usage(self, pick: Pick) -> None:
        self.out.append(("usage", self.tag, pick.prompt_tokens, pick.cached_tokens))

    def on_ttft_sample(self, pick: Pick) -> None:
        self.out.append(("sample", self.tag, pick.ttft_s, pick.prompt_tokens))

    def on_response_id(self, pick: Pick) -> None:
        self.out.append(("response_id", self.tag, pick.response_id, pick.response_endpoint))

    def on_released(self, pick: Pick) -> None:
        self.out.append(("released", self.tag))


def test_each_phase_reaches_every_listener_once_in_registration_order():
    out: list[tuple] = []
    lc = Lifecycle()
    lc.add(Journal("a", out))
    lc.add(Journal("b", out))
    pick = make_pick(("10.0.0.1:80", "10.0.0.2:80"))
    lc.decided(pick)
    lc.released(pick)  # the routing stream may end first
    lc.first_token(pick, 0.25)
    lc.first_token(pick, 9.0)  # a second report is ignored
    assert lc.failed_over(pick, EndpointId("10.0.0.2:80"))
    assert not lc.failed_over(pick, EndpointId("10.0.0.2:80"))
    lc.usage(pick, 100, 40)
    lc.usage(pick, 1, 1)
    lc.response_id(pick, "resp_1", EndpointId("10.0.0.2:80"))
    lc.released(pick)
    assert out == [("decided", "a"), ("decided", "b"), ("released", "a"), ("released", "b"),
                   ("first_token", "a", 0.25), ("first_token", "b", 0.25),
                   ("failed_over", "a", "10.0.0.2:80"), ("failed_over", "b", "10.0.0.2:80"),
                   ("usage", "a", 100, 40), ("usage", "b", 100, 40), ("sample", "a", 0.25, 100), ("sample", "b", 0.25, 100),
                   ("response_id", "a", "resp_1", "10.0.0.2:80"), ("response_id", "b", "resp_1", "10.0.0.2:80")]
    assert pick.phases == Phase.DECIDED | Phase.RELEASED | Phase.FIRST_TOKEN | Phase.FAILED_OVER | Phase.USAGE | \
        Phase.TTFT_SAMPLE | Phase.RESPONSE_ID


def test_a_usage_before_the_first_token_is_no_sample_and_a_later_report_completes_it():
    out: list[tuple] = []
    lc = Lifecycle()
    lc.add(Journal("a", out))
    pick = make_pick(("10.0.0.1:80",))
    lc.usage(pick, 300, 0)  # a report without a first token: the statistics take it, nothing to learn
    lc.first_token(pick, 1.0)
    lc.usage(pick, 300, 0)  # now the (TTFT, usage) pair is complete
    lc.usage(pick, 300, 0)
    assert out == [("usage", "a", 300, 0), ("first_token", "a", 1.0), ("sample", "a", 1.0, 300)]


def _router(seed: int = 1) -> tuple[PoolRouter, ReplayPool]:
    pool = ReplayPool([f"10.0.0.{i}:8000" for i in range(3)])
    return build_router(RoutingSettings(policy="prefix", rng_seed=seed), pool, clock=lambda: 0.0), pool


def _chat(i: int) -> bytes:
    return orjson.dumps({"model": "m", "stream": True, "messages": [
        {"role": "system", "content": f"system {i % 3} " + "words " * 300},
        {"role": "user", "content": f"question {i}"}]})


def test_the_time_model_learns_through_the_router_service_alone_no_telemetry():
    """No tracker, no recorder, no metrics: first tokens and usages reported to the router service (as the
    virtual fleet does) reach the time model, and the pool's in-flight counts follow the releases."""
    router, pool = _router()
    policy = router.core.scheduler.policy
    model = policy.model  # the prefix policy's time model
    rng = random.Random(3)
    for i in range(80):
        pick = router.route("POST", "/v1/chat/completions", {}, _chat(i))
        assert pool.in_flight[pick.counted] >= 1
        router.first_token(pick, 2.0 + rng.random())  # far slower than the prior: the rate must drop
        router.usage(pick, 2000, 0)
        router.release(pick)
    assert sum(pool.in_flight.values()) == 0
    learned = model.num_observations_by_endpoint()
    assert sum(learned.values()) == 80
    assert all(model.rate(ep) < RoutingSettings().ttft_prior_tokens_per_s / 4 for ep in learned)


def test_a_listener_added_to_the_router_service_sees_its_picks_after_the_router_s_own():
    router, pool = _router()
    out: list[tuple] = []
    router.add_listener(Journal("mine", out))
    pick = router.route("POST", "/v1/chat/completions", {}, _chat(0))
    router.served(pick, pick.endpoints[1], 200)  # Envoy: the primary refused, the first fallback served
    router.first_token(pick, 0.1)
    router.usage(pick, 500, 0)
    router.release(pick)
    assert [o[0] for o in out] == ["decided", "failed_over", "first_token", "usage", "sample", "released"]
    assert out[1][2] == pick.endpoint_ids[1]
    assert pick.counted == pick.endpoint_ids[1]  # the pool listener moved the in-flight count first
    assert pool.failures == [pick.endpoint_ids[0]]
    assert sum(pool.in_flight.values()) == 0
