"""The query API bounds what one query returns (telemetry/http_api.py): /api/requests?since_s= answered every row
of its window, so one caller with a wide window made the receiver build a JSON array of the whole store."""

from __future__ import annotations

import pytest

from prefixroute.telemetry import http_api
from prefixroute.telemetry.http_api import _BadRequest, query
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.store import TelemetryStore
from prefixroute.telemetry.store_reader import StoreReader

NOW = 1_800_000_000.0


def test_requests_of_a_window_are_at_most_limit_rows_oldest_first(tmp_path, monkeypatch) -> None:
    path = tmp_path / "t.db"
    store = TelemetryStore(path)
    store.insert_records([RequestRecord(trace_id=f"{i + 1:032x}", span_id=f"{i + 1:016x}", start_time=NOW - 50 + i,
                                        endpoint="e:1", status=200) for i in range(30)])
    store.close()
    reader = StoreReader(path)
    monkeypatch.setattr(http_api, "MAX_ROWS", 10)
    rows = query(reader, "/api/requests", {"since_s": ["3600"], "now": [str(NOW)]})
    assert len(rows) == 10  # main: 30, whatever the window held
    starts = [r["start_time"] for r in rows]
    assert starts == sorted(starts) and starts[0] == NOW - 50  # the oldest first
    assert len(query(reader, "/api/requests", {"since_s": ["3600"], "now": [str(NOW)], "limit": ["4"]})) == 4
    for bad in ("0", "11"):
        with pytest.raises(_BadRequest):
            query(reader, "/api/requests", {"since_s": ["3600"], "limit": [bad]})
    assert len(list(reader.iter_requests(3600, now=NOW))) == 30  # `prefixroute telemetry dump` reads the file
