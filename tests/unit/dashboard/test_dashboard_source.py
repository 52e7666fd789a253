"""DataSource: the store going away and coming back, the mean in-flight SQL, the endpoint series. Real SQLite
stores in tmp_path (over HTTP, the router's metrics and a receiver URL being down:
tests/integration/dashboard/test_dashboard_source_http.py)."""

from __future__ import annotations

import os
import random

import pytest

from prefixroute.dashboard.source import DataSource
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.store import TelemetryStore
from prefixroute.telemetry.store_schema import StoreMissing

NOW = 1_800_000_000.0


def rec(i: int, start: float, latency_ms: float, endpoint: str = "h:1", prompt: int = 100,
        cached: int = 50) -> RequestRecord:
    return RequestRecord(trace_id=f"{i:032x}", span_id=f"{i:016x}", start_time=start, endpoint=endpoint,
                         reason="affinity", policy="prefix", ttft_ms=latency_ms / 2, latency_ms=latency_ms,
                         prompt_tokens=prompt, cached_tokens=cached, status=200)


def write(path, records) -> None:
    store = TelemetryStore(path)
    store.insert_records(records)
    store.close()


def test_missing_store_then_created_then_deleted_then_recreated(tmp_path):
    db = tmp_path / "t.db"
    src = DataSource(db=str(db))
    with pytest.raises(StoreMissing):
        src.query(lambda q: q.num_requests())
    write(db, [rec(1, NOW - 5, 100)])
    assert src.query(lambda q: q.num_requests()) == 1
    # Deleted: the open connection would still read the unlinked file; the source must notice.
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(f"{db}{suffix}"):
            os.remove(f"{db}{suffix}")
    with pytest.raises(StoreMissing):
        src.query(lambda q: q.num_requests())
    write(db, [rec(i, NOW - 5, 100) for i in range(2, 5)])
    assert src.query(lambda q: q.num_requests()) == 3
    src.close()


def test_replaced_file_is_reopened(tmp_path):
    db = tmp_path / "t.db"
    write(db, [rec(1, NOW - 5, 100)])
    src = DataSource(db=str(db))
    assert src.query(lambda q: q.num_requests()) == 1
    other = tmp_path / "other.db"
    write(other, [rec(i, NOW - 5, 100) for i in range(2, 9)])
    os.replace(other, db)  # a new inode at the same path
    assert src.query(lambda q: q.num_requests()) == 7


def test_not_a_database_reads_as_missing_not_a_crash(tmp_path):
    db = tmp_path / "t.db"
    db.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreMissing, match="not readable"):
        DataSource(db=str(db)).query(lambda q: q.summary(60.0, now=NOW))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_mean_in_flight_matches_an_independent_integral(tmp_path, seed):
    rnd = random.Random(seed)
    window_s = 60.0
    records = [rec(i, NOW - rnd.uniform(0, 120), rnd.uniform(10, 30_000), endpoint=rnd.choice(["a:1", "b:1"]))
               for i in range(300)]
    write(tmp_path / "t.db", records)
    got = DataSource(db=str(tmp_path / "t.db")).mean_in_flight(window_s, now=NOW)
    # Independent: sample the number in flight at many instants of the window (Riemann sum).
    steps = 6000
    for ep in ("a:1", "b:1"):
        spans = [(r.start_time, r.end_time) for r in records if r.endpoint == ep]
        samples = [sum(1 for s, e in spans if s <= t < e)
                   for t in (NOW - window_s + (k + 0.5) * window_s / steps for k in range(steps))]
        assert got[ep] == pytest.approx(sum(samples) / steps, abs=0.02)


def test_mean_in_flight_is_none_for_a_url_source():
    assert DataSource(url="http://127.0.0.1:9").mean_in_flight(60.0) is None


@pytest.mark.parametrize("bucket_s", [1.0, 10.0, 60.0])
def test_endpoint_series_agrees_with_the_store_timeseries(tmp_path, bucket_s):
    from prefixroute.telemetry.store_reader import StoreReader

    rnd = random.Random(int(bucket_s))
    records = []
    for i in range(500):
        prompt = rnd.choice([None, 0, rnd.randint(1, 4000)])
        r = rec(i, NOW - rnd.uniform(0, 200), 100, endpoint=rnd.choice(["a:1", "b:1", None]),
                prompt=prompt, cached=rnd.randint(0, prompt) if prompt else None)
        r.predicted_hit_ratio = rnd.random()
        r.status = rnd.choice([200, 200, 503, 0, 404])
        records.append(r)
    write(tmp_path / "t.db", records)
    mine = DataSource(db=str(tmp_path / "t.db")).endpoint_series(120.0, bucket_s, now=NOW)
    with StoreReader(tmp_path / "t.db") as reader:
        theirs = reader.timeseries(120.0, bucket_s, by_endpoint=True, now=NOW)
    key = lambda r: (r["bucket_start"], r["endpoint"] or "")  # noqa: E731
    assert len(mine) == len(theirs) >= 6
    for a, b in zip(sorted(mine, key=key), sorted(theirs, key=key)):
        for k in ("bucket_start", "endpoint", "num_requests", "num_errors", "requests_per_s"):
            assert a[k] == pytest.approx(b[k]), k
        for k in ("actual_hit_ratio", "predicted_hit_ratio"):
            assert (a[k] is None) == (b[k] is None) and (a[k] is None or a[k] == pytest.approx(b[k])), k
