"""The SQLite store: inserts, retention, and every dashboard query checked against values computed
independently in Python/numpy from the same records."""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict

import numpy as np
import pytest

from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.store import TelemetryStore
from prefixroute.telemetry.store_reader import StoreReader
from prefixroute.telemetry.store_schema import StoreMissing, record_to_row

NOW = 1_800_000_000.0
ENDPOINTS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
REASONS = ("affinity", "spill", "cold", "failover")


def make_records(n: int, seed: int, span_s: float = 600.0) -> list[RequestRecord]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        ep = rnd.choices(ENDPOINTS, weights=(5, 3, 1))[0]
        prompt = rnd.randint(1, 4000) if rnd.random() > 0.1 else None  # some responses carry no usage
        status = rnd.choices((200, 200, 200, 400, 404, 503, 0), weights=(50, 30, 10, 3, 2, 3, 2))[0]
        # As the tracker writes them: a reset and a refusal carry a message, a cut-short 200 too.
        error = {0: "upstream reset", 400: "invalid 'messages'", 404: "model not found"}.get(status)
        if status == 200 and rnd.random() < 0.02:
            error = "response incomplete"
        out.append(RequestRecord(
            trace_id=f"{rnd.getrandbits(128):032x}", span_id=f"{rnd.getrandbits(64):016x}",
            start_time=NOW - rnd.uniform(0, span_s), request_id=f"req-{i}", model="m", policy="prefix",
            reason=rnd.choice(REASONS), endpoint=ep, endpoints=(ep, ENDPOINTS[0]),
            predicted_hit_ratio=rnd.random(), decision_us=rnd.uniform(5, 500),
            ttft_ms=rnd.uniform(1, 2000) if status == 200 else None, latency_ms=rnd.uniform(10, 5000),
            prompt_tokens=prompt, completion_tokens=rnd.randint(0, 300) if prompt else None,
            cached_tokens=rnd.randint(0, prompt) if prompt else None, stream=rnd.random() < 0.5,
            status=status, error=error, path="/v1/chat/completions"))
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("store") / "t.db"
    recs = make_records(3000, seed=7)
    store = TelemetryStore(path, max_age_s=0, max_rows=0)
    store.insert_records(recs[:1000])
    store.insert_records(recs[1000:])
    store.close()
    reader = StoreReader(path)
    yield recs, reader
    reader.close()


def in_window(recs, window_s, now=NOW):
    return [r for r in recs if now - window_s <= r.start_time <= now]


def nearest_rank(values, p):
    return float(np.percentile(np.array(values), p * 100, method="inverted_cdf")) if values else None


def is_refused(r):
    return 400 <= r.status < 500


def is_error(r):  # a 4xx refusal is never an error, whatever message it carries (issue 11)
    return not is_refused(r) and (r.error is not None or r.status == 0 or r.status >= 500)


def expected_aggregate(rs):
    used = [r for r in rs if r.prompt_tokens and r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in used)
    out = {
        "num_requests": len(rs),
        "num_errors": sum(map(is_error, rs)),
        "num_refused": sum(map(is_refused, rs)),
        "error_ratio": sum(map(is_error, rs)) / len(rs) if rs else 0.0,
        "refused_ratio": sum(map(is_refused, rs)) / len(rs) if rs else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": sum(r.cached_tokens for r in used),
        "actual_hit_ratio": sum(r.cached_tokens for r in used) / prompt if prompt else None,
        "predicted_hit_ratio": sum(r.predicted_hit_ratio * r.prompt_tokens for r in used) / prompt if prompt else None,
    }
    for col in ("ttft_ms", "latency_ms", "decision_us"):
        vals = [getattr(r, col) for r in rs if getattr(r, col) is not None]
        for name, p in (("p50", .5), ("p90", .9), ("p99", .99)):
            out[f"{col}_{name}"] = nearest_rank(vals, p)
    return out


def assert_matches(got: dict, want: dict):
    for k, v in want.items():
        if k.startswith("decision_us") and k not in got:
            continue
        if v is None:
            assert got[k] is None, k
        else:
            assert got[k] == pytest.approx(v, rel=1e-9), k


@pytest.mark.parametrize("window_s", [1.0, 30.0, 300.0, 10_000.0])
def test_summary_matches_independent_computation(dataset, window_s):
    recs, reader = dataset
    rs = in_window(recs, window_s)
    got = reader.summary(window_s, now=NOW)
    assert_matches(got, expected_aggregate(rs))
    assert got["requests_per_s"] == pytest.approx(len(rs) / window_s)
    shares = Counter(r.endpoint for r in rs)
    assert got["num_endpoints"] == len(shares)
    if rs:
        assert got["balance_ratio"] == pytest.approx(max(shares.values()) / len(rs) * len(shares))
        assert got["first_start_time"] == min(r.start_time for r in rs)
    else:
        assert got["balance_ratio"] is None


