"""Benchmark the telemetry hot path and the export thread's cost (not a test; prints figures).

    python -m prefixroute.bench.recorder [--n 100000] [--rps 500 --seconds 3]

Prints, per request: `TelemetryRecorder.record` (request path), `child_context` (request path),
`RouterMetrics.observe_decision + observe_response` (request path), and on the export thread the
record -> OTLP encoding (the fast encoder, and the SDK's); for comparison, an SDK tracer span with the same
attributes (what record() would cost if it built spans itself). With ``--rps`` it also measures the
asyncio loop's wake-up lag (p50/p99 overshoot of a 1 ms sleep) with and without a recorder exporting
that many records per second to a receiver process, i.e. what the export thread's GIL use
costs the event loop that carries the token stream.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import tempfile
import time

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from prefixroute.types import Decision
from prefixroute.procs import parent_death_preexec
from prefixroute.telemetry.metrics import RouterMetrics
from prefixroute.telemetry.record_spans import record_attributes
from prefixroute.telemetry.recorder import TelemetryRecorder
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.tracecontext import child_context


class _NullExporter(SpanExporter):
    def export(self, spans):  # noqa: ANN001, ANN201
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def sample_record() -> RequestRecord:
    ctx = child_context("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    return RequestRecord(trace_id=ctx.trace_id, span_id=ctx.span_id, parent_span_id=ctx.parent_span_id,
                         start_time=time.time(), request_id="7d3c9a6e-1f", model="llama-3.1-8b", tenant_hash="9f2c",
                         policy="prefix", reason="affinity", endpoint="127.0.0.1:8001",
                         endpoints=("127.0.0.1:8001", "127.0.0.1:8002"), matched_blocks=12, total_blocks=16,
                         predicted_hit_ratio=0.75, decision_us=38.0, ttft_ms=41.5, latency_ms=900.0,
                         prompt_tokens=4096, completion_tokens=128, cached_tokens=3072, stream=True, status=200,
                         path="/v1/chat/completions")


def per_call_us(fn, n: int) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def hot_path(n: int) -> dict[str, float]:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    rec = sample_record()
    r = TelemetryRecorder(exporter=_NullExporter(), environ={}, max_queue_size=n + 1, max_export_batch_size=n + 1,
                          schedule_delay_ms=10**7)
    out = {"record_us": per_call_us(lambda: r.record(rec), n)}
    r.shutdown(0.1)
    tp_header = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    out["child_context_us"] = per_call_us(lambda: child_context(tp_header), n)
    m = RouterMetrics()
    d = Decision(("127.0.0.1:8001", "127.0.0.1:8002"), "affinity", "prefix", 12, 16, 0.75)
    out["metrics_us"] = per_call_us(lambda: (m.observe_decision(d, 38.0), m.observe_response(rec)), n // 4)
    k = max(1000, n // 20)
    sdk_side = TelemetryRecorder(exporter=_NullExporter(), environ={})
    t0 = time.perf_counter()
    encode_spans([sdk_side._factory.span(rec) for _ in range(k)])
    out["export_thread_sdk_encode_us"] = (time.perf_counter() - t0) / k * 1e6
    sdk_side.shutdown(0.1)
    fast = TelemetryRecorder(environ={}, endpoint="http://127.0.0.1:1")  # never exports here
    batch = [rec] * k
    t0 = time.perf_counter()
    fast._encode(batch)
    out["export_thread_fast_encode_us"] = (time.perf_counter() - t0) / k * 1e6
    fast.shutdown(0.1)
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(_NullExporter(), max_queue_size=max(k + 1, 1024),
                                             schedule_delay_millis=10**7))
    tracer = tp.get_tracer("bench")
    attrs = record_attributes(rec)

    def sdk_span() -> None:
        tracer.start_span("prefixroute.route", kind=trace.SpanKind.SERVER, start_time=1, attributes=attrs).end(2)

    out["sdk_span_on_request_path_us"] = per_call_us(sdk_span, k)
    tp.shutdown()
    return out


async def _loop_lag(seconds: float, rps: float, recorder: TelemetryRecorder | None) -> list[float]:
    lags: list[float] = []
    rec = sample_record()
    t_end = time.perf_counter() + seconds
    next_rec = time.perf_counter()
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append((time.perf_counter() - t0 - 0.001) * 1e3)
        if recorder is not None:
            now = time.perf_counter()
            while next_rec <= now:
                recorder.record(rec)
                next_rec += 1.0 / rps
    return lags


async def loop_lag(rps: float, seconds: float) -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        # The receiver runs in its own process, as deployed, so only the router side's cost is measured.
        receiver = subprocess.Popen([sys.executable, "-m", "prefixroute", "telemetry", "--port", "0",
                                     "--http-port", "-1", "--db", f"{d}/bench.db"],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                    preexec_fn=parent_death_preexec())
        try:
            port = int(re.search(r"OTLP/gRPC on [\d.]+:(\d+)", receiver.stdout.readline()).group(1))
            base = await _loop_lag(seconds, rps, None)
            r = TelemetryRecorder(endpoint=f"http://127.0.0.1:{port}", environ={})
            withrec = await _loop_lag(seconds, rps, r)
            r.shutdown(5)
            out["exported"] = r.num_exported
            out["dropped"] = r.num_dropped
        finally:
            receiver.terminate()
            receiver.wait(10)
    for name, lags in (("baseline", base), ("with_recorder", withrec)):
        lags.sort()
        out[f"{name}_lag_ms_p50"] = statistics.median(lags)
        out[f"{name}_lag_ms_p99"] = lags[int(len(lags) * 0.99)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="calls per hot-path figure")
    ap.add_argument("--rps", type=float, default=0, help="also measure event-loop lag at this record rate")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args(argv)
    figs = hot_path(args.n)
    for k, v in figs.items():
        print(f"{k:32s} {v:9.2f}")
    print(f"{'sdk_span / record ratio':32s} {figs['sdk_span_on_request_path_us'] / figs['record_us']:9.0f}x")
    if args.rps:
        for k, v in asyncio.run(loop_lag(args.rps, args.seconds)).items():
            print(f"{k:32s} {v:9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
