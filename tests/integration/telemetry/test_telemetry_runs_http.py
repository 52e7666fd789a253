"""The receiver's query API and its client serve the store's runs and a run's requests over HTTP."""

from __future__ import annotations

import pytest

from prefixroute.telemetry.client import HttpStoreClient
from prefixroute.telemetry.http_api import start_http_api
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.store import TelemetryStore
from prefixroute.telemetry.store_reader import StoreReader

pytestmark = pytest.mark.integration

NOW = 1_800_000_000.0


def rec(i: int, start_time: float, endpoint: str = "10.0.0.1:8000") -> RequestRecord:
    return RequestRecord(trace_id=f"{i:032x}", span_id=f"{i:016x}", start_time=start_time, endpoint=endpoint,
                         endpoints=(endpoint,), status=200, ttft_ms=10.0, latency_ms=20.0)


def test_http_api_and_client_serve_the_runs(tmp_path):
    path = tmp_path / "t.db"
    store = TelemetryStore(path, run_id="run-a")
    store.insert_records([rec(1, NOW - 5), rec(2, NOW - 3, endpoint="10.0.0.2:8000")])
    store.close()
    server = start_http_api(str(path), "127.0.0.1", 0)
    try:
        client = HttpStoreClient(f"http://127.0.0.1:{server.server_address[1]}")
        assert client.runs() == StoreReader(path).runs()
        assert [r["trace_id"] for r in client.recent_requests(5, run_id="run-a")] == [f"{2:032x}", f"{1:032x}"]
        assert client.recent_requests(5, run_id="other") == []
    finally:
        server.shutdown()
        server.server_close()