@pytest.mark.parametrize(("window_s", "bucket_s", "by_endpoint"), [
    (600.0, 60.0, False), (600.0, 7.0, False), (120.0, 10.0, True), (600.0, 600.0, True),
])
def test_timeseries_matches_independent_computation(dataset, window_s, bucket_s, by_endpoint):
    recs, reader = dataset
    groups = defaultdict(list)
    for r in in_window(recs, window_s):
        key = (math.floor(r.start_time / bucket_s) * bucket_s,) + ((r.endpoint,) if by_endpoint else ())
        groups[key].append(r)
    got = reader.timeseries(window_s, bucket_s, by_endpoint=by_endpoint, now=NOW)
    got_keys = [(g["bucket_start"],) + ((g["endpoint"],) if by_endpoint else ()) for g in got]
    assert got_keys == sorted(groups)  # oldest first, empty buckets absent
    for g, key in zip(got, got_keys):
        assert_matches(g, expected_aggregate(groups[key]))
        assert g["requests_per_s"] == pytest.approx(len(groups[key]) / bucket_s)


@pytest.mark.parametrize("by", ["endpoint", "reason", "status"])
def test_breakdown_matches_independent_computation(dataset, by):
    recs, reader = dataset
    rs = in_window(recs, 400.0)
    groups = defaultdict(list)
    for r in rs:
        groups[getattr(r, by)].append(r)
    got = reader.breakdown(400.0, by, now=NOW)
    assert {g[by] for g in got} == set(groups)
    assert [g["num_requests"] for g in got] == sorted((len(v) for v in groups.values()), reverse=True)
    for g in got:
        assert_matches(g, expected_aggregate(groups[g[by]]))
        assert g["share_ratio"] == pytest.approx(len(groups[g[by]]) / len(rs))


def test_reasons_total_and_per_bucket(dataset):
    recs, reader = dataset
    rs = in_window(recs, 300.0)
    want = Counter(r.reason for r in rs)
    got = reader.reasons(300.0, now=NOW)
    assert {g["reason"]: g["num_requests"] for g in got} == dict(want)
    assert sum(g["share_ratio"] for g in got) == pytest.approx(1.0)
    per_bucket = reader.reasons(300.0, 100.0, now=NOW)
    want_b = Counter((math.floor(r.start_time / 100.0) * 100.0, r.reason) for r in rs)
    assert {(g["bucket_start"], g["reason"]): g["num_requests"] for g in per_bucket} == dict(want_b)
    totals = Counter(b for b, _ in want_b.elements())
    for g in per_bucket:
        assert g["share_ratio"] == pytest.approx(want_b[(g["bucket_start"], g["reason"])] / totals[g["bucket_start"]])


@pytest.mark.parametrize(("column", "bin_width"), [("ttft_ms", 100.0), ("decision_us", 25.0), ("latency_ms", None)])
def test_histogram_counts(dataset, column, bin_width):
    recs, reader = dataset
    vals = [getattr(r, column) for r in in_window(recs, 600.0) if getattr(r, column) is not None]
    got = reader.histogram(600.0, column, bin_width=bin_width, now=NOW)
    width = got[0]["bin_end"] - got[0]["bin_start"]
    if bin_width:
        assert width == bin_width
    want = Counter(math.floor(v / width) * width for v in vals)
    assert {g["bin_start"]: g["num_requests"] for g in got} == pytest.approx(dict(want))
    assert sum(g["num_requests"] for g in got) == len(vals)


def test_recent_and_iter_requests_and_one_request(dataset):
    recs, reader = dataset
    newest = sorted(recs, key=lambda r: r.start_time, reverse=True)
    got = reader.recent_requests(5)
    assert [g["request_id"] for g in got] == [r.request_id for r in newest[:5]]
    assert got[0]["endpoints"] == list(newest[0].endpoints)
    on_ep = reader.recent_requests(3, endpoint=ENDPOINTS[2])
    assert [g["request_id"] for g in on_ep] == [r.request_id for r in newest if r.endpoint == ENDPOINTS[2]][:3]
    since = list(reader.iter_requests(60.0, now=NOW))
    assert [g["request_id"] for g in since] == [r.request_id for r in sorted(in_window(recs, 60.0),
                                                                            key=lambda r: r.start_time)]
    one = reader.request(recs[3].trace_id)
    assert one["request_id"] == recs[3].request_id and one["attrs"] == {}
    assert reader.request("f" * 32) is None


def test_empty_store_queries(tmp_path):
    TelemetryStore(tmp_path / "e.db").close()
    with StoreReader(tmp_path / "e.db") as reader:
        s = reader.summary(60, now=NOW)
        assert s["num_requests"] == 0 and s["actual_hit_ratio"] is None and s["ttft_ms_p50"] is None
        assert reader.timeseries(60, 5, now=NOW) == []
        assert reader.endpoints(60, now=NOW) == []
        assert reader.histogram(60, now=NOW) == []
        assert reader.recent_requests() == []


