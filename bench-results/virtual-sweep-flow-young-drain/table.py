"""The young-drain A/B table (README.md): per workload and load, our router with its queue before the change
(`before/`: predicted-deadline shedding on any drain rate) and after it (`after/`: only once 16 releases are
measured), each against sim:sglang-cache-aware of the same run (same request sequence) and against our router
without the queue (`prefixroute:prefix-flow`)."""
import json
import sys
from pathlib import Path

D = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
OURS, OFF, SGL = "prefixroute:prefix+flow", "prefixroute:prefix-flow", "sim:sglang-cache-aware"
print("| workload | load | code | ours p50 / p90 / p99 (s) | vs sglang model p50 / p90 | vs no queue p50 / p90 / p99 "
      "| goodput vs sglang | shed |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for wl in ("shared-prompts", "mix", "capacity-pressure"):
    docs = {m: json.loads((D / m / wl / "results.json").read_text()) for m in ("before", "after")}
    for i, point in enumerate(docs["before"]["points"]):
        for mode, doc in docs.items():
            runs = doc["points"][i]["runs"]
            o, f, s = runs[OURS], runs[OFF], runs[SGL]
            t = lambda r, p: r["ttft_ms"][p] / 1000  # noqa: E731
            gp = o["goodput_ratio"] / s["goodput_ratio"] if s["goodput_ratio"] else float("nan")
            print(f"| {wl} | {point['load_percent']:g}% | {mode} | {t(o, 'p50'):.2f} / {t(o, 'p90'):.2f} / "
                  f"{t(o, 'p99'):.2f} | {t(o, 'p50') / t(s, 'p50'):.2f}x / {t(o, 'p90') / t(s, 'p90'):.2f}x | "
                  f"{t(o, 'p50') / t(f, 'p50'):.2f}x / {t(o, 'p90') / t(f, 'p90'):.2f}x / "
                  f"{t(o, 'p99') / t(f, 'p99'):.2f}x | {gp:.2f}x ({o['goodput_ratio']:.2f} vs "
                  f"{s['goodput_ratio']:.2f}) | {o['num_shed']} of {o['requests']} |")
