"""The Streamlit app under AppTest where it talks over HTTP: a real receiver's query API, the router's /metrics,
an unreachable receiver, and forged rows naming a canary server that must get no request."""

from __future__ import annotations

import socket
import time

import pytest

from helpers.dashboard import (ENDPOINTS, app_records as make_records, endpoint_table, metric, run_app, shown,
                               texts, write)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("dashboard_env")]  # conftest.py


def test_unreachable_receiver_url_is_explained(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_TELEMETRY", f"http://127.0.0.1:{port}")
    at = run_app()
    assert not at.exception
    assert "Telemetry receiver not reachable" in texts(at)


def test_live_page_over_the_receiver_http_api(tmp_path, monkeypatch):
    from contextlib import ExitStack

    from helpers.realrun import start_receiver

    db = tmp_path / "t.db"
    records = make_records(120)
    write(db, records, run_id="run-1")
    # The receiver continues that run (as `prefixroute up` restarts one with its --run-id).
    monkeypatch.setenv("PREFIXROUTE_TELEMETRY_RUN_ID", "run-1")
    with ExitStack() as stack:
        _, http_port = start_receiver(stack, db, tmp_path / "logs")  # a real `prefixroute telemetry` process
        monkeypatch.setenv("PREFIXROUTE_DASHBOARD_TELEMETRY", f"http://127.0.0.1:{http_port}")
        at = run_app()
        assert not at.exception
        hit = sum(r.cached_tokens for r in records) / sum(r.prompt_tokens for r in records)
        assert metric(at, "Hit rate (actual)") == f"{hit * 100:.1f} %"
        assert sorted(endpoint_table(at).index) == sorted(ENDPOINTS)
        assert "Mean in-flight needs the SQLite store" in texts(at)


class Canary:
    """A loopback HTTP server that counts every request (the dashboard must send it none)."""

    def __init__(self) -> None:
        import http.server
        import threading

        hits = self.hits = []

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                hits.append(self.path)
                body = b'vllm:kv_cache_usage_perc 0.99\n'
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_forged_rows_naming_a_canary_make_the_dashboard_fetch_nothing(tmp_path, monkeypatch):
    """Finding 3 (SSRF): rows name endpoints (span data anyone able to reach the receiver can write); the
    dashboard rendered them and then fetched http://ENDPOINT/metrics for each. Now it opens no URL from
    span data, with its default settings and with a router metrics URL configured."""
    canary = Canary()
    try:
        db = tmp_path / "t.db"
        forged = make_records(200)
        for i, r in enumerate(forged):
            r.endpoint = canary.endpoint if i % 2 else f"127.0.0.1:{canary.server.server_address[1]}/x?"
            r.endpoints = (canary.endpoint,)
        write(db, forged)
        monkeypatch.setenv("PREFIXROUTE_DASHBOARD_DB", str(db))
        at = run_app()
        assert not at.exception
        assert metric(at, "Hit rate (actual)") != "–"  # the page rendered the forged rows
        assert canary.endpoint in list(endpoint_table(at).index)
        at.run()  # a refresh
        time.sleep(0.5)  # lets time pass on purpose: a background fetch would have arrived by now
        assert canary.hits == []
    finally:
        canary.close()


def test_live_columns_come_from_the_router_metrics(tmp_path, monkeypatch):
    from prefixroute.types import EndpointState
    from prefixroute.telemetry.metrics import RouterMetrics, start_metrics_server

    states = tuple(EndpointState(ep, healthy=True, kv_cache_usage_ratio=0.25 * (i + 1), num_requests_running=i,
                                 num_requests_waiting=0) for i, ep in enumerate(ENDPOINTS))
    server = start_metrics_server(RouterMetrics(endpoint_states=lambda: states), 0)
    try:
        db = tmp_path / "t.db"
        write(db, make_records(100))
        monkeypatch.setenv("PREFIXROUTE_DASHBOARD_DB", str(db))
        monkeypatch.setenv("PREFIXROUTE_DASHBOARD_ROUTER_METRICS_URL",
                           f"http://127.0.0.1:{server.server_address[1]}/metrics")
        at = run_app()
        assert not at.exception
        table = endpoint_table(at, 1)
        for i, ep in enumerate(ENDPOINTS):
            assert table.loc[ep, "KV usage"] == shown(f"{25.0 * (i + 1):.1f} %")
            assert table.loc[ep, "running"] == str(i) and table.loc[ep, "healthy"] == "yes"
    finally:
        server.shutdown()
        server.server_close()
