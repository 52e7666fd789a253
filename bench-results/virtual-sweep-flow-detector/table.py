"""The detector A/B table (README.md): per workload and load, our router with its queue under the new default
(outstanding prefill until first token) and under --saturation-drain, each against sim:sglang-cache-aware and
sim:oracle+flow of the same run (same request sequence)."""
import json
import sys
from pathlib import Path

D = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
OURS, SGL, ORA = "prefixroute:prefix+flow", "sim:sglang-cache-aware", "sim:oracle+flow"
print("| workload | load | detector | ours p50 / p90 (s) | sglang model p50 / p90 (s) | oracle+queue p50 / p90 (s) "
      "| ours vs sglang p50 / p90 | goodput vs sglang | shed | vs oracle+queue p50 / p90 |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for wl in ("shared-prompts", "mix", "capacity-pressure"):
    docs = {m: json.loads((D / f"{wl}-{m}" / "results.json").read_text()) for m in ("pending", "drain")
            if (D / f"{wl}-{m}" / "results.json").exists()}
    if not docs:
        continue
    for i, point in enumerate(next(iter(docs.values()))["points"]):
        for mode, doc in docs.items():
            runs = doc["points"][i]["runs"]
            o, s, q = runs[OURS], runs[SGL], runs[ORA]
            t = lambda r, p: r["ttft_ms"][p] / 1000  # noqa: E731
            gp = o["goodput_ratio"] / s["goodput_ratio"] if s["goodput_ratio"] else float("nan")
            name = "outstanding (default)" if mode == "pending" else "--saturation-drain"
            print(f"| {wl} | {point['load_percent']:g}% | {name} | {t(o, 'p50'):.2f} / {t(o, 'p90'):.2f} | "
                  f"{t(s, 'p50'):.2f} / {t(s, 'p90'):.2f} | {t(q, 'p50'):.2f} / {t(q, 'p90'):.2f} | "
                  f"{t(o, 'p50') / t(s, 'p50'):.2f}x / {t(o, 'p90') / t(s, 'p90'):.2f}x | "
                  f"{gp:.2f}x ({o['goodput_ratio']:.2f} vs {s['goodput_ratio']:.2f}) | "
                  f"{o['num_shed'] / o['requests'] * 100:.0f}% | "
                  f"{o['gap_to_oracle_flow']['p50'] * 100:+.0f}% / {o['gap_to_oracle_flow']['p90'] * 100:+.0f}% |")
