#!/usr/bin/env python3
"""The router's own work per request, in process: no gRPC, no Envoy.

`scripts/profile_extproc.py` measures the live ext_proc process, where grpcio's C core, the event loop and the
router's Python share one profile and the machine's noise. This script takes the router's part alone: the same
objects `prefixroute extproc` builds (its pool, router, telemetry with spans on, tracker and facts receiver, each
from its default settings), driven the way Envoy drives them on the facts path, one request after another:

1. the routing stream's request headers message (parsed from wire bytes, answered, the answer serialized);
2. its request body message (a chat request of --prompt-kb KB: parse, hash, index, schedule, the answer with
   the request's traceparent);
3. the stream's end (the pick released);
4. Envoy's facts record for it (an OTLP ``ExportLogsServiceRequest`` parsed from wire bytes: correlated, the
   usage learned, the record emitted to the metrics and the span exporter).

Building the facts record's bytes is Envoy's work and is done before the timed rounds. The pool watches one
local fast upstream (its /metrics and /health), as in `prefixroute overhead-bench`. The CPU figure is the
process's (all threads: the span exporter's included) over --num-rounds rounds of --num-requests requests;
best and median are printed. ``--profile`` samples the same loop with py-spy (``pip install py-spy``) and prints
the functions with the most samples, inclusive and self.

    .venv/bin/python scripts/profile_router_path.py --prompt-kb 4,64
    .venv/bin/python scripts/profile_router_path.py --prompt-kb 4 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs

from prefixroute.bench.overhead import _body, _detached, _wait_listening
from prefixroute.extproc import wire
from prefixroute.extproc.cli import _telemetry_for
from prefixroute.extproc.endpoints.pool import EndpointPool
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.envoy_facts import FactsReceiver
from prefixroute.extproc.factory import build_router
from prefixroute.extproc.facts_fields import FACTS_MARK, OBSERVED_FACTS
from prefixroute.extproc.headers import OBSERVED_METADATA
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.servicer import ExtProcServicer, RoutingStream
from prefixroute.procs import free_port, stop_group
from prefixroute.telemetry.router import RouterTelemetrySettings

USAGE = '"usage":{"prompt_tokens":1000,"completion_tokens":16,"prompt_tokens_details":{"cached_tokens":992}}}'
"""The usage text Envoy's Lua filter takes from a chat response's end (facts_fields.USAGE_KEY)."""


def _header(key: str, value: str) -> object:
    return wire.HeaderValue(key=key, raw_value=value.encode())


def _facts_record(traceparent: str, upstream: str) -> bytes:
    """Envoy's facts record for one request, as wire bytes (envoy_config/facts.py: FACTS_ATTRIBUTES)."""
    values = {FACTS_MARK: "1", "tp": traceparent, "status": "200", "upstream": upstream, "ctype": "application/json",
              "ttft_us": "900", "duration_us": "1000", "start": f"{time.time():.6f}", "first_token_us": "-",
              "usage": USAGE, "response_id": "-"}
    record = LogRecord(attributes=[KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in values.items()])
    return ExportLogsServiceRequest(resource_logs=[ResourceLogs(scope_logs=[ScopeLogs(log_records=[record])])]
                                    ).SerializeToString()


@dataclass
class Rig:
    route_one: Callable[[], None]
    """One request's routing stream: headers, body, end."""
    facts_bytes: Callable[[int], list[bytes]]
    """Envoy's facts records (wire bytes) of the last N routed requests."""
    export: Callable[[Any], None]
    """The facts receiver's `export` (what its LogsService.Export calls)."""
    counts: Callable[[], dict[str, int]]
    """The facts receiver's outcomes (matched, unmatched, missing)."""
    close: Callable[[], Awaitable[None]]


async def _rig(endpoint: str, prompt_kb: int) -> Rig:
    """The ext_proc's objects as `extproc.cli.serve` builds them, telemetry on with spans exported to a closed
    port (dropped after encoding, as in overhead-bench)."""
    routing = RoutingSettings()
    pool = EndpointPool(PoolSettings(endpoints=(endpoint,)))
    router = build_router(routing, pool)
    telemetry, tracker = _telemetry_for(router, pool, None, None, routing,  # type: ignore[arg-type]
                                        RouterTelemetrySettings(metrics_port=-1,
                                                                otlp_endpoint=f"http://127.0.0.1:{free_port()}"))
    await pool.start()
    if not await pool.wait_ready(10):
        raise SystemExit(f"the fast upstream at {endpoint} did not come up")
    facts = FactsReceiver(tracker, router.served)
    servicer = ExtProcServicer(router, tracker)
    body = _body(prompt_kb * 1024)
    headers = [_header(k, v) for k, v in ((":method", "POST"), (":path", "/v1/chat/completions"),
                                          (":authority", "localhost"), (":scheme", "http"),
                                          ("content-type", "application/json"), ("content-length", str(len(body))),
                                          ("user-agent", "bench"), ("x-forwarded-proto", "http"),
                                          ("x-request-id", "6f1d1c9e-0b0e-4b1a-9a7e-13c1d2a1b0f1"))]
    head_msg = wire.ProcessingRequest(
        request_headers=wire.HttpHeaders(headers=wire.HeaderMap(headers=headers))).SerializeToString()
    body_msg = wire.ProcessingRequest(request_body=wire.HttpBody(body=body, end_of_stream=True)).SerializeToString()
    parse = wire.ProcessingRequest.FromString
    metadata = [(OBSERVED_METADATA, OBSERVED_FACTS)]
    traceparents: list[str] = []

    def route_one() -> None:
        stream = RoutingStream(servicer, lambda: metadata)
        wire.serialize(stream.request_headers(parse(head_msg)))
        wire.serialize(stream.request_body(parse(body_msg)))
        ex = stream.ex
        if ex.pick is not None:
            router.release(ex.pick)
        tracker.routing_closed(ex.st)
        traceparents.append(ex.traceparent or "")

    def facts_bytes(num: int) -> list[bytes]:
        out = [_facts_record(tp, endpoint) for tp in traceparents[-num:]]
        traceparents.clear()
        return out

    async def close() -> None:
        await pool.close()
        telemetry.close(1.0)

    return Rig(route_one, facts_bytes, facts.export, facts.counts, close)


