#!/usr/bin/env python3
"""Per-request CPU profile of the ext_proc process, by layer.

Starts the gateway stack as `prefixroute overhead-bench` does (fast upstream, Envoy + `prefixroute extproc`
with the real router, telemetry on unless --no-telemetry), warms it, then drives --num-requests sequential
requests on one keep-alive connection while py-spy samples the ext_proc process (all threads, native frames,
idle threads excluded). Each sample's stack is put in one layer: the innermost frame that matches a layer's
pattern decides (a hash called from the scheduler is "hash"; a gRPC read awaited by the servicer is "gRPC").
The CPU per request comes from /proc (the process's user + system time over the driven requests); a layer's
share of the samples times that gives its microseconds per request.

Needs py-spy (`pip install py-spy`, the `profile` extra) and permission to ptrace the process (same user;
in a container, CAP_SYS_PTRACE or kernel.yama.ptrace_scope <= 1).

    .venv/bin/python scripts/profile_extproc.py --prompt-kb 4 --num-requests 3000
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from prefixroute.bench.http_load import build_request, latency_ms
from prefixroute.bench.overhead import _body, _cpu_s, _detached, _facts_overrides, _span_sink_args, _wait_listening
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.procs import free_port, stop_group

LAYERS: list[tuple[str, re.Pattern[str]]] = [(name, re.compile(pattern)) for name, pattern in [
    ("telemetry", r"extproc/tracking\.py|/telemetry/|opentelemetry|tracecontext"),
    ("tokenize", r"tokenizers|tiktoken|prompt_tokenizer|routing/tokens\.py"),
    ("hash", r"routing/hashing\.py|xxhash"),
    ("index", r"prefix_index\.py|index_sources\.py"),
    ("pool", r"extproc/endpoints/|extproc/lifecycle"),
    ("flow", r"extproc/flow/"),
    ("schedule", r"routing/scheduling/|routing/router\.py|timemodel\.py|ttft_learner\.py|sessions\.py|"
                 r"tier_pricing\.py"),
    ("parse", r"routing/request[a-z_]*\.py|orjson|responses_prompt\.py|parse_offload\.py"),
    ("peers", r"extproc/peers/|nats/"),
    ("protobuf", r"google/protobuf|_message\.|upb_|FromString|SerializeToString|extproc/wire\.py|"
                 r"extproc/answers\.py"),
    ("servicer", r"extproc/servicer\.py|extproc/gie\.py|extproc/service\.py"),
    ("gRPC", r"grpc"),
    ("event loop", r"uvloop|asyncio|selectors|epoll"),
]]
"""Layer -> pattern over a frame "function (file:line)"; the innermost matching frame wins. Order breaks ties
within one frame only. "gRPC" holds grpcio's Cython and C core (its poller thread included), "event loop" the
loop's own work (uvloop or asyncio) and whatever it runs that matches nothing more specific."""


IDLE = re.compile(r"^(poll|epoll_wait|epoll_pwait|select|pselect6?|clock_nanosleep|nanosleep|pthread_cond_\w*wait|"
                  r"sem_\w*wait|PyThread_acquire_lock_timed|time_sleep|accept4?) \(")
"""A frame that blocks: py-spy's idle detection does not see native waits, so a sample with one of these among
its innermost frames is a thread waiting (the gRPC poller in poll, the loop in epoll_wait, a lock), not CPU."""


def is_idle(frames: list[str]) -> bool:
    return any(IDLE.match(frame) for frame in frames[-4:])


def layer_of(frames: list[str]) -> str:
    """The layer of one stack (frames outermost first)."""
    for frame in reversed(frames):
        for name, pattern in LAYERS:
            if pattern.search(frame):
                return name
    return "other"


def read_collapsed(path: Path) -> Counter[str]:
    """py-spy's raw (collapsed) output -> samples per layer."""
    layers: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if not is_idle(frames):
            layers[layer_of(frames)] += int(count)
    return layers


def top_frames(path: Path, num: int = 25) -> list[tuple[str, int]]:
    """The innermost frames with the most samples (self time), for what the layers do not say."""
    leaves: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit() and not is_idle(frames := stack.split(";")):
            leaves[frames[-1]] += int(count)
    return leaves.most_common(num)


def _py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed: pip install py-spy (the 'profile' extra)")
    return found


