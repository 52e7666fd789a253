"""Agent-loops shapes at 40-110% of the fleet's prefill capacity, every router on one request sequence per point
(`prefixroute bench` runs; virtual by default, real processes with --real).

    python agent_loads.py --out /tmp/agent-loads [--shapes agent-loops,agent-loops-few] [--loads 40,70,110] [--real]

Load: the offered rate over the fleet's prefill capacity for the shape, i.e. servers / the mean idle prefill time
of a request's uncached tokens on top of its cached ones at one infinite cache (`capacity.idle_prefill_s`, the
profile's own step costs). An agent's think times are the shape's, so a higher rate needs more agents: each point
runs ``num_agents`` x rate / the shape's natural rate (num_agents / (mean think time + 0.3 s)) agents, keeping
each agent's pace. Routers: ours (prefixroute:prefix), the same router with the conversation-load term and the
attention pricing off (``off``: today's main routes so), random, and sglang-router (``sim:sglang-cache-aware``,
our model of it, in a virtual run; the real sglang-router 0.3.2 with --real). Writes OUT/SHAPE-LOAD/ (each run's
results.json and report.md) and OUT/summary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from prefixroute.bench import workloads
from prefixroute.bench.agent_loops import NOMINAL_SERVICE_S, SHAPES
from prefixroute.bench.capacity import idle_prefill_s
from prefixroute.bench.upper_bound import prompt_token_ids, replay_infinite_cache
from prefixroute.bench.virtual_run import engine_spec

PROFILE = "llama-3.1-70b-h200-tp4"
OFF_ENV = {"PREFIXROUTE_CONVERSATION_HORIZON_TURNS": "0", "PREFIXROUTE_ATTENTION_TOKENS": "0"}


def capacity_rps(shape_name: str, servers: int) -> float:
    """Servers / the mean idle prefill of a request's uncached part at one infinite cache (module docstring)."""
    wl = workloads.make_workload(shape_name, num_requests=1500, seed=0, output_tokens=1, prefix_tokens=1,
                                 num_groups=1, question_tokens=1, num_sessions=1, num_turns=1, document_tokens=1,
                                 num_documents=1)
    spec = engine_spec(PROFILE)
    s = [idle_prefill_s(spec, n - c, c) for n, c in replay_infinite_cache(prompt_token_ids(r) for r in wl.requests)]
    return servers / statistics.mean(s)


def bench(out: Path, shape: str, rate: float, agents: int, routers: str, n: int, real: bool,
          env: dict[str, str] | None = None) -> dict:
    argv = [sys.executable, "-m", "prefixroute.cli", "bench", "--workload", shape, "--num-requests", str(n),
            "--rate-rps", f"{rate:.3f}", "--agent-loop-args", f"num_agents={agents}", "--routers", routers,
            "--out", str(out), "--no-progress", *([] if real else ["--virtual"])]
    subprocess.run(argv, env={**os.environ, **(env or {})}, check=True, stdout=subprocess.DEVNULL,
                   stderr=open(out.with_suffix(".log"), "w"))  # noqa: SIM115
    return json.loads((out / "results.json").read_text())


def row(shape: str, load: int, rate: float, agents: int, name: str, r: dict) -> str:
    t, itl = r["ttft_ms"], r["itl_ms"]
    return (f"| {shape} | {load}% | {rate:.1f} | {agents} | {name} | {r['hit_ratio']:.3f} | {t['p50']:.0f} | "
            f"{t['p90']:.0f} | {t['p99']:.0f} | {itl['p50']:.1f} | {r['extra']['max_share_over_fair']:.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--loads", default="40,70,110")
    ap.add_argument("--num-requests", type=int, default=1500)
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--real", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peer = "sglang-router" if args.real else "sim:sglang-cache-aware"
    lines = ["| shape | load | req/s | agents | router | hit | TTFT p50 ms | p90 | p99 | ITL p50 ms | busiest share |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for shape in args.shapes.split(","):
        sh = SHAPES[shape]
        cap = capacity_rps(shape, args.servers)
        natural = sh.num_agents / ((sh.min_think_s + sh.max_think_s) / 2 + NOMINAL_SERVICE_S)
        for load in (int(x) for x in args.loads.split(",")):
            rate = cap * load / 100.0
            agents = max(1, round(sh.num_agents * rate / natural))
            d = out / f"{shape}-{load}"
            d.mkdir(exist_ok=True)
            runs = bench(d / "routers", shape, rate, agents, f"prefixroute:prefix,{peer},prefixroute:random",
                         args.num_requests, args.real)["runs"]
            off = bench(d / "off", shape, rate, agents, "prefixroute:prefix", args.num_requests, args.real,
                        OFF_ENV)["runs"][0]
            names = {"prefixroute:prefix": "prefixroute:prefix", peer: peer, "prefixroute:random": "random"}
            for r in runs:
                lines.append(row(shape, load, rate, agents, names.get(r["router"], r["router"]), r))
            lines.append(row(shape, load, rate, agents, "prefix, conversation term and attention off", off))
            print("\n".join(lines[-4:]), flush=True)
    (out / "summary.md").write_text(f"Capacity: {args.servers} x {PROFILE}; loads of the prefill capacity "
                                    f"(agent_loads.py docstring).\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
