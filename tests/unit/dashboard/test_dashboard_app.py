"""The Streamlit app under AppTest against real SQLite stores in tmp_path: the figures it shows, the
empty / idle / missing states and recovery, drill-down, and the benchmarks page. (Where it talks over HTTP:
tests/integration/dashboard/test_dashboard_app_http.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from helpers.dashboard import (ENDPOINTS, app_records as make_records, endpoint_table, metric, run_app, shown,
                               texts, write)
from prefixroute.telemetry.store import TelemetryStore

pytestmark = pytest.mark.usefixtures("dashboard_env")  # conftest.py


def test_live_page_shows_the_store_figures(tmp_path, monkeypatch):
    db = tmp_path / "t.db"
    records = make_records(400)
    write(db, records)
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_DB", str(db))
    at = run_app()
    assert not at.exception
    # Independent figures from the records themselves.
    hit = sum(r.cached_tokens for r in records) / sum(r.prompt_tokens for r in records)
    pred = sum(r.predicted_hit_ratio * r.prompt_tokens for r in records) / sum(r.prompt_tokens for r in records)
    assert metric(at, "Hit rate (actual)") == f"{hit * 100:.1f} %"
    assert metric(at, "Hit rate (predicted)") == f"{pred * 100:.1f} %"
    errors = sum(r.status >= 500 for r in records)
    assert metric(at, "Errors") == f"{errors / len(records) * 100:.1f} %"
    counts = {ep: sum(r.endpoint == ep for r in records) for ep in ENDPOINTS}
    assert metric(at, "Balance") == f"{max(counts.values()) / len(records) * 3:.2f}×"
    assert f"{len(records):,} requests" in texts(at)
    # Ten charts, one endpoint table.
    assert len(at.get("arrow_vega_lite_chart")) + len(at.get("vega_lite_chart")) >= 10
    table = endpoint_table(at)
    order = ["10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.10:8000"]
    assert list(table.index) == order  # natural order
    assert list(table["requests"]) == [f"{counts[ep]:,}" for ep in order]
    for ep in order:
        mine = [r for r in records if r.endpoint == ep]
        hit_ep = sum(r.cached_tokens for r in mine) / sum(r.prompt_tokens for r in mine)
        assert table.loc[ep, "hit"] == shown(f"{hit_ep * 100:.1f} %")
        assert table.loc[ep, "share"] == shown(f"{len(mine) / len(records) * 100:.1f} %")


def test_empty_store_says_no_traffic_and_how_to_send_some(tmp_path, monkeypatch):
    db = tmp_path / "t.db"
    TelemetryStore(db).close()
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_DB", str(db))
    at = run_app()
    assert not at.exception
    assert "No traffic yet" in texts(at)
    assert "prefixroute up --traffic" in texts(at) and "curl" in texts(at)
    assert not at.metric


def test_idle_window_says_so_with_the_store_total(tmp_path, monkeypatch):
    db = tmp_path / "t.db"
    write(db, make_records(7, age_s=(2000, 3000)))  # older than the 5 min window
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_DB", str(db))
    at = run_app()
    assert "No requests in the last 5 min" in texts(at) and "7 requests" in texts(at)
    at.sidebar.selectbox(key="window").set_value("1 h").run()
    assert metric(at, "Hit rate (actual)").endswith("%")


def test_missing_store_is_explained_and_recovers(tmp_path, monkeypatch):
    db = tmp_path / "later.db"
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_DB", str(db))
    # Query results are shared for one refresh period; each rerun below comes a period later, like
    # the live refresh does.
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_REFRESH_S", "0.5")
    # The live period is the refresh slowed for the window (window / 300 s): wait a whole one per rerun.
    from prefixroute.dashboard.data import refresh_for_window

    period_s = refresh_for_window(0.5, 300.0) + 0.1
    at = run_app()
    assert not at.exception
    assert "Telemetry store not available" in texts(at)
    assert f"prefixroute telemetry --db {db}" in texts(at)
    write(db, make_records(20))
    time.sleep(period_s)  # on purpose: query results are shared for one period, as in the live refresh
    at.run()  # what the next live refresh does
    assert "Telemetry store not available" not in texts(at)
    assert metric(at, "Hit rate (actual)").endswith("%")
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    time.sleep(period_s)  # on purpose, as above
    at.run()
    assert "Telemetry store not available" in texts(at)


def test_requests_page_drills_down_to_a_trace(tmp_path, monkeypatch):
    db = tmp_path / "t.db"
    records = make_records(30)
    write(db, records)
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_DB", str(db))
    at = run_app()
    at.sidebar.radio(key="page").set_value("Requests").run()
    assert not at.exception
    table = at.dataframe[0].value
    newest = max(records, key=lambda r: r.start_time)
    assert table["trace_id"].iloc[0] == newest.trace_id and len(table) == 30
    at.text_input(key="trace_id").set_value(newest.trace_id).run()
    assert metric(at, "Endpoint") == newest.endpoint
    assert metric(at, "Cached / prompt tokens") == f"{newest.cached_tokens} / {newest.prompt_tokens}"
    assert len(at.json) == 2
    at.text_input(key="trace_id").set_value("f" * 32).run()
    assert "No request with trace id" in texts(at)


def test_benchmarks_page_with_and_without_results(tmp_path, monkeypatch):
    db = tmp_path / "t.db"
    TelemetryStore(db).close()
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_DB", str(db))
    at = run_app()
    at.sidebar.radio(key="page").set_value("Benchmarks").run()
    assert "No benchmark results" in texts(at) and "prefixroute bench" in texts(at)
    out = tmp_path / "bench" / "run1"
    out.mkdir(parents=True)
    (out / "results.json").write_text(json.dumps({
        "workload": {"name": "shared-prompts"}, "upper_bound_hit_ratio": 0.92,
        "runs": [{"router": "prefixroute:random", "hit_ratio": 0.31, "ttft_ms": {"p50": 900, "p90": 1500, "p99": 2100}},
                 {"router": "prefixroute:prefix", "hit_ratio": 0.88, "ttft_ms": {"p50": 120, "p90": 300, "p99": 700}},
                 {"router": "sglang-router:cache_aware", "hit_ratio": 0.8,
                  "ttft_ms": {"p50": 150, "p90": 420, "p99": 900}}]}))
    at.run()
    assert not at.exception
    frame = at.dataframe[0].value
    assert list(frame["router"]) == ["prefixroute:random", "prefixroute:prefix", "sglang-router:cache_aware"]
    assert list(frame["hit_ratio"]) == [0.31, 0.88, 0.8]
    assert len(at.get("arrow_vega_lite_chart")) + len(at.get("vega_lite_chart")) == 2
    # Load sweeps and foreign files beside it: no warning box each, one small line saying what is not charted.
    for i in range(3):
        sweep = tmp_path / "bench" / f"sweep{i}"
        sweep.mkdir()
        (sweep / "results.json").write_text(json.dumps({"kind": "sweep", "points": [], "routers": []}))
    (tmp_path / "bench" / "other").mkdir()
    (tmp_path / "bench" / "other" / "results.json").write_text("{}")
    at.run()
    assert not at.exception and not at.warning and not at.error
    assert [e.label for e in at.expander] == [
        "Not charted here: 3 load sweeps (their report.md has the tables), 1 not in the `prefixroute bench` format."]
    assert len(at.get("arrow_vega_lite_chart")) + len(at.get("vega_lite_chart")) == 2
    # A run of `prefixroute bench` without --out (the state folder's bench/) is listed too.
    mine = tmp_path / "state" / "bench" / "20261207-120000-shared-prompts"
    mine.mkdir(parents=True)
    (mine / "results.json").write_text(json.dumps({"workload": {"name": "shared-prompts"}, "runs": [
        {"router": "prefixroute:prefix", "hit_ratio": 0.5, "ttft_ms": {"p50": 1, "p90": 2, "p99": 3}}]}))
    at.run()
    assert not at.exception
    assert any("20261207-120000-shared-prompts" in o for o in at.selectbox[0].options)


def test_benchmarks_page_reads_the_committed_results_without_warnings(monkeypatch, tmp_path):
    """The project's own bench-results/ folder: every file is either charted or counted in one small line."""
    db = tmp_path / "t.db"
    TelemetryStore(db).close()
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_DB", str(db))
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_BENCH_DIR", str(Path(__file__).resolve().parents[3] / "bench-results"))
    at = run_app()
    at.sidebar.radio(key="page").set_value("Benchmarks").run()
    assert not at.exception and not at.warning and not at.error
    assert len(at.expander) <= 1 and "not in the `prefixroute bench` format" not in texts(at)
    assert len(at.get("arrow_vega_lite_chart")) + len(at.get("vega_lite_chart")) == 2