def profile(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="prefixroute-profile-"))
    up_port = free_port()
    upstream = _detached([sys.executable, "-m", "prefixroute.bench.fast_upstream", str(up_port), "5"])
    endpoint = f"127.0.0.1:{up_port}"
    try:
        _wait_listening(up_port, upstream, "fast upstream did not start", timeout_s=10)
        gw = GatewayProcesses(
            GatewaySettings(port=free_port(), ports="random", listen_address="127.0.0.1", telemetry=args.telemetry,
                            extproc_replicas=1, embedded_nats=False),
            RoutingSettings(policy=args.policy), PoolSettings(endpoints=(endpoint,)), log_dir=tmp / "gateway",
            envoy_overrides=_facts_overrides() if args.facts else {},
            extra_extproc_args=[*_span_sink_args(), *args.extproc_arg])
        with contextlib.ExitStack() as stack:
            stack.enter_context(gw)
            pid = gw.extprocs[0].pid
            req = build_request("/v1/chat/completions", _body(args.prompt_kb * 1024))
            latency_ms(gw.gateway.port, req, args.num_warmup, num_warmup=0)
            c0 = _cpu_s(pid)  # the CPU per request without the profiler (its sampling pauses the process)
            t0 = time.perf_counter()
            lat = latency_ms(gw.gateway.port, req, args.num_requests, num_warmup=0)
            wall_s = time.perf_counter() - t0
            cpu_s = _cpu_s(pid) - c0
            out = Path(args.out) if args.out else tmp / "profile.txt"
            spy_argv = [_py_spy(), "record", "--pid", str(pid), "--rate", str(args.rate), "--format", "raw",
                        "--output", str(out), *(["--native"] if args.native else [])]
            spy = subprocess.Popen(spy_argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(1.0)  # py-spy attaches
            if spy.poll() is not None:
                raise SystemExit(f"py-spy failed: {spy.stderr.read().decode()[-800:] if spy.stderr else ''}")
            latency_ms(gw.gateway.port, req, args.num_requests, num_warmup=0)
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
        _report(args, out, cpu_s, wall_s, sorted(lat))
    finally:
        stop_group(upstream)
    return 0


def _report(args: argparse.Namespace, out: Path, cpu_s: float, wall_s: float, lat: list[float]) -> None:
    layers = read_collapsed(out)
    total = sum(layers.values()) or 1
    per_req_us = cpu_s / args.num_requests * 1e6
    print(f"ext_proc profile: {'facts' if args.facts else 'observing'} path, {args.prompt_kb} KB prompts, "
          f"{args.num_requests} sequential requests, telemetry "
          f"{'on' if args.telemetry else 'off'}, py-spy {'--native ' if args.native else ''}at {args.rate} Hz "
          f"over the same number of requests after one without it (the CPU figure's), load average {os.getloadavg()[0]:.2f}")
    print(f"ext_proc CPU {per_req_us:.0f} us/request ({cpu_s:.2f} s over {wall_s:.1f} s); request latency p50 "
          f"{lat[len(lat) // 2]:.3f} ms; {total} samples on CPU (waits left out) -> {out}")
    print(f"{'layer':>11} {'share':>7} {'us/request':>11}")
    for name, n in layers.most_common():
        print(f"{name:>11} {n / total:7.1%} {n / total * per_req_us:11.0f}")
    print("\ninnermost frames (self samples):")
    for frame, n in top_frames(out, args.num_top):
        print(f"{n / total:7.1%}  {frame[:140]}")


def answers_microbench(num: int = 20000) -> None:
    """The routing answer with a traceparent, built per request as protobuf objects (the way before the
    byte-level answers: copy the cached message, append the header, serialize) against answers.with_traceparent
    (cached bytes + the header's bytes), same process, interleaved: microseconds per answer."""
    from prefixroute.extproc import wire
    from prefixroute.extproc.answers import header_option, with_traceparent
    from prefixroute.extproc.servicer import ResponseCache

    cached = ResponseCache(0).routing_response(("10.0.0.1:8000", "10.0.0.2:8000"), False)
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

    def objects() -> bytes:
        resp = wire.ProcessingResponse()
        resp.CopyFrom(cached)
        resp.request_body.response.header_mutation.set_headers.append(header_option("traceparent", tp))
        return resp.SerializeToString()

    def wire_bytes() -> bytes:
        return wire.serialize(with_traceparent(cached, False, tp))

    assert wire.ProcessingResponse.FromString(objects()) == wire.ProcessingResponse.FromString(wire_bytes())
    best = {"objects": float("inf"), "bytes": float("inf")}
    for _ in range(5):
        for name, fn in (("objects", objects), ("bytes", wire_bytes)):
            t0 = time.perf_counter()
            for _ in range(num):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / num * 1e6)
    print(f"routing answer with traceparent, serialized (best of 5 x {num}): objects {best['objects']:.2f} us, "
          f"bytes {best['bytes']:.2f} us (x{best['bytes'] / best['objects']:.2f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-kb", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=3000)
    parser.add_argument("--num-warmup", type=int, default=300)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--policy", default="prefix")
    parser.add_argument("--telemetry", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--native", action=argparse.BooleanOptionalAction, default=True,
                        help="native (C) frames too: tells grpcio's C core and the event loop apart")
    parser.add_argument("--extproc-arg", action="append", default=[],
                        help="extra argument for `prefixroute extproc` (repeat), e.g. --extproc-arg=--no-uvloop")
    parser.add_argument("--facts", action=argparse.BooleanOptionalAction, default=True,
                        help="the facts path's Envoy, as `prefixroute up` runs it (--no-facts: the observing filter)")
    parser.add_argument("--num-top", type=int, default=20)
    parser.add_argument("--answers-only", action="store_true",
                        help="only the answers micro-benchmark (objects vs bytes), no gateway, no py-spy")
    parser.add_argument("--out", default="", help="where py-spy writes its collapsed stacks (default: a temp dir)")
    args = parser.parse_args()
    answers_microbench()
    return 0 if args.answers_only else profile(args)


if __name__ == "__main__":
    sys.exit(main())
