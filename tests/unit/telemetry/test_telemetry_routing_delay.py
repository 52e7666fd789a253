"""The routing delay by Envoy's clock (issue 26): the facts record's DS_RX_END -> US_TX_BEG reaches the request's
record, its span and the store (a v6 file gains the column in place), the summary's percentiles, the histogram
query and the router's /metrics, held requests left out of the metric."""

from __future__ import annotations

import sqlite3

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from helpers.facts_records import record
from prefixroute.extproc.envoy_facts import facts_of
from prefixroute.extproc.facts_fields import A_ROUTING_US, FACTS_ATTRIBUTES
from prefixroute.telemetry.http_api import query
from prefixroute.telemetry.metrics import RouterMetrics
from prefixroute.telemetry.record_spans import record_attributes
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.store import TelemetryStore
from prefixroute.telemetry.store_reader import StoreReader
from prefixroute.telemetry.store_schema import SCHEMA_VERSION

NOW = 1_800_000_000.0
TP = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"


def rec(i: int, **kw) -> RequestRecord:
    base = dict(trace_id=f"{i + 1:032x}", span_id=f"{i + 1:016x}", start_time=NOW - 10 + i, endpoint="e:1",
                endpoints=("e:1",), status=200, ttft_ms=10.0, latency_ms=20.0)
    base.update(kw)
    return RequestRecord(**base)


def test_envoy_measures_from_the_requests_end_to_the_upstream_start():
    assert FACTS_ATTRIBUTES[A_ROUTING_US] == "%COMMON_DURATION(DS_RX_END:US_TX_BEG:us)%"
    assert facts_of(record(TP, routing_us="1234")).routing_ms == 1.234
    # "-": no figure (Envoy did not wait to route, or no upstream); a negative figure is not a delay
    assert facts_of(record(TP, routing_us="-")).routing_ms is None
    assert facts_of(record(TP, routing_us="-40")).routing_ms is None


def test_the_span_carries_it_and_the_store_keeps_it():
    attrs = record_attributes(rec(0, routing_ms=0.85))
    assert attrs["prefixroute.routing_ms"] == 0.85
    assert "prefixroute.routing_ms" not in record_attributes(rec(1))  # no figure: no attribute


def test_a_v6_file_gains_the_column_and_the_queries_read_it(tmp_path):
    path = tmp_path / "v6.db"
    store = TelemetryStore(path)
    store.insert_records([rec(0)])
    store.close()
    conn = sqlite3.connect(path)  # make it a version-6 file: no routing_ms
    conn.executescript("ALTER TABLE requests DROP COLUMN routing_ms; "
                       "UPDATE meta SET value = '6' WHERE key = 'schema_version';")
    conn.close()
    reader = StoreReader(path)
    (old,) = reader.recent_requests(5)  # not upgraded yet: NULL, and the summary still answers
    assert old["routing_ms"] is None
    summary = reader.summary(60, now=NOW)
    assert summary["num_requests"] == 1 and summary["routing_ms_p50"] is None
    store = TelemetryStore(path)
    store.insert_records([rec(i, routing_ms=ms) for i, ms in ((1, 0.5), (2, 1.0), (3, 1.5), (4, None))])
    store.close()
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    conn.close()
    summary = query(reader, "/api/summary", {"window_s": ["60"], "now": [str(NOW)]})
    assert summary["num_requests"] == 5 and summary["routing_ms_p50"] == 1.0
    assert summary["routing_ms_p99"] >= summary["routing_ms_p90"] >= summary["routing_ms_p50"]
    hist = query(reader, "/api/histogram", {"column": ["routing_ms"], "window_s": ["60"], "now": [str(NOW)],
                                            "bin_width": ["1"]})
    assert sum(h["num_requests"] for h in hist) == 3  # the rows with a figure
    assert query(reader, "/api/request", {"trace_id": [rec(2).trace_id]})["routing_ms"] == 1.0
    reader.close()


def test_the_metric_counts_routed_requests_and_leaves_held_ones_to_the_queue():
    m = RouterMetrics()
    m.observe_response(rec(0, routing_ms=0.6))
    m.observe_response(rec(1, routing_ms=3.0))
    m.observe_response(rec(2, routing_ms=900.0, gateway_wait_ms=899.0, gateway_outcome="released:first_token"))
    m.observe_response(rec(3))  # no figure
    text = generate_latest(m.registry).decode()
    (fam,) = [f for f in text_string_to_metric_families(text) if f.name == "prefixroute_routing_delay_seconds"]
    samples = {(s.name, s.labels.get("le")): s.value for s in fam.samples}
    assert samples[("prefixroute_routing_delay_seconds_count", None)] == 2
    assert abs(samples[("prefixroute_routing_delay_seconds_sum", None)] - 0.0036) < 1e-9
    assert samples[("prefixroute_routing_delay_seconds_bucket", "0.001")] == 1
    assert samples[("prefixroute_routing_delay_seconds_bucket", "+Inf")] == 2
