"""The dashboard's data source over HTTP: a receiver URL nobody listens on, and the router's /metrics read from
the one configured URL only (never one named in span data)."""

from __future__ import annotations

import http.server
import threading

import pytest

from prefixroute.dashboard.source import DataSource
from prefixroute.telemetry.client import TelemetryUnavailable

pytestmark = pytest.mark.integration


def test_url_source_down_raises_unavailable():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = DataSource(url=f"http://127.0.0.1:{port}", http_timeout_s=1.0)
    with pytest.raises(TelemetryUnavailable):
        src.query(lambda q: q.summary(60.0))


class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    body = b""
    hits: list = []

    def do_GET(self):  # noqa: N802
        self.hits.append(self.path)
        if self.path != "/metrics":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("content-type", "text/plain; version=0.0.4")
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def serve(body: bytes):
    handler = type("H", (_MetricsHandler,), {"body": body, "hits": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, handler


def test_endpoint_live_reads_only_the_configured_router_metrics():
    from prometheus_client import generate_latest

    from prefixroute.types import EndpointState
    from prefixroute.telemetry.metrics import RouterMetrics

    m = RouterMetrics(endpoint_states=lambda: (EndpointState("10.0.0.1:8000", kv_cache_usage_ratio=0.7,
                                                             num_requests_running=5),))
    server, handler = serve(generate_latest(m.registry))
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        got = DataSource(db="unused.db", router_metrics_url=url, metrics_timeout_s=1.0).endpoint_live()
        assert got["10.0.0.1:8000"].kv_cache_usage_ratio == 0.7 and got["10.0.0.1:8000"].num_requests_running == 5
        assert got["10.0.0.1:8000"].healthy is True
        assert DataSource(db="unused.db").endpoint_live() == {}  # not configured: no request at all
        assert len(handler.hits) == 1
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}/metrics"
        assert DataSource(db="unused.db", router_metrics_url=dead).endpoint_live() == {}
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ValueError):
        DataSource(db="unused.db", router_metrics_url="file:///etc/passwd")
