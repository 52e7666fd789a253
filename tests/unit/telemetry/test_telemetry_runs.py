"""Run ids in the request store: each writer stamps its run on the rows it stores, `runs()` lists the runs with
their spans, an older file gains the column in place, retention forgets runs left without a row (the HTTP API and
its client serve the same list: tests/integration/telemetry/test_telemetry_runs_http.py)."""

from __future__ import annotations

import sqlite3

from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.store import TelemetryStore
from prefixroute.telemetry.store_reader import StoreReader
from prefixroute.telemetry.store_schema import SCHEMA_VERSION

NOW = 1_800_000_000.0


def rec(i: int, start_time: float, endpoint: str = "10.0.0.1:8000") -> RequestRecord:
    return RequestRecord(trace_id=f"{i:032x}", span_id=f"{i:016x}", start_time=start_time, endpoint=endpoint,
                         endpoints=(endpoint,), status=200, ttft_ms=10.0, latency_ms=20.0)


def test_each_writer_stamps_its_run_and_runs_lists_them_newest_first(tmp_path):
    path = tmp_path / "t.db"
    first = TelemetryStore(path, run_id="run-a")
    first.insert_records([rec(i, NOW - 100 + i) for i in range(5)])
    first.close()
    second = TelemetryStore(path, run_id="run-b")
    second.insert_records([rec(100 + i, NOW - 10 + i) for i in range(3)])
    # A row that names its own run keeps it (the writer's id fills only the rows that carry none).
    second.insert_rows([{**_row(rec(200, NOW - 1)), "run_id": "elsewhere"}])
    second.close()
    with StoreReader(path) as reader:
        runs = reader.runs()
        assert [r["run_id"] for r in runs] == ["run-b", "run-a"]  # newest started first
        b, a = runs
        assert (a["num_requests"], a["first_start_time"], a["last_start_time"]) == (5, NOW - 100, NOW - 96)
        assert (b["num_requests"], b["first_start_time"], b["last_start_time"]) == (3, NOW - 10, NOW - 8)
        assert b["started_at"] >= a["started_at"]
        assert [r["trace_id"] for r in reader.recent_requests(10, run_id="run-a")] == \
            [f"{i:032x}" for i in reversed(range(5))]
        assert len(reader.recent_requests(10)) == 9


def test_reopening_with_the_same_run_id_continues_that_run(tmp_path):
    # `prefixroute up` restarts a crashed receiver with the same --run-id: one run, its first start kept.
    path = tmp_path / "t.db"
    store = TelemetryStore(path, run_id="run-a")
    store.insert_records([rec(1, NOW - 5)])
    store.close()
    started = StoreReader(path).runs()[0]["started_at"]
    store = TelemetryStore(path, run_id="run-a")
    store.insert_records([rec(2, NOW - 1)])
    store.close()
    (run,) = StoreReader(path).runs()
    assert run["run_id"] == "run-a" and run["num_requests"] == 2 and run["started_at"] == started


def test_a_store_without_a_run_lists_a_run_only_for_rows_without_one(tmp_path):
    path = tmp_path / "t.db"
    store = TelemetryStore(path)  # no run id: rows keep run_id NULL
    assert StoreReader(path).runs() == []
    store.insert_records([rec(1, NOW - 5), rec(2, NOW - 2)])
    store.close()
    (legacy,) = StoreReader(path).runs()
    assert legacy == {"run_id": None, "started_at": NOW - 5, "num_requests": 2, "first_start_time": NOW - 5,
                      "last_start_time": NOW - 2}


def test_an_older_file_gains_run_ids_in_place(tmp_path):
    path = tmp_path / "old.db"
    store = TelemetryStore(path)
    store.insert_records([rec(1, NOW - 50)])
    store.close()
    conn = sqlite3.connect(path)  # make it a version-3 file: no run_id column, no runs table
    conn.executescript("DROP INDEX requests_run_start; ALTER TABLE requests DROP COLUMN run_id; DROP TABLE runs;"
                       "UPDATE meta SET value = '3' WHERE key = 'schema_version';")
    conn.close()
    reader = StoreReader(path)
    assert reader.runs() == [] and reader.recent_requests(5, run_id="x") == []
    store = TelemetryStore(path, run_id="new")
    store.insert_records([rec(2, NOW - 1)])
    store.close()
    assert [(r["run_id"], r["num_requests"]) for r in reader.runs()] == [("new", 1), (None, 1)]
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    assert "requests_run_start" in {r[1] for r in conn.execute("PRAGMA index_list(requests)")}
    conn.close()
    reader.close()


def test_retention_forgets_runs_left_without_rows_but_not_the_current_one(tmp_path):
    path = tmp_path / "t.db"
    old = TelemetryStore(path, run_id="old")
    old.insert_records([rec(1, NOW - 5000)])
    old.close()
    store = TelemetryStore(path, run_id="current", max_age_s=3600)
    assert store.enforce_retention(now=NOW) == 1
    assert [r["run_id"] for r in StoreReader(path).runs()] == ["current"]  # no row yet, still listed
    store.close()


def _row(r: RequestRecord) -> dict:
    from prefixroute.telemetry.store_schema import record_to_row

    return record_to_row(r)