def test_refusals_are_shown_apart_from_errors(tmp_path, monkeypatch):
    """Finding 7: 24 % of requests refused with a 4xx (and their messages) showed as "Errors 24 %"."""
    db = tmp_path / "t.db"
    records = make_records(100)
    for i, r in enumerate(records):
        r.status = 200
        if i < 24:
            r.status, r.error = 404, "model 'x' does not exist"
        elif i < 26:
            r.status, r.error = 503, "HTTP 503"
    write(db, records)
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_DB", str(db))
    at = run_app()
    assert not at.exception
    assert metric(at, "Errors") == "2.0 %"
    assert metric(at, "Refused") == "24.0 %"


def test_unrouted_requests_are_shown_as_such_and_left_out_of_the_shares(tmp_path, monkeypatch):
    db = tmp_path / "t.db"
    records = make_records(120)
    for i, r in enumerate(records[:30]):  # refused by the router or failed before any endpoint: no endpoint
        r.endpoint, r.endpoints = None, ()
        r.status, r.error = (400, "invalid 'messages'") if i % 3 else (503, "no endpoint available")
    write(db, records)
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_DB", str(db))
    at = run_app()
    assert not at.exception
    routed = [r for r in records if r.endpoint]
    counts = {ep: sum(r.endpoint == ep for r in routed) for ep in ENDPOINTS}
    table = endpoint_table(at)
    assert sorted(table.index) == sorted(ENDPOINTS)  # no row for the unrouted
    for ep in ENDPOINTS:
        assert table.loc[ep, "share"] == shown(f"{counts[ep] / len(routed) * 100:.1f} %")
    balance = f"{max(counts.values()) / len(routed) * 3:.2f}×"  # fair share 1/3: the three endpoints
    assert metric(at, "Balance") == balance
    header = next(m.value for m in at.markdown if m.value.startswith("**Share of routed requests**"))
    assert f"balance {balance} " in header  # tile and header: the same figure
    note = next(m.value for m in at.markdown if m.value.startswith("**Unrouted: 30 requests**"))
    assert "20 refused by the router" in note and "10 failed before an endpoint answered" in note