def _run(rig: Rig, num: int) -> float:
    """CPU seconds (this process, all threads) of `num` requests: routing streams, then their facts records
    (each record is built beforehand: that is Envoy's work). Records come after their streams closed, as on
    the facts path, where Envoy logs a request at its end."""
    parse = ExportLogsServiceRequest.FromString
    cpu = 0.0
    batch = 100  # records wait for their streams; bounded so the tracker's pending set stays small
    for start in range(0, num, batch):
        n = min(batch, num - start)
        c0 = time.process_time()
        for _ in range(n):
            rig.route_one()
        cpu += time.process_time() - c0
        records = rig.facts_bytes(n)
        c0 = time.process_time()
        for data in records:
            rig.export(parse(data))
        cpu += time.process_time() - c0
    return cpu


async def measure(prompt_kb: int, num_requests: int, num_rounds: int, endpoint: str) -> list[float]:
    rig = await _rig(endpoint, prompt_kb)
    try:
        _run(rig, 300)  # warm: caches, learned rates, the index's prefix
        # As `extproc.cli.serve` leaves the GC once started.
        gc.collect()
        gc.freeze()
        gc.set_threshold(20_000, 20, 100)
        rounds = [_run(rig, num_requests) / num_requests * 1e6 for _ in range(num_rounds)]
        counts = rig.counts()
        if counts["matched"] != 300 + num_rounds * num_requests or counts["unmatched"] or counts["missing"]:
            # A record that found no pick was not the work being measured.
            raise SystemExit(f"facts records did not all match their picks: {counts}")
        return rounds
    finally:
        await rig.close()


def _event_loop_run(coro: Awaitable[list[float]]) -> list[float]:
    """Run on uvloop where installed, as the ext_proc does."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    return uvloop.run(coro)  # type: ignore[arg-type]


def _frame_name(frame: str) -> str:
    """py-spy's "function (path/file.py:line)" as "function (file.py" (lines merged, directories dropped)."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1].split(':')[0]}"


def _profile(args: argparse.Namespace, endpoint: str) -> None:
    """Re-run this script's measuring loop under py-spy and print the top functions (inclusive and self)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        raise SystemExit("py-spy is not installed: pip install py-spy (the 'profile' extra)")
    out = Path(tempfile.mkdtemp(prefix="prefixroute-router-path-")) / "stacks.txt"
    kb = args.prompt_kb.split(",")[0]
    subprocess.run([spy, "record", "--rate", "1000", "--format", "raw", "--output", str(out), "--", sys.executable,
                    __file__, "--prompt-kb", kb, "--num-requests", str(args.num_requests), "--num-rounds", "3",
                    "--endpoint", endpoint], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in out.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [_frame_name(f) for f in stack.split(";")]
        start = next((i for i, f in enumerate(frames) if f == "_run (profile_router_path.py"), None)
        if not count.isdigit() or start is None or "_rig.<locals>.facts_bytes (profile_router_path.py" in frames:
            continue  # another thread (the span exporter's), before the measured loop, or Envoy's part (untimed)
        frames = frames[start + 1:]
        total += int(count)
        for f in set(frames):
            inclusive[f] += int(count)
        if frames:
            own[frames[-1]] += int(count)
    print(f"py-spy, {kb} KB, {total} samples in the measured loop ({out}): inclusive")
    for name, n in inclusive.most_common(args.num_top):
        print(f"{n / total:7.1%}  {name})")
    print("self")
    for name, n in own.most_common(args.num_top):
        print(f"{n / total:7.1%}  {name})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-kb", default="4,64", help="comma-separated prompt sizes")
    parser.add_argument("--num-requests", type=int, default=2000, help="requests per round")
    parser.add_argument("--num-rounds", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="py-spy the loop (first prompt size) instead")
    parser.add_argument("--num-top", type=int, default=40)
    parser.add_argument("--endpoint", default="", help="a fast upstream already running (default: start one)")
    args = parser.parse_args()
    upstream = None
    endpoint = args.endpoint
    if not endpoint:
        port = free_port()
        upstream = _detached([sys.executable, "-m", "prefixroute.bench.fast_upstream", str(port), "5"])
        _wait_listening(port, upstream, "fast upstream did not start", timeout_s=10)
        endpoint = f"127.0.0.1:{port}"
    try:
        if args.profile:
            _profile(args, endpoint)
            return 0
        print(f"router path in process (facts path, telemetry on), {args.num_rounds} rounds x {args.num_requests} "
              f"requests, load average {os.getloadavg()[0]:.2f}")
        for kb in (int(k) for k in args.prompt_kb.split(",")):
            rounds = sorted(_event_loop_run(measure(kb, args.num_requests, args.num_rounds, endpoint)))
            print(f"{kb:>4} KB: CPU per request best {rounds[0]:.1f} us, median {rounds[len(rounds) // 2]:.1f} us")
    finally:
        if upstream is not None:
            stop_group(upstream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
