"""The worked examples of docs/extending.md run: the scorer's policy decides as its contract says, and the
lifecycle listener, registered on a router the factory built, hears every first token. (If an interface they
use changes, this fails, so the docs cannot rot.)"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import orjson

from prefixroute.bench.decision_replay import ReplayPool
from prefixroute.extproc.factory import build_router
from prefixroute.extproc.routing.request import parse_request
from prefixroute.extproc.routing.scheduling import filters
from prefixroute.extproc.routing.scheduling.policies import PolicyInput, prefix_key
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.types import EndpointId, EndpointState

EXAMPLES = Path(__file__).resolve().parents[3] / "docs" / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_examples_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _chat(i: int) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "system", "content": f"prompt {i} " * 100},
                                                    {"role": "user", "content": "hi"}]})


def test_the_scorer_example_picks_the_least_used_kv_cache_and_breaks_ties_by_rendezvous():
    policy_cls = _load("least_kv_usage").LeastKvUsagePolicy
    settings = RoutingSettings(num_fallbacks=1)
    usage = [0.9, 0.2, 0.5, 0.2]
    eps = tuple(EndpointState(EndpointId(f"10.0.0.{i}:80"), kv_cache_usage_ratio=u) for i, u in enumerate(usage))
    view = filters.EligibleView(eps)
    policy = policy_cls(settings, random.Random(0))
    cheapest = ("10.0.0.1:80", "10.0.0.3:80")  # both at 0.2
    for i in range(20):
        req = parse_request("POST", "/v1/chat/completions", {}, _chat(i), settings)
        inp = PolicyInput(request=req, eligible=view.endpoints, in_flight={}, matches={}, view=view)
        d = policy.decide(inp)
        # equal scores go in rendezvous order on the prefix key: where consistent hashing ranks them
        ranked = [s.endpoint for s in inp.rendezvous().ranked(prefix_key(req, settings.cold_key_blocks))]
        assert list(d.endpoints) == [ep for ep in ranked if ep in cheapest]


def test_the_listener_example_hears_the_first_tokens_of_a_router_built_by_the_factory():
    listener = _load("slow_first_tokens").SlowFirstTokens()
    pool = ReplayPool([f"10.0.0.{i}:8000" for i in range(3)])
    router = build_router(RoutingSettings(rng_seed=1), pool, clock=lambda: 0.0)
    router.add_listener(listener)
    for i in range(30):
        pick = router.route("POST", "/v1/chat/completions", {}, _chat(i % 4))
        predicted_s = pick.decision.predicted_ttft_ms / 1000.0
        router.first_token(pick, predicted_s * (3.0 if i % 3 == 0 else 1.0))  # every third 3x late
        router.usage(pick, 100, 0)
        router.release(pick)
    assert sum(listener.seen.values()) == 30
    assert sum(listener.slow.values()) == 10
