"""Pure data logic of the dashboard (no Streamlit): reshaping, colours, balance, states, bench files."""

from __future__ import annotations

import json
import math
import os

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixroute.dashboard import bench_results as BR
from prefixroute.dashboard import data as D
from prefixroute.dashboard import router_metrics as RM
from prefixroute.dashboard import tables as T


@pytest.mark.parametrize("window_s, expected", [
    (60, 2.0), (300, 10.0), (900, 30.0), (3600, 120.0), (21600, 600.0), (86400, 3600.0), (10, 1.0), (1, 1.0),
])
def test_bucket_for_window(window_s, expected):
    assert D.bucket_for_window(window_s) == expected


@given(st.floats(min_value=1.0, max_value=7 * 86400))
def test_bucket_for_window_bounds_the_number_of_buckets(window_s):
    b = D.bucket_for_window(window_s)
    assert b >= 1
    # At most the target, except past the largest nice width.
    assert window_s / b <= 40 or b == 3600


@pytest.mark.parametrize("window_s, first, now, expected", [
    (300, None, 1000.0, 300), (300, 990.0, 1000.0, 30), (300, 900.0, 1000.0, 100), (300, 100.0, 1000.0, 300),
])
def test_effective_span(window_s, first, now, expected):
    assert D.effective_span_s(window_s, first, now) == expected


@pytest.mark.parametrize("names, expected", [
    (["b:1", "a:1"], ["a:1", "b:1"]),
    (["10.0.0.10:8000", "10.0.0.9:8000", "10.0.0.2:8000"], ["10.0.0.2:8000", "10.0.0.9:8000", "10.0.0.10:8000"]),
    (["h:80", None, "h:80", ""], ["h:80", D.UNKNOWN_ENDPOINT]),
    ([], []),
])
def test_sort_endpoints_naturally(names, expected):
    assert D.sort_endpoints(names) == expected


@given(st.lists(st.from_regex(r"[a-z]{1,6}:[0-9]{2,5}", fullmatch=True), min_size=1, max_size=20, unique=True))
def test_colours_depend_only_on_the_set_of_names(names):
    a = D.endpoint_colors(names)
    b = D.endpoint_colors(list(reversed(names)) + names[:1])
    assert a == b
    assert set(a) == set(names)
    # Distinct while the palette lasts.
    assert len(set(a.values())) == min(len(names), len(D.PALETTE))


@pytest.mark.parametrize("shares, expected", [
    ({"a": 10, "b": 10}, 1.0),
    ({"a": 30, "b": 10}, 1.5),
    ({"a": 40, "b": 0, "c": 0, "d": 0}, 4.0),
    ([0.5, 0.25, 0.25], 1.5),
    ({"a": 0, "b": 0}, None),
    ({}, None),
])
def test_balance_ratio(shares, expected):
    got = D.balance_ratio(shares)
    assert got == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.parametrize("ratio, verdict", [(None, "no data"), (1.0, "even"), (1.2, "even"), (1.4, "uneven"),
                                            (1.5, "uneven"), (1.51, "skewed"), (4.0, "skewed")])
def test_balance_verdict(ratio, verdict):
    assert D.balance_verdict(ratio) == verdict


@pytest.mark.parametrize("summary, total, kind", [
    ({"num_requests": 0}, 0, "empty"),
    (None, 0, "empty"),
    ({"num_requests": 0}, 12, "idle"),
    ({"num_requests": 5}, 12, "live"),
    ({"num_requests": 5}, 0, "live"),  # a store API without a total still shows the window's data
])
def test_traffic_state(summary, total, kind):
    assert D.traffic_state(summary, total).kind == kind


TS = [
    {"bucket_start": 100.0, "num_requests": 4, "num_errors": 1, "requests_per_s": 0.4, "actual_hit_ratio": 0.5,
     "predicted_hit_ratio": 0.6, "ttft_ms_p50": 10.0, "ttft_ms_p90": 20.0, "ttft_ms_p99": 30.0,
     "latency_ms_p50": 100.0, "latency_ms_p90": None, "latency_ms_p99": None},
    {"bucket_start": 110.0, "num_requests": 2, "num_errors": 0, "requests_per_s": 0.2, "actual_hit_ratio": None,
     "predicted_hit_ratio": None, "ttft_ms_p50": None, "ttft_ms_p90": None, "ttft_ms_p99": None,
     "latency_ms_p50": 50.0, "latency_ms_p90": 60.0, "latency_ms_p99": 70.0},
]