def test_missing_store_and_bad_arguments(tmp_path, dataset):
    with pytest.raises(StoreMissing):
        StoreReader(tmp_path / "absent.db")
    _, reader = dataset
    for call in (lambda: reader.summary(0), lambda: reader.timeseries(60, 0), lambda: reader.breakdown(60, "attrs"),
                 lambda: reader.histogram(60, "status")):
        with pytest.raises(ValueError):
            call()


def test_reinsert_replaces_instead_of_duplicating(tmp_path):
    store = TelemetryStore(tmp_path / "r.db")
    rec = make_records(1, seed=1)[0]
    store.insert_records([rec])
    rec.status = 503
    store.insert_records([rec])  # an OTLP retry of the same span
    assert store.num_rows() == 1
    store.close()
    with StoreReader(tmp_path / "r.db") as reader:
        assert reader.request(rec.trace_id)["status"] == 503


@pytest.mark.parametrize(("max_age_s", "max_rows"), [(100.0, 0), (0, 250), (300.0, 50), (0, 0)])
def test_retention(tmp_path, max_age_s, max_rows):
    recs = make_records(1000, seed=3)
    store = TelemetryStore(tmp_path / "ret.db", max_age_s=max_age_s, max_rows=max_rows)
    store.insert_rows(record_to_row(r) for r in recs)
    deleted = store.enforce_retention(now=NOW)
    keep = sorted(recs, key=lambda r: r.start_time, reverse=True)
    if max_age_s > 0:
        keep = [r for r in keep if r.start_time >= NOW - max_age_s]
    if max_rows > 0:
        keep = keep[:max_rows]
    assert deleted == len(recs) - len(keep)
    store.close()
    with StoreReader(tmp_path / "ret.db") as reader:
        left = list(reader.iter_requests(10_000, now=NOW))
    assert {r["trace_id"] for r in left} == {r.trace_id for r in keep}


def test_reader_sees_writer_commits_while_open(tmp_path):
    store = TelemetryStore(tmp_path / "w.db")
    reader = StoreReader(tmp_path / "w.db")
    assert reader.num_requests() == 0
    store.insert_records(make_records(10, seed=5))
    assert reader.num_requests() == 10
    reader.close()
    store.close()


def test_refusals_are_not_errors():
    """Finding 7: 4xx refusals counted as errors showed "Errors 24%" with zero 5xx."""
    recs = [RequestRecord(trace_id=f"{i:032x}", span_id=f"{i:016x}", start_time=NOW - 1 - i * 0.01, status=s,
                          error=e, endpoint=None if s in (400, 404) else "a:1")
            for i, (s, e) in enumerate([(404, "model 'x' not found")] * 24 + [(400, "invalid body")] * 6
                                       + [(200, None)] * 68 + [(503, "HTTP 503")] + [(0, "upstream reset")])]
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        store = TelemetryStore(f"{d}/r.db")
        store.insert_records(recs)
        store.close()
        with StoreReader(f"{d}/r.db") as reader:
            s = reader.summary(60, now=NOW)
            by_status = {r["status"]: r for r in reader.breakdown(60, "status", now=NOW)}
    assert (s["num_requests"], s["num_errors"], s["num_refused"]) == (100, 2, 30)
    assert s["error_ratio"] == pytest.approx(0.02) and s["refused_ratio"] == pytest.approx(0.30)
    assert by_status[404]["num_errors"] == 0 and by_status[404]["num_refused"] == 24
    assert by_status[503]["num_errors"] == 1 and by_status[503]["num_refused"] == 0


def big_records(n: int, seed: int, attr_bytes: int) -> list[dict]:
    rows = []
    for r in make_records(n, seed):
        row = record_to_row(r, service_name="router", attrs={"gen_ai.request.model": "m" * attr_bytes,
                                                              "pad": "p" * attr_bytes})
        rows.append(row)
    return rows


@pytest.mark.parametrize("attr_bytes", [100, 4000])
def test_max_bytes_bounds_the_pages_in_use_and_keeps_the_newest(tmp_path, attr_bytes):
    cap = 512 * 1024
    store = TelemetryStore(tmp_path / "b.db", max_age_s=0, max_rows=0, max_bytes=cap)
    batch = 300
    inserted = []
    for seed in range(8):  # rounds of inserts, retention after each, as the receiver does
        rows = big_records(batch, seed=100 + seed, attr_bytes=attr_bytes)
        for r in rows:
            r["start_time"] += seed * 1000  # each round newer than the last
        inserted += rows
        store.insert_rows(rows)
        store.enforce_retention(now=NOW + 10_000)
        assert store.used_bytes() <= cap
    kept = store.num_rows()
    assert 0 < kept < len(inserted)
    store.close()
    # The file does not grow past the cap by more than one round of inserts (freed pages are reused).
    assert (tmp_path / "b.db").stat().st_size <= cap + batch * (2 * attr_bytes + 1500) * 1.5
    with StoreReader(tmp_path / "b.db") as reader:
        left = sorted(r["start_time"] for r in reader.iter_requests(1e9, now=NOW + 10_000))
    newest = sorted(r["start_time"] for r in inserted)[-kept:]
    assert left == pytest.approx(newest)  # exactly the newest rows were kept