def test_the_current_run_is_shown_by_default_and_earlier_runs_on_request(tmp_path, monkeypatch):
    db = tmp_path / "t.db"
    earlier = make_records(50, age_s=(150, 200), seed=1)
    current = make_records(20, age_s=(1, 60), seed=2)
    write(db, earlier, run_id="20250101-000000-aaaa")
    write(db, current, run_id="20250101-010000-bbbb")
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_DB", str(db))
    at = run_app()
    assert not at.exception
    assert "· 20 requests ·" in texts(at) and "Run 20250101-010000-bbbb (current)" in texts(at)
    run_box = at.sidebar.selectbox(key="run")
    assert run_box.options[0].startswith("Current (since ") and run_box.options[-1] == "All runs"
    assert run_box.options[1].endswith(" UTC · 50 req.")
    run_box.select("20250101-000000-aaaa").run()
    assert "· 50 requests ·" in texts(at) and "Run 20250101-000000-aaaa," in texts(at)
    at.sidebar.selectbox(key="run").select("all").run()
    assert "· 70 requests ·" in texts(at)
    at.sidebar.radio(key="page").set_value("Requests").run()
    assert len(at.dataframe[0].value) == 70
    at.sidebar.selectbox(key="run").select("current").run()
    assert set(at.dataframe[0].value["trace_id"]) == {r.trace_id for r in current}


def test_a_new_run_without_requests_says_so_and_points_to_earlier_runs(tmp_path, monkeypatch):
    db = tmp_path / "t.db"
    write(db, make_records(40), run_id="20250101-000000-aaaa")
    TelemetryStore(db, run_id="20250101-010000-bbbb").close()  # a restart: the new run has no request yet
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_DB", str(db))
    at = run_app()
    assert not at.exception
    assert "No traffic yet" in texts(at) and "earlier runs: pick one under Run in the sidebar" in texts(at)
    assert not at.metric
