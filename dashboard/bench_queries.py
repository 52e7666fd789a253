"""Measure what one live refresh costs the database: `python -m prefixroute.dashboard.bench_queries`.

Builds a synthetic store (or reads --db) with --rate-per-min requests over --span-s seconds, then times
`DataSource.live_snapshot` (every query of one refresh) for several windows. Prints milliseconds per
refresh, rows in the window and rows per millisecond, so figures from noisy machines compare as ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from prefixroute.dashboard.source import DataSource
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.store import TelemetryStore


def fill(db: Path, rate_per_min: float, span_s: float, now: float, seed: int = 1) -> int:
    rnd = random.Random(seed)
    n = int(rate_per_min * span_s / 60)
    endpoints = [f"127.0.0.1:{8001 + i}" for i in range(4)]
    store = TelemetryStore(db, max_rows=0, max_age_s=0)
    batch = []
    for i in range(n):
        prompt = rnd.randint(100, 9000)
        cached = int(prompt * rnd.random())
        ttft = rnd.lognormvariate(4, 0.6)
        ep = rnd.choice(endpoints)
        batch.append(RequestRecord(
            trace_id=f"{rnd.getrandbits(128):032x}", span_id=f"{rnd.getrandbits(64):016x}",
            start_time=now - span_s * rnd.random(), endpoint=ep, endpoints=(ep,), policy="prefix",
            reason=rnd.choice(("affinity", "affinity", "cold", "spill")), predicted_hit_ratio=cached / prompt,
            decision_us=rnd.uniform(20, 300), ttft_ms=ttft, latency_ms=ttft + rnd.uniform(50, 800),
            prompt_tokens=prompt, cached_tokens=cached, completion_tokens=32, status=200, stream=True,
            model="meta-llama/Llama-3.1-8B-Instruct", path="/v1/chat/completions"))
        if len(batch) >= 5000:
            store.insert_records(batch)
            batch = []
    store.insert_records(batch)
    store.close()
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", help="Existing store to measure (default: a synthetic one in a temp dir).")
    ap.add_argument("--rate-per-min", type=float, default=3000.0, help="Synthetic requests per minute.")
    ap.add_argument("--span-s", type=float, default=900.0, help="Synthetic store spans this many seconds.")
    ap.add_argument("--windows", default="60,300,900", help="Windows to time, seconds, comma-separated.")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    now = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(args.db) if args.db else Path(tmp) / "bench.db"
        if not args.db:
            n = fill(db, args.rate_per_min, args.span_s, now)
            print(f"synthetic store: {n:,} requests ({args.rate_per_min:,.0f}/min over {args.span_s:,.0f} s)")
        src = DataSource(db=str(db))
        for w in (float(x) for x in args.windows.split(",")):
            times = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                snap = src.live_snapshot(w, now=now)
                times.append((time.perf_counter() - t) * 1000)
            rows = snap["summary"]["num_requests"]
            med = statistics.median(times)
            print(f"window {w:>6,.0f} s: {rows:>7,} rows  refresh median {med:7.1f} ms  "
                  f"(min {min(times):.1f})  {rows / med if med else 0:,.0f} rows/ms")
        src.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