def test_fleet_hit_frame_is_long_and_drops_buckets_without_usage():
    f = D.fleet_hit_frame(TS)
    assert list(f["kind"]) == ["actual", "predicted"]
    assert list(f["hit_ratio"]) == [0.5, 0.6]
    assert f["time"].iloc[0] == pd.Timestamp(100, unit="s", tz="UTC")


def test_percentile_frame_skips_missing_values():
    f = D.percentile_frame(TS, "latency_ms")
    assert list(zip(f["bucket_start"], f["percentile"], f["value_ms"])) == [
        (100.0, "p50", 100.0), (110.0, "p50", 50.0), (110.0, "p90", 60.0), (110.0, "p99", 70.0)]


def test_rate_and_error_frames():
    rows = [dict(TS[0], endpoint="a:1"), dict(TS[1], endpoint=None)]
    f = D.rate_frame(rows)
    assert list(f["endpoint"]) == ["a:1", D.UNKNOWN_ENDPOINT]
    assert list(f["errors_per_s"]) == [pytest.approx(0.1), 0.0]
    e = D.error_frame(TS, bucket_s=10.0)
    assert list(e["errors_per_s"]) == [0.1]


def test_empty_inputs_give_empty_frames_with_columns():
    for frame in (D.fleet_hit_frame([]), D.endpoint_hit_frame([]), D.percentile_frame([]), D.rate_frame([]),
                  D.histogram_frame([]), D.reasons_frame([]), D.recent_frame([])):
        assert len(frame) == 0 and len(frame.columns) > 0


def test_endpoint_frame_merges_live_figures_and_sorts():
    rows = [{"endpoint": "h:10", "num_requests": 3, "share_ratio": 0.75, "actual_hit_ratio": 0.5},
            {"endpoint": "h:9", "num_requests": 1, "share_ratio": 0.25, "actual_hit_ratio": None}]
    f = D.endpoint_frame(rows, mean_in_flight={"h:9": 0.5},
                         live={"h:10": RM.EndpointLive(kv_cache_usage_ratio=0.3, num_requests_running=2)})
    assert list(f["endpoint"]) == ["h:9", "h:10"]
    assert f["mean_in_flight"].iloc[0] == 0.5 and math.isnan(f["mean_in_flight"].iloc[1])
    assert f["kv_cache_usage_ratio"].iloc[1] == 0.3 and math.isnan(f["kv_cache_usage_ratio"].iloc[0])
    assert f["running"].iloc[1] == 2
    assert f["actual_hit_ratio"].dtype == "float64"


def test_shares_leave_unrouted_requests_out_and_count_idle_endpoints_of_the_fleet():
    rows = [{"endpoint": "h:10", "num_requests": 6}, {"endpoint": "h:9", "num_requests": 2},
            {"endpoint": None, "num_requests": 100, "num_refused": 70, "num_errors": 30}]
    s = D.endpoint_shares(rows)
    assert s.endpoints == ("h:9", "h:10") and s.num_routed == 8 and s.num_unrouted == 100
    assert (s.num_unrouted_refused, s.num_unrouted_errors) == (70, 30)
    assert s.fair_share_ratio == 0.5 and s.balance_ratio == pytest.approx(6 / 8 * 2)
    assert s.share_ratio("h:10") == 0.75
    # An endpoint the router reports that served nothing is part of the fleet: fair share 1/3, not 1/2.
    s = D.endpoint_shares(rows, live={"h:11": RM.EndpointLive(healthy=True)})
    assert s.endpoints == ("h:9", "h:10", "h:11") and s.fair_share_ratio == pytest.approx(1 / 3)
    assert s.balance_ratio == pytest.approx(6 / 8 * 3)
    assert D.endpoint_shares([{"endpoint": None, "num_requests": 3}]).balance_ratio is None
    assert D.format_balance(s.balance_ratio) == "2.25×" and D.format_balance(None) == "–"


