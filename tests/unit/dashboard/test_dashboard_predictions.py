"""The "Predicted vs actual TTFT per endpoint" panel: its data functions, both sources (SQLite file and the
receiver's HTTP API), and the app under AppTest against real stores, with and without predictions.
Expected figures are computed independently from the records."""

from __future__ import annotations

import http.server
import random
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

import prefixroute.dashboard
from prefixroute.dashboard import data as D
from prefixroute.dashboard import tables as T
from prefixroute.dashboard.source import DataSource
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.store import TelemetryStore

APP = str(Path(prefixroute.dashboard.__file__).parent / "app.py")
ENDPOINTS = ("10.0.0.2:8000", "10.0.0.10:8000", "10.0.0.3:8000")


pytestmark = pytest.mark.usefixtures("dashboard_env")  # conftest.py


def make_records(n: int, *, predicted: bool, seed: int = 0) -> list[RequestRecord]:
    rnd = random.Random(seed)
    now = time.time()
    out = []
    for i in range(n):
        ep = rnd.choices(ENDPOINTS, weights=(6, 3, 1))[0]
        other = rnd.choice([e for e in ENDPOINTS if e != ep])
        status = rnd.choice((200, 200, 200, 200, 503))
        out.append(RequestRecord(
            trace_id=f"{rnd.getrandbits(128):032x}", span_id=f"{rnd.getrandbits(64):016x}",
            start_time=now - rnd.uniform(1, 200), request_id=f"r{i}", model="m", policy="prefix", reason="affinity",
            endpoint=ep, endpoints=(ep, other), ttft_ms=rnd.uniform(5, 900) if status == 200 else None,
            latency_ms=rnd.uniform(900, 3000), prompt_tokens=100, completion_tokens=20, cached_tokens=50, stream=True,
            status=status, error=None if status == 200 else "upstream", path="/v1/chat/completions",
            predicted_ttft_ms=rnd.uniform(5, 900) if predicted else None,
            alternative_endpoint=other if predicted else None,
            alternative_ttft_ms=rnd.uniform(100, 3000) if predicted else None))
    return out


def write(db: Path, records: list[RequestRecord]) -> None:
    store = TelemetryStore(db)
    store.insert_records(records)
    store.close()


def median(values):
    return float(np.percentile(np.array(values), 50, method="inverted_cdf"))


def expected(records: list[RequestRecord]) -> dict[str, dict]:
    """Per endpoint over the comparable requests (succeeded, on the primary): independent of the store."""
    ok = [r for r in records if r.predicted_ttft_ms is not None and r.status == 200 and r.endpoint == r.endpoints[0]]
    out = {}
    for ep in {r.endpoint for r in ok}:
        mine = [r for r in ok if r.endpoint == ep]
        out[ep] = {"n": len(mine), "pred": median([r.predicted_ttft_ms for r in mine]),
                   "actual": median([r.ttft_ms for r in mine]),
                   "ape": median([abs(r.ttft_ms - r.predicted_ttft_ms) / r.ttft_ms for r in mine])}
    return out


# --- data functions ------------------------------------------------------------------------------------

def test_prediction_state_tells_the_three_empty_cases_apart():
    assert D.prediction_state(None).kind == "unavailable"
    assert D.prediction_state({"num_predicted": 0, "fleet": None, "endpoints": []}).kind == "none"
    s = D.prediction_state({"num_predicted": 4, "fleet": None, "endpoints": []})
    assert (s.kind, s.num_predicted, s.num_compared) == ("uncomparable", 4, 0)
    s = D.prediction_state({"num_predicted": 9, "fleet": {"num_requests": 7}, "endpoints": [{}]})
    assert (s.kind, s.num_predicted, s.num_compared) == ("ok", 9, 7)


def test_prediction_frame_long_and_table():
    result = {"num_predicted": 3, "fleet": {"num_requests": 3}, "endpoints": [
        {"endpoint": "h:10", "num_requests": 2, "predicted_ttft_ms_p50": 40.0, "actual_ttft_ms_p50": 250.0,
         "ape_ratio_p50": 0.84, "error_ratio_p50": 5.25, "alternative_ttft_ms_p50": None, "num_alternatives": 0},
        {"endpoint": "h:9", "num_requests": 1, "predicted_ttft_ms_p50": 100.0, "actual_ttft_ms_p50": 80.0,
         "ape_ratio_p50": 0.25, "error_ratio_p50": -0.2, "alternative_ttft_ms_p50": 610.0, "num_alternatives": 1}]}
    frame = D.prediction_frame(result)
    assert list(frame["endpoint"]) == ["h:9", "h:10"]  # natural order, as every other endpoint view
    assert list(frame.columns) == list(D.PREDICTION_COLUMNS)
    assert np.isnan(frame.loc[1, "alternative_ttft_ms_p50"])  # unknown: NaN, shown as "–"
    long = D.prediction_long(frame)
    assert sorted(map(tuple, long[["endpoint", "kind", "ttft_ms"]].values.tolist())) == [
        ("h:10", "actual", 250.0), ("h:10", "predicted", 40.0), ("h:9", "actual", 80.0), ("h:9", "predicted", 100.0)]
    table = T.prediction_table(frame)
    assert list(table.index) == ["h:9", "h:10"]
    assert table.loc["h:10"].tolist() == ["2", "40.0 ms", "250 ms", "84.0 %", "+525.0\u00a0%", "–"]
    assert table.loc["h:9"].tolist() == ["1", "100 ms", "80.0 ms", "25.0 %", "-20.0\u00a0%", "610 ms"]
    empty = D.prediction_frame({"num_predicted": 0, "fleet": None, "endpoints": []})
    assert len(empty) == 0 and len(D.prediction_long(empty)) == 0 and len(T.prediction_table(empty)) == 0


