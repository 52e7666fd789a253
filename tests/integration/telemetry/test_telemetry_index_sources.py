"""The router's /metrics per endpoint: the index source in use and the KV-event subscriber's figures, as
Prometheus text, and the dashboard's reading of them (the endpoint table's *index* column)."""

from __future__ import annotations

import pytest

from helpers.metrics import scrape, scrape_text
from prefixroute.dashboard import data as D
from prefixroute.dashboard import router_metrics as RM
from prefixroute.telemetry.metrics import RouterMetrics

pytestmark = pytest.mark.integration

INFO = {
    "10.0.0.1:8000": {"source": "events", "connected": True, "last_seq": 41, "num_batches": 42, "num_events": 90,
                      "num_gaps": 1, "num_replays": 1, "num_clears": 0, "num_decode_errors": 0, "blocks": 2400},
    "10.0.0.2:8000": {"source": "events", "connected": False, "last_seq": None, "num_batches": 0, "num_events": 0,
                      "num_gaps": 0, "num_replays": 0, "num_clears": 2, "num_decode_errors": 0, "blocks": 0},
    "10.0.0.3:8000": {"source": "feedback"},
}


def test_index_families():
    got = scrape(RouterMetrics(index_info=lambda: INFO))
    assert got[("prefixroute_index_source_info", (("endpoint", "10.0.0.1:8000"), ("source", "events")))] == 1
    assert got[("prefixroute_index_source_info", (("endpoint", "10.0.0.3:8000"), ("source", "feedback")))] == 1
    ep1 = (("endpoint", "10.0.0.1:8000"),)
    assert got[("prefixroute_kv_events_connected", ep1)] == 1
    assert got[("prefixroute_kv_events_connected", (("endpoint", "10.0.0.2:8000"),))] == 0
    assert got[("prefixroute_kv_events_batches_total", ep1)] == 42
    assert got[("prefixroute_kv_events_gaps_total", ep1)] == 1
    assert got[("prefixroute_kv_event_index_blocks", ep1)] == 2400
    assert got[("prefixroute_kv_events_index_clears_total", (("endpoint", "10.0.0.2:8000"),))] == 2
    # A figure not known (no sequence yet) is absent, not 0; an endpoint without events has none.
    assert ("prefixroute_kv_events_last_sequence", (("endpoint", "10.0.0.2:8000"),)) not in got
    assert not any(k[0].startswith("prefixroute_kv_events") and ("endpoint", "10.0.0.3:8000") in k[1] for k in got)


def test_dashboard_reads_the_source_and_marks_a_disconnected_subscriber():
    text = scrape_text(RouterMetrics(index_info=lambda: INFO))
    live = RM.parse_router_metrics(text)
    assert live["10.0.0.1:8000"].index_source == "events" and live["10.0.0.1:8000"].kv_events_connected is True
    assert live["10.0.0.2:8000"].kv_events_connected is False
    assert live["10.0.0.3:8000"].index_source == "feedback" and live["10.0.0.3:8000"].kv_events_connected is None
    rows = [{"endpoint": ep, "num_requests": 1} for ep in INFO]
    frame = D.endpoint_frame(rows, live=live)
    assert list(frame["index_source"]) == ["events", "events (down)", "feedback"]
