"""The router's /metrics server (common/metrics_http.py) over loopback: prometheus_client's answers, within its
bounds (connections, header size and lines, time, one rendering at a time shared by the scrapes that arrived
before it began). The router under a flood of them: tests/integration/reliability/test_port_hardening.py."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily

from prefixroute import metrics_http
from prefixroute.metrics_http import MAX_CONNECTIONS, MAX_HEAD_BYTES, MetricsHttpServer, start_metrics_http_server

pytestmark = pytest.mark.integration


class SlowCounter:
    """A collector whose rendering takes `delay_s` and counts itself (`renders`, also its value)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.renders = 0

    def describe(self) -> list:
        return []

    def collect(self):  # noqa: ANN201
        self.renders += 1
        time.sleep(self.delay_s)
        yield CounterMetricFamily("test_renders", "renderings so far", value=self.renders)


@pytest.fixture
def served() -> Iterator[tuple[MetricsHttpServer, SlowCounter]]:
    registry = CollectorRegistry()
    counter = SlowCounter(0.05)
    registry.register(counter)
    server = start_metrics_http_server(make_wsgi_app(registry), 0)
    try:
        yield server, counter
    finally:
        server.shutdown()
        server.server_close()


def raw(port: int, data: bytes, timeout_s: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def value(answer: bytes) -> float:
    line = next(ln for ln in answer.decode().splitlines() if ln.startswith("test_renders_total"))
    return float(line.split()[1])


def test_answers_are_prometheus_clients(served) -> None:  # noqa: ANN001
    server, _ = served
    port = server.server_address[1]
    out = raw(port, b"GET /metrics HTTP/1.1\r\nhost: m\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200 ") and b"test_renders_total" in out and b"Connection: close" in out
    assert b"Content-Encoding: gzip" in raw(port, b"GET /metrics HTTP/1.1\r\naccept-encoding: gzip\r\n\r\n")
    head = raw(port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")
    assert raw(port, b"OPTIONS /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 200 ")
    assert raw(port, b"POST /metrics HTTP/1.1\r\ncontent-length: 3\r\n\r\nabc").startswith(b"HTTP/1.1 405 ")
    assert raw(port, b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    only = raw(port, b"GET /metrics?name[]=nothing_such HTTP/1.1\r\n\r\n")
    assert only.startswith(b"HTTP/1.1 200 ") and b"test_renders" not in only


def test_headers_over_the_limits_get_431(served) -> None:  # noqa: ANN001
    server, _ = served
    port = server.server_address[1]
    big = raw(port, b"GET /metrics HTTP/1.1\r\nx-big: " + b"a" * (MAX_HEAD_BYTES + 10) + b"\r\n\r\n")
    assert big.startswith(b"HTTP/1.1 431 ")
    many = raw(port, b"GET /metrics HTTP/1.1\r\n" + b"x: y\r\n" * (metrics_http.MAX_HEADERS + 1) + b"\r\n")
    assert many.startswith(b"HTTP/1.1 431 ")
    assert server.num_refused_requests == 2


def test_concurrent_scrapes_share_a_fresh_rendering(served) -> None:  # noqa: ANN001
    """32 scrapes at once against a 50 ms rendering: far fewer renderings than scrapes (one at a time, shared),
    and each answer rendered after its scrape arrived (its value at least what the counter was then)."""
    server, counter = served
    port = server.server_address[1]
    answers: list[tuple[int, bytes]] = []

    def scrape() -> None:
        before = counter.renders
        answers.append((before, raw(port, b"GET /metrics HTTP/1.1\r\n\r\n")))

    threads = [threading.Thread(target=scrape) for _ in range(MAX_CONNECTIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == MAX_CONNECTIONS and all(a.startswith(b"HTTP/1.1 200 ") for _, a in answers)
    assert all(value(a) > before for before, a in answers)  # rendered after the scrape arrived
    assert counter.renders <= MAX_CONNECTIONS // 2, counter.renders


def test_stalled_clients_cannot_keep_a_scraper_out_and_are_timed_out(served, monkeypatch) -> None:  # noqa: ANN001
    server, _ = served
    port = server.server_address[1]
    monkeypatch.setattr(metrics_http, "REQUEST_TIMEOUT_S", 1.0)
    stalled = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(MAX_CONNECTIONS + 8)]
    for s in stalled:
        s.sendall(b"GET /metrics HTTP/1.1\r\nx-slow: ")
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        assert raw(port, b"GET /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 200 ")
        assert time.monotonic() - t0 < 1.0
        assert server.num_active <= MAX_CONNECTIONS + 1
        time.sleep(1.5)
        for s in stalled:  # every one closed by now: evicted, or past its time
            s.settimeout(1)
            assert s.recv(100) == b""
        assert server.num_active == 0
    finally:
        for s in stalled:
            s.close()
