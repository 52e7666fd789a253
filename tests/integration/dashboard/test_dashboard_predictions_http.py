"""The "Predicted vs actual TTFT per endpoint" panel's data over HTTP: the SQLite file and a real receiver's query
API give the same figures, and an older receiver without the route gives none, not an error."""

from __future__ import annotations

import http.server
import threading
import time
from contextlib import ExitStack

import pytest

from helpers.dashboard import expected_predictions as expected, prediction_records as make_records, write
from prefixroute.dashboard.source import DataSource

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("dashboard_env")]  # conftest.py


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
