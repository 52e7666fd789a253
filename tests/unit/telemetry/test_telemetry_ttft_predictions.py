"""The time model's TTFT predictions through telemetry: decision -> record (tracker) -> span attributes
(both encoders) -> receiver row -> store (incl. an older file) -> `ttft_predictions` / HTTP API, and the
router's prediction-error metrics. Expected figures are computed independently in Python from the records."""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3


import numpy as np
import orjson
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from prefixroute.extproc import wire
from prefixroute.extproc.headers import SERVED_HEADER
from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.types import Decision, EndpointId
from prefixroute.extproc.tracking import RequestTracker
from prefixroute.telemetry import attributes as A
from prefixroute.telemetry.client import HttpStoreClient
from prefixroute.telemetry.http_api import start_http_api
from prefixroute.telemetry.metrics import RouterMetrics
from prefixroute.telemetry.otlp_decode import request_rows
from prefixroute.telemetry.record_spans import record_attributes
from prefixroute.telemetry.recorder import TelemetryRecorder
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.store import TelemetryStore
from prefixroute.telemetry.store_reader import StoreReader
from prefixroute.telemetry.store_schema import SCHEMA_VERSION
from helpers.metrics import scrape
from helpers.picks import make_pick
from prefixroute.extproc.lifecycle import Pick as Pick_


NOW = 1_800_000_000.0
EPS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
PRED_KEYS = ("prefixroute.predicted_ttft_ms", "prefixroute.alternative_endpoint", "prefixroute.alternative_ttft_ms")


def nearest_rank(values, p):
    return float(np.percentile(np.array(values), p * 100, method="inverted_cdf")) if values else None




def rec(i: int = 0, **kw) -> RequestRecord:
    base = dict(trace_id=f"{i + 1:032x}", span_id=f"{i + 1:016x}", start_time=NOW - 10 + i * 0.01, policy="prefix",
                reason="affinity", endpoint=EPS[0], endpoints=(EPS[0], EPS[1]), ttft_ms=120.0, latency_ms=900.0,
                status=200, predicted_ttft_ms=100.0, alternative_endpoint=EPS[1], alternative_ttft_ms=640.0)
    base.update(kw)
    return RequestRecord(**base)


# --- tracker: decided() copies the decision's predictions --------------------------------------------------

def Pick(decision: Decision) -> Pick_:  # noqa: N802 - reads as the record it makes
    """A real router pick (`lifecycle.Pick`) of a non-streamed chat request routed by `decision`."""
    return make_pick(tuple(decision.endpoints), decision,
                     InferenceRequest(kind="chat", path="/v1/chat/completions", model="m", stream=False),
                     decision_us=42.0)


def _hv(pairs: dict[str, str]) -> list:
    return [wire.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]


@pytest.mark.parametrize("predicted", [True, False])
async def test_tracker_copies_the_decisions_predictions_into_the_emitted_record(predicted):
    out: list[RequestRecord] = []
    t = RequestTracker(lambda d, us: None, out.append, {"10.0.0.1:80": "a:80"}.get, max_body_bytes=1000,
                       obs_grace_s=0.05)
    extra = dict(predicted_ttft_ms=40.5, alternative_endpoint=EndpointId("b:80"), alternative_ttft_ms=610.0)
    decision = Decision(endpoints=(EndpointId("a:80"), EndpointId("b:80")), reason="affinity", policy="prefix",
                        **(extra if predicted else {}))
    st, tp = t.begin({":path": "/v1/chat/completions"})
    t.decided(st, Pick(decision))
    obs = t.attach(_hv({"traceparent": tp}))
    assert t.routing_response_headers(st, _hv({":status": "200"}), "10.0.0.1:80")
    t.obs_response_headers(obs, _hv({":status": "200", "content-type": "application/json"}), False, SERVED_HEADER)
    t.obs_body(obs, orjson.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}), True)
    t.routing_closed(st)
    t.obs_closed(obs)
    await asyncio.sleep(0.05)
    (r,) = out
    got = (r.predicted_ttft_ms, r.alternative_endpoint, r.alternative_ttft_ms)
    assert got == ((40.5, "b:80", 610.0) if predicted else (None, None, None))
    assert r.is_comparable_prediction is predicted  # served by a:80, the primary


# --- record -> span attributes -> receiver row ----------------------------------------------------------

def test_span_attributes_carry_the_predictions_and_omit_them_when_none():
    attrs = record_attributes(rec())
    assert [attrs[k] for k in PRED_KEYS] == [100.0, EPS[1], 640.0]
    bare = record_attributes(rec(predicted_ttft_ms=None, alternative_endpoint=None, alternative_ttft_ms=None))
    assert not set(PRED_KEYS) & set(bare)
    assert set(PRED_KEYS) <= set(A.FIELD_ATTRIBUTES.values())