def test_endpoint_frame_has_a_row_per_fleet_endpoint_and_none_for_the_unrouted():
    rows = [{"endpoint": "a:1", "num_requests": 3, "share_ratio": 0.3}, {"endpoint": None, "num_requests": 7}]
    f = D.endpoint_frame(rows, live={"b:2": RM.EndpointLive(kv_cache_usage_ratio=500 / 70_000)})
    assert list(f["endpoint"]) == ["a:1", "b:2"] and D.UNKNOWN_ENDPOINT not in set(f["endpoint"])
    assert list(f["num_requests"]) == [3, 0]
    assert list(f["share_ratio"]) == [1.0, 0.0]  # of the routed requests, not of all ten
    assert list(T.endpoint_table(f).columns[:3]) == ["endpoint", "requests", "share"]
    table = T.endpoint_table(f, T.LIVE_TABLE_COLUMNS)
    assert table["KV usage"].iloc[1] == "0.7\u00a0%"  # 500 blocks of 70,000: not "0 %"
    assert table["KV usage"].iloc[0] == "–" and "running" not in table.columns  # a column with no value: left out
    assert list(T.endpoint_table(D.endpoint_frame(rows), T.LIVE_TABLE_COLUMNS).columns) == ["endpoint"]


def test_live_table_shows_each_endpoints_conversations_and_prefill_load():
    """The router's conversation metrics (routing/conversations.py) read into the live table beside running
    sequences and KV usage: what the conversation-load term balances."""
    from prefixroute.extproc.routing.conversations import ConversationsCollector, ConversationTable
    from prometheus_client import CollectorRegistry, generate_latest

    table = ConversationTable(100, 10)
    for i, ep in enumerate(["a:1", "a:1", "b:2"]):
        hashes = [10 * i + 1, 10 * i + 2, 10 * i + 3]
        table.record(hashes, table.outlook(hashes, 0), ep, 100.0, 0.0)
    reg = CollectorRegistry()
    reg.register(ConversationsCollector(table, lambda: {"a:1": 0.42, "b:2": 0.05}))
    live = RM.parse_router_metrics(generate_latest(reg).decode())
    assert live["a:1"].num_conversations == 2 and live["b:2"].prefill_utilization_ratio == pytest.approx(0.05)
    f = D.endpoint_frame([{"endpoint": "a:1", "num_requests": 3}], live=live)
    shown = T.endpoint_table(f, T.LIVE_TABLE_COLUMNS)
    assert list(shown["conversations"]) == ["2", "1"]
    assert list(shown["prefill load"]) == ["42.0\u00a0%", "5.0\u00a0%"]


def test_unrouted_sentence_says_what_they_were():
    s = D.endpoint_shares([{"endpoint": "a", "num_requests": 90},
                           {"endpoint": None, "num_requests": 10, "num_refused": 7, "num_errors": 3}])
    text = D.unrouted_sentence(s, 100)
    assert text.startswith("**Unrouted: 10 requests** (10.0 % of the window)")
    assert "7 refused by the router" in text and "3 failed before an endpoint answered" in text


def test_segments_break_lines_where_a_series_skips_buckets():
    ts = [{"bucket_start": b, "actual_hit_ratio": 0.5, "predicted_hit_ratio": None} for b in (0, 5, 10, 30, 35)]
    f = D.fleet_hit_frame(ts, bucket_s=5.0)
    assert list(f["segment"]) == [0, 0, 0, 1, 1]  # 10 -> 30: a gap (a restart between two runs)
    rows = [{"bucket_start": b, "endpoint": ep, "actual_hit_ratio": 0.1, "predicted_hit_ratio": 0.2}
            for ep, bs in (("a", (0, 5, 20)), ("b", (0, 10))) for b in bs]
    f = D.endpoint_hit_frame(rows, bucket_s=5.0)
    got = {(r.endpoint, r.kind, r.bucket_start): r.segment for r in f.itertuples()}
    assert got[("a", "actual", 5)] == 0 and got[("a", "actual", 20)] == 1 and got[("a", "predicted", 20)] == 1
    assert got[("b", "actual", 10)] == 1 and got[("b", "predicted", 0)] == 0
    assert set(D.percentile_frame([], bucket_s=5.0).columns) >= {"segment", "time"}


