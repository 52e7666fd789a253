"""Router Prometheus metrics, scraped over real HTTP and parsed as Prometheus text (their cost per request:
tests/unit/telemetry/test_telemetry_metrics.py)."""

from __future__ import annotations

import pytest

from prefixroute.types import Decision
from prefixroute.telemetry.metrics import RouterMetrics
from prefixroute.telemetry.records import RequestRecord
from helpers.metrics import scrape

pytestmark = pytest.mark.integration

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


class FakeRecorder:  # only the counters the metrics read
    dropped_by_reason = {"queue_full": 4, "retry_buffer_full": 3, "rejected": 0}
    num_exported = 93
    num_pending = 12
    retry_bytes = 4096


def record(endpoint, status, ttft_ms, prompt, cached, predicted):
    return RequestRecord(trace_id="1" * 32, span_id="1" * 16, start_time=0.0, endpoint=endpoint, status=status,
                         ttft_ms=ttft_ms, latency_ms=100.0, prompt_tokens=prompt, cached_tokens=cached,
                         predicted_hit_ratio=predicted)


REQUESTS = [
    (A, 200, 12.0, 1000, 800, 0.75), (A, 200, 30.0, 500, 0, 0.0), (B, 503, None, None, None, 0.5),
    (B, 200, 700.0, 2000, 1500, 1.0), (A, 0, None, None, None, 0.2),
]
DECISIONS = [(Decision((A, B), "affinity", "prefix"), 40.0), (Decision((B,), "spill", "prefix"), 900.0),
             (Decision((), "load", "prefix"), 3.0), (Decision((A, B), "affinity", "prefix"), 60.0)]


def test_metrics_values():
    m = RouterMetrics(in_flight=lambda: {A: 3, B: 0}, index_size=lambda: 1234, recorder=FakeRecorder())
    for d, us in DECISIONS:
        m.observe_decision(d, us)
    for r in REQUESTS:
        m.observe_response(record(*r))
    s = scrape(m)
    lab = lambda **kw: tuple(sorted(kw.items()))  # noqa: E731
    assert s[("prefixroute_decisions_total", lab(endpoint=A, policy="prefix", reason="affinity"))] == 2
    assert s[("prefixroute_decisions_total", lab(endpoint="none", policy="prefix", reason="load"))] == 1
    assert s[("prefixroute_decision_duration_seconds_count", ())] == len(DECISIONS)
    assert s[("prefixroute_decision_duration_seconds_sum", ())] == pytest.approx(sum(us for _, us in DECISIONS) / 1e6)
    assert s[("prefixroute_decision_duration_seconds_bucket", lab(le="0.0001"))] == 3
    assert s[("prefixroute_requests_total", lab(endpoint=A, status_class="2xx"))] == 2
    assert s[("prefixroute_requests_total", lab(endpoint=A, status_class="reset"))] == 1
    assert s[("prefixroute_requests_total", lab(endpoint=B, status_class="5xx"))] == 1
    for ep in (A, B):
        mine = [r for r in REQUESTS if r[0] == ep and r[3] is not None]
        assert s[("prefixroute_prompt_tokens_total", lab(endpoint=ep))] == sum(r[3] for r in mine)
        assert s[("prefixroute_actual_hit_tokens_total", lab(endpoint=ep))] == sum(r[4] for r in mine)
        assert s[("prefixroute_predicted_hit_tokens_total", lab(endpoint=ep))] == pytest.approx(
            sum(r[3] * r[5] for r in mine))
        ttfts = [r[2] for r in REQUESTS if r[0] == ep and r[2] is not None]
        assert s[("prefixroute_ttft_seconds_count", lab(endpoint=ep))] == len(ttfts)
        assert s[("prefixroute_ttft_seconds_sum", lab(endpoint=ep))] == pytest.approx(sum(ttfts) / 1000)
    assert s[("prefixroute_ttft_seconds_bucket", lab(endpoint=B, le="0.5"))] == 0
    assert s[("prefixroute_endpoint_in_flight", lab(endpoint=A))] == 3
    assert s[("prefixroute_prefix_index_blocks", ())] == 1234
    assert s[("prefixroute_telemetry_spans_dropped_total", lab(reason="queue_full"))] == 4
    assert s[("prefixroute_telemetry_spans_dropped_total", lab(reason="retry_buffer_full"))] == 3
    assert s[("prefixroute_telemetry_spans_dropped_total", lab(reason="rejected"))] == 0
    assert s[("prefixroute_telemetry_spans_exported_total", ())] == 93
    assert s[("prefixroute_telemetry_spans_pending", ())] == 12
    assert s[("prefixroute_telemetry_retry_buffer_bytes", ())] == 4096
    # 4xx refusals have their own class, never lumped with 5xx / reset (the errors).
    assert not any(name == "prefixroute_requests_total" and dict(lb).get("status_class") == "4xx" for name, lb in s)


def test_endpoint_pool_snapshot_becomes_per_endpoint_gauges():
    """The dashboard's live columns come from here (the router's pool), not from URLs in span data."""
    import time as _time

    from prefixroute.types import EndpointState

    states = (EndpointState(A, healthy=True, num_requests_running=5, num_requests_waiting=2, kv_cache_usage_ratio=0.75,
                            scraped_at_s=_time.monotonic() - 1.0),
              EndpointState(B, healthy=False))  # down, never scraped: only its health is known
    s = scrape(RouterMetrics(endpoint_states=lambda: states))
    lab = lambda **kw: tuple(sorted(kw.items()))  # noqa: E731
    assert s[("prefixroute_endpoint_healthy", lab(endpoint=A))] == 1
    assert s[("prefixroute_endpoint_healthy", lab(endpoint=B))] == 0
    assert s[("prefixroute_endpoint_requests_running", lab(endpoint=A))] == 5
    assert s[("prefixroute_endpoint_requests_waiting", lab(endpoint=A))] == 2
    assert s[("prefixroute_endpoint_kv_cache_usage_ratio", lab(endpoint=A))] == 0.75
    assert 0.9 < s[("prefixroute_endpoint_scrape_age_seconds", lab(endpoint=A))] < 30
    assert ("prefixroute_endpoint_requests_running", lab(endpoint=B)) not in s
    assert ("prefixroute_endpoint_kv_cache_usage_ratio", lab(endpoint=B)) not in s


def test_index_size_per_endpoint_and_no_callbacks():
    s = scrape(RouterMetrics(index_size=lambda: {A: 5, B: 9}))
    assert s[("prefixroute_prefix_index_blocks", (("endpoint", B),))] == 9
    assert not any(name == "prefixroute_endpoint_in_flight" for name, _ in s)
