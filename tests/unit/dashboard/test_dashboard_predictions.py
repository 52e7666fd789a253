"""The "Predicted vs actual TTFT per endpoint" panel: its data functions and the app under AppTest against real
stores, with and without predictions (both sources, SQLite file and the receiver's HTTP API:
tests/integration/dashboard/test_dashboard_predictions_http.py). Expected figures are computed independently
from the records."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from helpers.dashboard import (expected_predictions as expected, metric, prediction_records as make_records,
                               run_app, write)
from prefixroute.dashboard import data as D
from prefixroute.dashboard import tables as T

pytestmark = pytest.mark.usefixtures("dashboard_env")  # conftest.py


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


# --- the app -------------------------------------------------------------------------------------------


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
    assert "TTFT error (median)" not in [m.label for m in at.metric]
    assert metric(at, "TTFT p50")  # the rest of the page is drawn as before
