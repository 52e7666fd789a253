"""Micro-benchmark of one routing decision: parse (JSON + canonical text + block hashes) and route (prefix-index
match, scheduling, index update), for prompt sizes x pool sizes. Not a test: it prints figures.

    python -m prefixroute.bench.decision [--iterations N] [--policy prefix]

"json" is orjson.loads of the body alone: the part of "parse" that must grow with the body. "warm" repeats one
body (affinity path: the index matches every block); "cold" sends a new prefix each time (rendezvous placement,
index insertion and, once an LRU is full, eviction). Beyond JSON parsing, decision time should stay flat as the
prompt grows (bounded blocks) and grow only mildly with the pool (filters are linear in the endpoints; scoring
looks at ``max_scored_endpoints`` of them).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import orjson

from prefixroute.extproc.routing.request import parse_request
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.settings import POLICIES, RoutingSettings
from prefixroute.types import EndpointId, EndpointState

PROMPT_BYTES = (4 * 1024, 64 * 1024, 1024 * 1024)
POOL_SIZES = (4, 64, 256)


def _body(size: int, tag: int) -> bytes:
    system = f"[{tag:08d}] " + ("You are a careful assistant. Cite sources. " * (size // 40 + 1))[: size - 11]
    return orjson.dumps({"model": "m", "stream": True, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"question {tag}"}]})


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(iterations: int, policy: str) -> None:
    settings = RoutingSettings(policy=policy, rng_seed=1)
    print(f"policy={policy} block_chars={settings.block_chars} max_blocks={settings.max_blocks} "
          f"iterations={iterations} (median / p99 in microseconds)")
    print(f"{'prompt':>7} {'endpoints':>9} {'mode':>5} {'json':>7} {'parse':>14} {'route':>14} {'total':>14}"
          "  total/first")
    base = None
    for size in PROMPT_BYTES:
        n_iter = max(20, iterations // (8 if size > 100_000 else 1))
        warm_body = _body(size, 0)
        cold_bodies = [_body(size, i + 1) for i in range(n_iter)]
        json_us = []
        for _ in range(n_iter):
            t0 = time.perf_counter_ns()
            orjson.loads(warm_body)
            json_us.append((time.perf_counter_ns() - t0) / 1e3)
        json_med = statistics.median(json_us)
        for n in POOL_SIZES:
            endpoints = tuple(EndpointState(EndpointId(f"10.0.{i // 250}.{i % 250}:8000"), models=frozenset({"m"}),
                                            num_requests_waiting=i % 3, kv_cache_usage_ratio=0.5) for i in range(n))
            in_flight = {s.endpoint: i % 5 for i, s in enumerate(endpoints)}
            for mode in ("warm", "cold"):
                core = RouterCore(settings)
                core.route(parse_request("POST", "/v1/chat/completions", {}, warm_body, settings), endpoints,
                           in_flight)
                parse_us, route_us = [], []
                gc.disable()
                try:
                    for i in range(n_iter):
                        body = warm_body if mode == "warm" else cold_bodies[i]
                        t0 = time.perf_counter_ns()
                        req = parse_request("POST", "/v1/chat/completions", {}, body, settings)
                        t1 = time.perf_counter_ns()
                        core.route(req, endpoints, in_flight)
                        t2 = time.perf_counter_ns()
                        parse_us.append((t1 - t0) / 1e3)
                        route_us.append((t2 - t1) / 1e3)
                finally:
                    gc.enable()
                total = [a + b for a, b in zip(parse_us, route_us)]
                med = statistics.median(total)
                base = base or med
                print(f"{size // 1024:>5}KB {n:>9} {mode:>5} {json_med:>7.1f} "
                      f"{statistics.median(parse_us):>7.1f}/{_pct(parse_us, 0.99):<6.1f} "
                      f"{statistics.median(route_us):>7.1f}/{_pct(route_us, 0.99):<6.1f} "
                      f"{med:>7.1f}/{_pct(total, 0.99):<6.1f} x{med / base:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=400, help="decisions per configuration (1 MB: /8)")
    parser.add_argument("--policy", default="prefix", choices=POLICIES)
    args = parser.parse_args(argv)
    run(args.iterations, args.policy)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