def test_recent_frame_computes_each_request_hit_ratio():
    rows = [{"trace_id": "t1", "start_time": 5.0, "endpoint": "a", "prompt_tokens": 200, "cached_tokens": 150},
            {"trace_id": "t2", "start_time": 4.0, "endpoint": None, "prompt_tokens": None, "cached_tokens": None}]
    f = D.recent_frame(rows)
    assert f["hit_ratio"].iloc[0] == 0.75 and pd.isna(f["hit_ratio"].iloc[1])
    assert list(f["endpoint"]) == ["a", D.UNKNOWN_ENDPOINT]


@pytest.mark.parametrize("fn, value, text", [
    (T.format_ratio, None, "–"), (T.format_ratio, 0.8234, "82.3 %"), (T.format_ratio, 1.0, "100.0 %"),
    (T.format_ms, 3.14159, "3.1 ms"), (T.format_ms, 1234.5, "1,234 ms"), (T.format_ms, None, "–"),
    (T.format_us, 250.0, "250 µs"), (T.format_us, 2500.0, "2.50 ms"), (T.format_us, None, "–"),
])
def test_formatting(fn, value, text):
    assert fn(value) == text


def test_parse_router_metrics_from_the_router_own_metrics():
    """The live columns come from the router's /metrics (its pool snapshot gauges), rendered by the real
    RouterMetrics; other families (e.g. the router's decisions, labelled by endpoint too) are ignored."""
    from prometheus_client import generate_latest

    from prefixroute.types import Decision, EndpointState
    from prefixroute.telemetry.metrics import RouterMetrics

    states = (EndpointState("10.0.0.1:8000", healthy=True, num_requests_running=3, num_requests_waiting=1,
                            kv_cache_usage_ratio=0.42),
              EndpointState('odd"name\\:1', healthy=False))
    m = RouterMetrics(endpoint_states=lambda: states, in_flight=lambda: {"10.0.0.9:1": 5})
    m.observe_decision(Decision(("10.0.0.7:1",), "cold", "prefix"), 10.0)
    live = RM.parse_router_metrics(generate_latest(m.registry).decode())
    assert live == {"10.0.0.1:8000": RM.EndpointLive(kv_cache_usage_ratio=0.42, num_requests_running=3.0,
                                                    num_requests_waiting=1.0, healthy=True),
                    'odd"name\\:1': RM.EndpointLive(healthy=False)}


@pytest.mark.parametrize("text, expected", [
    ("", {}),
    ("vllm:kv_cache_usage_perc 0.5\n", {}),  # a model server's names are not the router's
    ('prefixroute_endpoint_kv_cache_usage_ratio{endpoint="a:1"} NaN\n', {}),
    ('prefixroute_endpoint_healthy{endpoint="a:1"} 1\nthis is { not prometheus\n',
     {"a:1": RM.EndpointLive(healthy=True)}),
])
def test_parse_router_metrics_edge_cases(text, expected):
    assert RM.parse_router_metrics(text) == expected


BENCH = {"workload": {"name": "shared-prompts", "num_requests": 300}, "upper_bound_hit_ratio": 0.9,
         "runs": [{"router": "prefixroute:random", "requests": 300, "errors": 0, "hit_ratio": 0.3,
                   "ttft_ms": {"p50": 800.0, "p90": 1500.0, "p99": 2000.0}, "e2e_ms": {"p50": 900.0},
                   "throughput_rps": 7.5, "endpoint_share": {"a": 0.25, "b": 0.25, "c": 0.25, "d": 0.25}},
                  {"router": "prefixroute:prefix", "requests": 300, "errors": 1, "hit_ratio": 0.85,
                   "ttft_ms": {"p50": 100.0, "p90": 300.0, "p99": 600.0}, "e2e_ms": {"p50": 200.0},
                   "throughput_rps": 7.9, "endpoint_share": {"a": 0.4, "b": 0.2, "c": 0.2, "d": 0.2}}]}


