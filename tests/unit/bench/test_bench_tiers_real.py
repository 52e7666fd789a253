"""Real processes' hit ratio by KV tier in the bench (issue 25): the servers' own counters by tier against the
router's prediction by tier, scraped from its /metrics (two replicas adding up) into ``hit_ratio_by_tier``, the
key the virtual fleet writes, and rendered by the report."""

from __future__ import annotations

from prefixroute.bench import report, runner

ROUTER_TEXT = """# HELP prefixroute_tier_predicted_prompt_tokens_total x
prefixroute_tier_predicted_prompt_tokens_total{endpoint="10.0.0.1:8000"} 600.0
prefixroute_tier_predicted_prompt_tokens_total{endpoint="10.0.0.2:8000"} 400.0
prefixroute_predicted_tier_hit_tokens_total{endpoint="10.0.0.1:8000",tier="gpu"} 300.0
prefixroute_predicted_tier_hit_tokens_total{endpoint="10.0.0.1:8000",tier="cpu"} 100.0
prefixroute_predicted_tier_hit_tokens_total{endpoint="10.0.0.2:8000",tier="gpu"} 100.0
prefixroute_predicted_tier_hit_tokens_total{endpoint="10.0.0.2:8000",tier="cpu"} 150.0
prefixroute_prompt_tokens_total{endpoint="10.0.0.1:8000"} 1000.0
"""


def test_router_prediction_by_tier_sums_over_endpoints_and_replicas():
    got = runner.parse_router_metrics(ROUTER_TEXT)
    assert got["predicted_by_tier"] == {"gpu": 0.4, "cpu": 0.25}
    # a second replica's counters add to the first's
    assert runner.parse_router_metrics(ROUTER_TEXT + ROUTER_TEXT.replace("8000", "8001"))["predicted_by_tier"] == \
        {"gpu": 0.4, "cpu": 0.25}
    assert "predicted_by_tier" not in runner.parse_router_metrics("prefixroute_prompt_tokens_total 5\n")


def test_actual_by_tier_from_the_servers_counters():
    counters = {"a": {"external_prefix_cache_hits": 150.0, "prefix_cache_hits": 500.0},
                "b": {"external_prefix_cache_hits": 50.0}}
    extra = {"prompt_tokens": 1000, "cached_tokens": 650}
    got = runner.tiers_from_servers(extra, counters, runner.parse_router_metrics(ROUTER_TEXT))
    assert got == {"gpu": 0.45, "cpu": 0.2, "source": "server metrics", "predicted": {"gpu": 0.4, "cpu": 0.25}}
    # a peer's run: the servers' split, no prediction
    assert "predicted" not in runner.tiers_from_servers(extra, counters, None)
    # no host tier used (or none at all): nothing by tier
    assert runner.tiers_from_servers(extra, {"a": {"prefix_cache_hits": 500.0}}, None) is None
    assert runner.tiers_from_servers({"prompt_tokens": 0}, counters, None) is None


def test_the_report_shows_actual_and_predicted_by_tier():
    runs = [{"router": "prefixroute:prefix@events", "hit_ratio": 0.65,
             "extra": {"hit_ratio_by_tier": {"gpu": 0.45, "cpu": 0.2, "source": "server metrics",
                                             "predicted": {"gpu": 0.4, "cpu": 0.25}}}},
            {"router": "sglang-router", "hit_ratio": 0.6,
             "extra": {"hit_ratio_by_tier": {"gpu": 0.5, "cpu": 0.1, "source": "server metrics"}}}]
    bounds = {"belady_hit_ratio": 0.7, "lru_pooled_hit_ratio": 0.5}
    text = "\n".join(report.render_bounds_by_router(runs, bounds))
    assert "| prefixroute:prefix@events | 0.650 | 0.450 / 0.200 (predicted 0.400 / 0.250) |" in text
    assert "| sglang-router | 0.600 | 0.500 / 0.100 |" in text
