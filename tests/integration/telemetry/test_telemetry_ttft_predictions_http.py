"""TTFT predictions over the receiver's HTTP API and the router's /metrics, on loopback (the rest:
tests/unit/telemetry/test_telemetry_ttft_predictions.py)."""

from __future__ import annotations

import pytest
from prefixroute.telemetry.client import HttpStoreClient
from prefixroute.telemetry.http_api import start_http_api
from prefixroute.telemetry.metrics import RouterMetrics
from helpers.metrics import scrape
from unit.telemetry.test_telemetry_ttft_predictions import EPS, NOW, pred_store, rec

pytestmark = pytest.mark.integration  # loopback servers or child processes: not a unit test


def test_ttft_predictions_over_the_http_api_equal_the_reader(pred_store):
    recs, reader, path = pred_store
    server = start_http_api(str(path), "127.0.0.1", 0)
    try:
        client = HttpStoreClient(f"http://127.0.0.1:{server.server_address[1]}")
        assert client.ttft_predictions(300, now=NOW) == reader.ttft_predictions(300, now=NOW)
        dumped = list(client.iter_requests(600, now=NOW))
    finally:
        server.shutdown()
        server.server_close()
    assert sorted(d["predicted_ttft_ms"] or -1 for d in dumped) == sorted(r.predicted_ttft_ms or -1 for r in recs)


def test_prediction_error_metrics_score_only_comparable_requests():
    m = RouterMetrics()
    scored = [rec(0, ttft_ms=150.0, predicted_ttft_ms=100.0),  # +0.5
              rec(1, ttft_ms=50.0, predicted_ttft_ms=100.0),  # -0.5
              rec(2, ttft_ms=300.0, predicted_ttft_ms=100.0),  # +2.0
              rec(3, endpoint=EPS[1], endpoints=(EPS[1],), ttft_ms=40.0, predicted_ttft_ms=0.2)]  # floored: +39
    not_scored = [rec(10, predicted_ttft_ms=None), rec(11, status=503, error="upstream"),
                  rec(12, status=200, error="response incomplete"), rec(13, status=429, error="slow down"),
                  rec(14, endpoint=EPS[1]), rec(15, ttft_ms=None), rec(16, status=0, error="reset")]
    for r in scored + not_scored:
        m.observe_response(r)
    s = scrape(m)
    a, b = (("endpoint", EPS[0]),), (("endpoint", EPS[1]),)
    name = "prefixroute_ttft_prediction_error_ratio"
    assert s[(f"{name}_count", a)] == 3 and s[(f"{name}_count", b)] == 1
    # Prometheus exposes no _sum for a histogram with negative buckets: the bias comes from the two counters.
    assert (f"{name}_sum", a) not in s
    le = lambda v: tuple(sorted({"endpoint": EPS[0], "le": v}.items()))  # noqa: E731
    assert s[(f"{name}_bucket", le("-0.5"))] == 1  # -0.5 lands in le=-0.5
    assert s[(f"{name}_bucket", le("0.5"))] == 2
    assert s[(f"{name}_bucket", le("1.0"))] == 2 and s[(f"{name}_bucket", le("2.0"))] == 3
    leb = lambda v: tuple(sorted({"endpoint": EPS[1], "le": v}.items()))  # noqa: E731
    assert s[(f"{name}_bucket", leb("9.0"))] == 0 and s[(f"{name}_bucket", leb("+Inf"))] == 1  # (40 - 0.2) / 1 ms
    assert s[("prefixroute_predicted_ttft_seconds_total", a)] == pytest.approx(0.3)
    assert s[("prefixroute_compared_ttft_seconds_total", a)] == pytest.approx(0.5)
    # Every finished request still counts in the ordinary families.
    assert sum(v for (n, _), v in s.items() if n == "prefixroute_requests_total") == len(scored + not_scored)