def test_bench_results_found_newest_first_and_parsed(tmp_path):
    old = tmp_path / "run-old" / "results.json"
    new = tmp_path / "deep" / "run-new" / "results.json"
    too_deep = tmp_path / "a" / "b" / "c" / "d" / "results.json"
    for i, p in enumerate((old, new, too_deep)):
        p.parent.mkdir(parents=True)
        p.write_text(json.dumps(BENCH))
        os.utime(p, (1000 + i, 1000 + i))
    assert BR.find_bench_results(tmp_path) == [str(new), str(old)]
    assert BR.find_bench_results(tmp_path / "missing") == []
    res = BR.load_bench_result(str(new))
    assert res.upper_bound_hit_ratio == 0.9 and res.label == "run-new · shared-prompts"
    f = BR.bench_frame(res)
    assert list(f["router"]) == ["prefixroute:random", "prefixroute:prefix"]
    assert list(f["ttft_ms_p50"]) == [800.0, 100.0]
    assert f["balance_ratio"].tolist() == [pytest.approx(1.0), pytest.approx(1.6)]
    long = BR.bench_ttft_long(f)
    assert len(long) == 6 and set(long["percentile"]) == {"p50", "p90", "p99"}


@pytest.mark.parametrize("content, message", [("{not json", "not JSON"), ('{"runs": 3}', "no \"runs\" list"),
                                              ("[]", "no \"runs\" list")])
def test_bad_bench_files_are_rejected_with_a_reason(tmp_path, content, message):
    p = tmp_path / "results.json"
    p.write_text(content)
    with pytest.raises(ValueError, match=message):
        BR.load_bench_result(str(p))


@pytest.mark.parametrize("refresh_s, window_s, expected", [
    (2.0, 60, 2.0), (2.0, 300, 2.0), (2.0, 900, 3.0), (2.0, 3600, 12.0), (2.0, 86400, 288.0), (5.0, 900, 5.0),
])
def test_refresh_slows_for_long_windows(refresh_s, window_s, expected):
    assert D.refresh_for_window(refresh_s, window_s) == expected


def test_the_index_column_shows_why_an_events_endpoint_is_not_matched_by_its_events():
    """The router's /metrics (real RouterMetrics, the KV-events link's info) -> the endpoint table's index
    column: ``events`` while its events are used, ``events (STATE)`` while it is matched by feedback instead."""
    from prometheus_client import generate_latest

    from prefixroute.telemetry.metrics import RouterMetrics

    info = {"a:1": {"source": "events", "events_state": "live", "connected": True},
            "b:1": {"source": "feedback", "events_state": "undecodable", "connected": True},
            "c:1": {"source": "feedback", "events_state": "block_size_mismatch", "connected": True},
            "d:1": {"source": "feedback", "events_state": "down", "connected": False},
            "e:1": {"source": "feedback"}}  # publishes no events
    m = RouterMetrics(index_info=lambda: info)
    live = RM.parse_router_metrics(generate_latest(m.registry).decode())
    rows = [{"endpoint": ep, "num_requests": 1} for ep in info]
    frame = D.endpoint_frame(rows, live=live)
    assert dict(zip(frame["endpoint"], frame["index_source"])) == {
        "a:1": "events", "b:1": "events (undecodable)", "c:1": "events (block size mismatch)",
        "d:1": "events (down)", "e:1": "feedback"}


def test_the_bucket_still_filling_is_left_out_of_the_hit_rate_lines():
    """The newest bucket, a few seconds old, held one cold request per endpoint and drew a 0% hit rate."""
    rows = [{"bucket_start": 100.0, "endpoint": "a", "actual_hit_ratio": 0.8, "predicted_hit_ratio": 0.7},
            {"bucket_start": 110.0, "endpoint": "a", "actual_hit_ratio": 0.0, "predicted_hit_ratio": 0.0}]
    assert D.complete_buckets(rows, 10.0, now=115.0) == rows[:1]
    assert D.complete_buckets(rows, 10.0, now=120.0) == rows  # complete: kept
    assert D.complete_buckets(rows[1:], 10.0, now=115.0) == rows[1:]  # the only bucket: kept
    frame = D.endpoint_hit_frame(D.complete_buckets(rows, 10.0, now=115.0), 10.0)
    assert list(frame["hit_ratio"]) == [0.8, 0.7]


def test_requests_without_a_decision_are_named_so():
    frame = D.reasons_frame([{"reason": None, "num_requests": 3, "share_ratio": 0.375},
                              {"reason": "affinity", "num_requests": 5, "share_ratio": 0.625}])
    assert set(frame["reason"]) == {"none", "affinity"}
