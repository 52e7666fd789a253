"""The OTLP backend being down, hung or slow never delays `record()`; memory stays bounded (queue and
retry buffer) and every drop is counted; spans held while the backend is down arrive when it is back;
shutdown returns within its timeout."""

from __future__ import annotations

import socket
import statistics
import threading
import time

import pytest
from prefixroute.telemetry.recorder import TelemetryRecorder
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.tracecontext import child_context
from helpers.waiting import until

pytestmark = pytest.mark.integration

QUEUE = 500
BATCH = 100
RETRY = 1000
NUM_RECORDS = 20_000


class Blackhole:
    """A TCP server that accepts connections and never sends a byte (a hung collector)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.num_accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.num_accepted += 1
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture(params=["closed-port", "blackhole"])
def dead_endpoint(request):
    if request.param == "closed-port":
        yield f"http://127.0.0.1:{closed_port()}", None
    else:
        bh = Blackhole()
        yield f"http://127.0.0.1:{bh.port}", bh
        bh.close()


def test_record_stays_fast_and_bounded_when_the_backend_is_dead(dead_endpoint):
    url, blackhole = dead_endpoint
    recorder = TelemetryRecorder(endpoint=url, timeout_s=2, environ={}, retry_max_spans=RETRY,
                                 max_queue_size=QUEUE, max_export_batch_size=BATCH, schedule_delay_ms=10)
    ctx = child_context(None)
    rec = RequestRecord(trace_id=ctx.trace_id, span_id=ctx.span_id, start_time=time.time(), endpoint="e:1",
                        status=200, ttft_ms=10.0, latency_ms=20.0, prompt_tokens=100, cached_tokens=50)
    durations = []
    t_end = time.monotonic() + 1.5  # keep recording while the worker is stuck in export attempts
    n = 0
    while n < NUM_RECORDS or time.monotonic() < t_end:
        t0 = time.perf_counter()
        recorder.record(rec)
        durations.append(time.perf_counter() - t0)
        n += 1
        if n % 1000 == 0:
            assert recorder.queue_length <= QUEUE and recorder.retry_length <= RETRY  # memory bounded throughout
            time.sleep(0.01)  # let the export thread run, as the event loop would between requests
    med_us = statistics.median(durations) * 1e6
    p99_us = sorted(durations)[int(len(durations) * 0.99)] * 1e6
    assert med_us < 30 and p99_us < 200, (med_us, p99_us)  # measured ~0.2 / ~1 us; margins for a noisy box
    assert recorder.num_exported == 0
    # Everything not queued, held for retry or in the worker's hands was dropped and counted.
    assert n - QUEUE - BATCH - RETRY <= recorder.num_lost <= n
    assert recorder.num_lost + recorder.num_pending == n
    if blackhole is not None:
        assert blackhole.num_accepted >= 1  # the exporter really was talking to the hung server
    t0 = time.monotonic()
    recorder.shutdown(1.0)
    assert time.monotonic() - t0 < 3.5
    assert recorder.num_exported + recorder.num_export_failed + recorder.num_dropped == n


def test_spans_recorded_while_the_receiver_is_down_arrive_when_it_comes_up(receiver_factory):
    """Finding 7: spans made during an outage used to fail (lost, with spans_dropped_total at 0). Now they
    are held and retried with backoff; once a receiver binds the port, they and the later ones arrive."""
    port = closed_port()
    recorder = TelemetryRecorder(endpoint=f"http://127.0.0.1:{port}", timeout_s=1, environ={}, schedule_delay_ms=20)

    def one(request_id: str) -> RequestRecord:
        ctx = child_context(None)
        return RequestRecord(trace_id=ctx.trace_id, span_id=ctx.span_id, start_time=time.time(),
                             request_id=request_id, status=200)

    for i in range(20):
        recorder.record(one(f"while-down-{i}"))
    until(lambda: recorder.retry_length >= 20, 10, message=recorder.stats)
    assert recorder.retry_length == 20 and recorder.num_lost == 0
    time.sleep(2.0)  # lets time pass on purpose: several failed attempts with backoff, and none may lose a span
    assert recorder.num_lost == 0 and recorder.num_exported == 0
    receiver = receiver_factory(port=port)
    for i in range(5):
        recorder.record(one(f"after-up-{i}"))
    assert recorder.force_flush(20), recorder.stats()
    recorder.shutdown(5)
    assert recorder.num_exported == 25 and recorder.num_lost == 0
    receiver.wait_rows(25)
    _, rows = receiver.api("/api/recent?limit=100")
    assert sorted(r["request_id"] for r in rows) == sorted([f"while-down-{i}" for i in range(20)]
                                                           + [f"after-up-{i}" for i in range(5)])


def test_oversized_batches_are_split_and_huge_attributes_capped(receiver_factory):
    """Finding 7: attributes were not capped and a batch over the receiver's message limit failed whole,
    taking the good spans with it. Here: a receiver accepting at most 64 KiB per request, spans of ~3 KB
    (every string attribute at its cap) in 64-span requests (~190 KB), plus 1 MB model names."""
    r = receiver_factory("--max-message-bytes", str(64 * 1024))
    recorder = TelemetryRecorder(endpoint=r.otlp_url, environ={}, schedule_delay_ms=20, max_export_batch_size=512)
    n = 300
    for i in range(n):
        ctx = child_context(None)
        recorder.record(RequestRecord(
            trace_id=ctx.trace_id, span_id=ctx.span_id, start_time=time.time(), request_id=f"big-{i}-" + "r" * 600,
            model=("m" * 1_000_000) if i % 10 == 0 else "x" * 600, path="/v1/chat/completions" + "p" * 600,
            endpoint="e" * 600 + ":8000", endpoints=tuple(f"10.0.0.{j}:8000" for j in range(40)),
            error="y" * 600, status=503))
    assert recorder.force_flush(30), recorder.stats()
    recorder.shutdown(5)
    assert recorder.num_exported == n and recorder.num_lost == 0, recorder.stats()
    assert r.wait_rows(n)["num_requests"] == n  # every span stored once