@pytest.mark.parametrize("encoder", ["fast", "sdk"])
def test_predictions_survive_both_encoders_to_the_store_row(encoder):
    recs = [rec(0), rec(1, predicted_ttft_ms=0.0, alternative_endpoint=None, alternative_ttft_ms=None),
            rec(2, predicted_ttft_ms=None, alternative_endpoint=None, alternative_ttft_ms=None)]
    r = TelemetryRecorder(environ={}, endpoint="http://127.0.0.1:1")  # never exports in this test
    try:
        req = r._encode(recs)[0].request if encoder == "fast" else encode_spans([r._factory.span(x) for x in recs])
    finally:
        r.shutdown(0.1)
    rows, ignored = request_rows(req)
    assert ignored == 0
    got = [(row["predicted_ttft_ms"], row["alternative_endpoint"], row["alternative_ttft_ms"]) for row in rows]
    assert got == [(100.0, EPS[1], 640.0), (0.0, None, None), (None, None, None)]
    assert not set(PRED_KEYS) & set(json.loads(rows[2]["attrs"]))  # omitted, not written as empty values


def test_a_wrongly_typed_prediction_from_another_sender_becomes_null():
    r = TelemetryRecorder(environ={}, endpoint="http://127.0.0.1:1")
    try:
        span = r._factory.span(rec())
    finally:
        r.shutdown(0.1)
    span._attributes = {**span.attributes, "prefixroute.predicted_ttft_ms": "fast",
                        "prefixroute.alternative_ttft_ms": True}
    (row,), _ = request_rows(encode_spans([span]))
    assert row["predicted_ttft_ms"] is None and row["alternative_ttft_ms"] is None


# --- store: the ttft_predictions query, old files --------------------------------------------------------

def make_dataset(n: int, seed: int) -> list[RequestRecord]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        primary = rnd.choices(EPS, weights=(5, 3, 1))[0]
        other = rnd.choice([e for e in EPS if e != primary])
        served = primary if rnd.random() > 0.1 else other  # some served by the fallback
        status = rnd.choices((200, 503, 0, 429), weights=(85, 6, 4, 5))[0]
        has_pred = rnd.random() > 0.3
        has_alt = has_pred and rnd.random() > 0.2
        out.append(RequestRecord(
            trace_id=f"{rnd.getrandbits(128):032x}", span_id=f"{rnd.getrandbits(64):016x}",
            start_time=NOW - rnd.uniform(0, 600), policy="prefix", reason="affinity", endpoint=served,
            endpoints=(primary, other), status=status,
            error={0: "reset", 503: "upstream", 429: "slow down"}.get(
                status, "cut short" if rnd.random() < 0.03 else None),
            ttft_ms=rnd.uniform(0.2, 3000) if status == 200 and rnd.random() > 0.05 else None,
            predicted_ttft_ms=rnd.uniform(0.0, 2500) if has_pred else None,
            alternative_endpoint=other if has_alt else None,
            alternative_ttft_ms=rnd.uniform(5, 5000) if has_alt else None))
    return out


def expected_predictions(recs: list[RequestRecord], window_s: float) -> tuple[int, dict, dict[str, dict]]:
    rs = [r for r in recs if NOW - window_s <= r.start_time <= NOW]
    num_predicted = sum(r.predicted_ttft_ms is not None for r in rs)
    # Independently: the definition, written out (not RequestRecord.is_comparable_prediction).
    cmp_ = [r for r in rs if r.predicted_ttft_ms is not None and r.ttft_ms is not None and 0 < r.status < 400
            and r.error is None and r.endpoint == r.endpoints[0]]

    def stats(group: list[RequestRecord]) -> dict:
        cols = {"predicted_ttft_ms": [r.predicted_ttft_ms for r in group],
                "actual_ttft_ms": [r.ttft_ms for r in group],
                "ape_ratio": [abs(r.ttft_ms - r.predicted_ttft_ms) / max(r.ttft_ms, 1.0) for r in group],
                "error_ratio": [(r.ttft_ms - r.predicted_ttft_ms) / max(r.predicted_ttft_ms, 1.0) for r in group],
                "alternative_ttft_ms": [r.alternative_ttft_ms for r in group if r.alternative_ttft_ms is not None]}
        out = {"num_requests": len(group), "num_alternatives": len(cols["alternative_ttft_ms"])}
        for c, vals in cols.items():
            for name, p in (("p50", .5), ("p90", .9), ("p99", .99)):
                out[f"{c}_{name}"] = nearest_rank(vals, p)
        return out

    per = {ep: stats([r for r in cmp_ if r.endpoint == ep]) for ep in {r.endpoint for r in cmp_}}
    return num_predicted, (stats(cmp_) if cmp_ else None), per


def assert_row(got: dict, want: dict) -> None:
    for k, v in want.items():
        assert got[k] == (None if v is None else pytest.approx(v, rel=1e-9)), k


@pytest.fixture(scope="module")
def pred_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("pred") / "t.db"
    recs = make_dataset(2500, seed=3)
    store = TelemetryStore(path, max_age_s=0, max_rows=0)
    store.insert_records(recs)
    store.close()
    with StoreReader(path) as reader:
        yield recs, reader, path


