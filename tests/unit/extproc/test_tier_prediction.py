"""`lifecycle_listeners.TierPredictionListener` and its collector: the router's hit prediction by KV tier, at the
decision, counted in the server's accounting at the usage (issue 25: predicted hit ratio by tier, real
processes); the PoolRouter registers it only with a tier-aware events index."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from prefixroute.bench.decision_replay import ReplayPool
from prefixroute.extproc.factory import build_router
from prefixroute.extproc.kv_events import KVEventIndex
from prefixroute.extproc.kv_events.tiers import TieredKVEventIndex
from prefixroute.extproc.lifecycle import Pick
from prefixroute.extproc.lifecycle_listeners import TierPredictionCollector, TierPredictionListener
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.types import EndpointId

A, B = EndpointId("10.0.0.1:8000"), EndpointId("10.0.0.2:8000")


class _Index:
    """What the listener asks of the events index: the last match's (GPU, CPU) blocks per endpoint."""

    def __init__(self, tiers: dict) -> None:
        self.tiers = tiers

    def last_tiers(self, endpoint):
        return self.tiers.get(endpoint, (0, 0))


def _listener(tiers: dict, event_endpoints=(A, B)) -> TierPredictionListener:
    core = SimpleNamespace(settings=SimpleNamespace(kv_block_tokens=16),
                           sourced=SimpleNamespace(event_endpoints=frozenset(event_endpoints)))
    return TierPredictionListener(core, _Index(tiers))  # type: ignore[arg-type]


def _pick(primary=A, fallback=B) -> Pick:
    return Pick((str(primary), str(fallback)), (primary, fallback), None, None, 10.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("tiers", "prompt_tokens", "gpu", "cpu"), [
    ((3, 5), 200, 48, 80),  # whole blocks of 16 tokens
    ((3, 5), 129, 48, 80),  # 128 = 8 blocks: the last full block held too
    ((3, 5), 128, 48, 64),  # at most n - 1 tokens: 7 blocks, the CPU ones after the GPU ones take the cut
    ((10, 5), 100, 96, 0),  # the GPU blocks alone reach the cap (6 blocks)
    ((0, 0), 300, 0, 0),  # predicted a miss: its prompt tokens still count
])
def test_usage_counts_the_prediction_in_the_servers_accounting(tiers, prompt_tokens, gpu, cpu):
    listener = _listener({A: tiers})
    pick = _pick()
    listener.on_decided(pick)
    assert pick.predicted_tiers == tiers
    pick.prompt_tokens = prompt_tokens
    listener.on_usage(pick)
    assert listener.tokens == {A: [prompt_tokens, gpu, cpu]}


def test_no_prediction_without_events_or_usage_and_none_for_a_failover():
    listener = _listener({A: (3, 5), B: (1, 1)}, event_endpoints=(B,))
    pick = _pick()  # A is not matched by its events: no tier prediction
    listener.on_decided(pick)
    assert pick.predicted_tiers is None
    pick.prompt_tokens = 100
    listener.on_usage(pick)
    listener = _listener({A: (3, 5)})
    no_usage, failed_over = _pick(), _pick()
    for p in (no_usage, failed_over):
        listener.on_decided(p)
    listener.on_usage(no_usage)  # prompt_tokens None: not reported
    failed_over.counted, failed_over.prompt_tokens = B, 100  # served by the fallback: predicted for another
    listener.on_usage(failed_over)
    assert listener.tokens == {}


def test_collector_exposes_the_counters_per_endpoint_and_tier():
    listener = _listener({A: (3, 5), B: (2, 0)})
    for ep, n in ((A, 200), (A, 200), (B, 64)):
        pick = _pick(ep, A if ep == B else B)
        listener.on_decided(pick)
        pick.prompt_tokens = n
        listener.on_usage(pick)
    registry = CollectorRegistry()
    registry.register(TierPredictionCollector(listener))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(generate_latest(registry).decode()) for s in fam.samples}
    assert samples[("prefixroute_tier_predicted_prompt_tokens_total", (("endpoint", A),))] == 400
    assert samples[("prefixroute_predicted_tier_hit_tokens_total", (("endpoint", A), ("tier", "cpu")))] == 160
    assert samples[("prefixroute_predicted_tier_hit_tokens_total", (("endpoint", A), ("tier", "gpu")))] == 96
    assert samples[("prefixroute_predicted_tier_hit_tokens_total", (("endpoint", B), ("tier", "gpu")))] == 32


def test_the_router_registers_it_only_with_a_tier_aware_events_index():
    pool = ReplayPool([A, B])
    s = RoutingSettings(tokenizer="sim")
    assert build_router(s, pool, event_index=TieredKVEventIndex(16), event_endpoints=[A]).tier_prediction is not None
    assert build_router(s, pool, event_index=KVEventIndex(16), event_endpoints=[A]).tier_prediction is None
    assert build_router(s, pool).tier_prediction is None