# --- sources -------------------------------------------------------------------------------------------

def test_file_and_url_sources_give_the_same_predictions(tmp_path):
    from helpers.realrun import start_receiver

    db = tmp_path / "t.db"
    records = make_records(300, predicted=True)
    write(db, records)
    now = time.time()
    with ExitStack() as stack:
        _, http_port = start_receiver(stack, db, tmp_path / "logs")  # a real `prefixroute telemetry` process
        by_file = DataSource(db=str(db)).live_snapshot(300, now=now)["ttft_pred"]
        by_url = DataSource(url=f"http://127.0.0.1:{http_port}").live_snapshot(300, now=now)["ttft_pred"]
    assert by_file == by_url
    want = expected(records)
    assert {r["endpoint"]: r["num_requests"] for r in by_file["endpoints"]} == {ep: w["n"] for ep, w in want.items()}
    for r in by_file["endpoints"]:
        w = want[r["endpoint"]]
        assert (r["predicted_ttft_ms_p50"], r["actual_ttft_ms_p50"]) == (pytest.approx(w["pred"]),
                                                                         pytest.approx(w["actual"]))
        assert r["ape_ratio_p50"] == pytest.approx(w["ape"])


class _OldReceiver(http.server.BaseHTTPRequestHandler):
    """A receiver API from before /api/ttft_predictions: that route is a 404, the rest answer."""

    def do_GET(self):  # noqa: N802
        if self.path.startswith("/api/ttft_predictions"):
            body, code = b'{"error": {"message": "no route", "type": "not_found_error"}}', 404
        else:
            body, code = b'{"num_requests": 0}', 200
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_an_older_receiver_without_the_route_gives_none_not_an_error():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OldReceiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert DataSource(url=f"http://127.0.0.1:{server.server_address[1]}").ttft_predictions(300) is None
    finally:
        server.shutdown()
        server.server_close()


# --- the app -------------------------------------------------------------------------------------------

def run_app() -> AppTest:
    return AppTest.from_file(APP, default_timeout=60).run()


def metric(at: AppTest, label: str) -> str:
    for m in at.metric:
        if m.label == label:
            return m.value
    raise AssertionError(f"no metric {label!r}: {[m.label for m in at.metric]}")


def _panel_table(at: AppTest) -> pd.DataFrame:
    (table,) = [t.value for t in at.table if "predicted p50" in t.value.columns]
    return table


def test_panel_shows_predicted_vs_actual_per_endpoint(tmp_path, monkeypatch):
    db = tmp_path / "t.db"
    records = make_records(400, predicted=True, seed=1)
    write(db, records)
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_DB", str(db))
    at = run_app()
    assert not at.exception
    want = expected(records)
    table = _panel_table(at)
    assert list(table.index) == ["10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.10:8000"]
    for ep, row in table.iterrows():
        w = want[ep]
        assert row["requests"] == f"{w['n']:,}"
        assert row["predicted p50"] == T.format_ms(w["pred"]) and row["actual p50"] == T.format_ms(w["actual"])
        assert row["abs. error p50"] == T.format_ratio(w["ape"])
    scored = sum(w["n"] for w in want.values())
    assert metric(at, "Requests with a prediction") == f"{scored:,}"
    assert "No TTFT predictions" not in "\n".join(i.value for i in at.info)
    assert "Predicted vs actual TTFT per endpoint" in [h.value for h in at.subheader]


def test_panel_says_so_plainly_when_no_request_has_a_prediction(tmp_path, monkeypatch):
    db = tmp_path / "t.db"
    write(db, make_records(200, predicted=False))
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_DB", str(db))
    at = run_app()
    assert not at.exception
    info = "\n".join(i.value for i in at.info)
    assert "No TTFT predictions in the last 5 min" in info and "no time model" in info
    assert not [t for t in at.table if "predicted p50" in t.value.columns]
    assert "TTFT prediction error (median)" not in [m.label for m in at.metric]
    assert metric(at, "TTFT p50")  # the rest of the page is drawn as before