@pytest.mark.parametrize("window_s", [5.0, 60.0, 600.0])
def test_ttft_predictions_match_an_independent_computation(pred_store, window_s):
    recs, reader, _ = pred_store
    got = reader.ttft_predictions(window_s, now=NOW)
    num_predicted, fleet, per = expected_predictions(recs, window_s)
    assert got["num_predicted"] == num_predicted > 0
    assert_row(got["fleet"], fleet)
    assert [r["endpoint"] for r in got["endpoints"]] == sorted(per, key=lambda e: (-per[e]["num_requests"], e))
    for row in got["endpoints"]:
        assert_row(row, per[row["endpoint"]])




def test_without_any_prediction_the_query_says_none(tmp_path):
    store = TelemetryStore(tmp_path / "t.db")
    store.insert_records([rec(i, predicted_ttft_ms=None, alternative_endpoint=None, alternative_ttft_ms=None)
                          for i in range(20)])
    store.close()
    with StoreReader(tmp_path / "t.db") as reader:
        assert reader.ttft_predictions(60, now=NOW) == {"window_s": 60, "num_predicted": 0, "fleet": None,
                                                         "endpoints": []}
        # Predictions only on requests that cannot be scored: counted, but no fleet row.
    store = TelemetryStore(tmp_path / "t.db")
    store.insert_records([rec(100, status=503, error="upstream", ttft_ms=None),
                          rec(101, endpoint=EPS[1])])  # served by the fallback
    store.close()
    with StoreReader(tmp_path / "t.db") as reader:
        got = reader.ttft_predictions(60, now=NOW)
    assert (got["num_predicted"], got["fleet"], got["endpoints"]) == (2, None, [])


# The store's CREATE TABLE of schema version 1 (before the prediction columns), verbatim.
V1_SCHEMA = """
CREATE TABLE requests (id INTEGER PRIMARY KEY, trace_id TEXT NOT NULL, span_id TEXT NOT NULL, parent_span_id TEXT,
    request_id TEXT, start_time REAL NOT NULL, end_time REAL, model TEXT, tenant_hash TEXT, policy TEXT, reason TEXT,
    endpoint TEXT, endpoints TEXT, matched_blocks INTEGER, total_blocks INTEGER, predicted_hit_ratio REAL,
    decision_us REAL, ttft_ms REAL, latency_ms REAL, prompt_tokens INTEGER, completion_tokens INTEGER,
    cached_tokens INTEGER, stream INTEGER, status INTEGER, error TEXT, path TEXT, service_name TEXT,
    attrs TEXT NOT NULL DEFAULT '{}', UNIQUE (trace_id, span_id));
CREATE INDEX requests_start_time ON requests(start_time);
CREATE INDEX requests_endpoint_start ON requests(endpoint, start_time);
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '1');
INSERT INTO requests (trace_id, span_id, start_time, end_time, endpoint, endpoints, ttft_ms, status, attrs)
    VALUES ('aa', 'bb', 1799999995.0, 1799999996.0, '10.0.0.1:8000', '["10.0.0.1:8000"]', 50.0, 200, '{}');
"""


def test_an_old_store_file_still_opens_and_is_upgraded_in_place(tmp_path):
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript(V1_SCHEMA)
    conn.close()
    # A reader on the not yet upgraded file: the new fields read as None, the query finds no prediction.
    reader = StoreReader(path)
    (old,) = reader.recent_requests(5)
    assert (old["trace_id"], old["ttft_ms"], old["predicted_ttft_ms"], old["alternative_endpoint"]) == \
        ("aa", 50.0, None, None)
    assert reader.request("aa")["alternative_ttft_ms"] is None
    assert list(reader.iter_requests(60, now=NOW))[0]["predicted_ttft_ms"] is None
    assert reader.ttft_predictions(60, now=NOW)["num_predicted"] == 0
    # The writer (a receiver started on the old file) adds the columns and takes new rows with predictions.
    store = TelemetryStore(path)
    store.insert_records([rec(1)])
    store.close()
    store = TelemetryStore(path)  # opening an upgraded file again changes nothing
    store.close()
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    cols = [r[1] for r in conn.execute("PRAGMA table_info(requests)")]
    conn.close()
    assert cols.count("predicted_ttft_ms") == 1 and {"alternative_endpoint", "alternative_ttft_ms"} <= set(cols)
    # The reader opened before the upgrade sees the new columns without reopening.
    rows = {r["trace_id"]: r for r in reader.recent_requests(5)}
    assert rows["aa"]["predicted_ttft_ms"] is None and rows["aa"]["ttft_ms"] == 50.0
    assert rows[rec(1).trace_id]["predicted_ttft_ms"] == 100.0
    assert reader.ttft_predictions(60, now=NOW)["fleet"]["num_requests"] == 1
    reader.close()


# --- router metrics ------------------------------------------------------------------------------------

