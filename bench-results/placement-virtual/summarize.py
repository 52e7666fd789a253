"""Summarise bench-results/placement-virtual/SET/TAG/results.json into one markdown table (ratios against the
same set's `off` run and sim:sglang-cache-aware in it)."""
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
SETS = ["capacity-pressure", "96x6k", "zipf11-600", "seed1-600", "shared-prompts", "mix"]
TAGS = ["off", "victims-all", "victims-oneoff", "replica", "all-together", "victims-all-w1"]
ours = "prefixroute:prefix@events"
print("| set | load | variant | TTFT p50 / p90 s | hit ratio | vs off: hit, p50, p90 | vs sglang model: hit, p50, p90 | LRU-to-MIN gap closed |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for s in SETS:
    base = json.loads((root / s / "off" / "results.json").read_text())
    b = base["bounds"]
    lru, mn = b["lru_pooled_hit_ratio"], b["belady_hit_ratio"]
    for i, pt in enumerate(base["points"]):
        o = pt["runs"][ours]; g = pt["runs"]["sim:sglang-cache-aware"]
        rows = [("sglang model", g)]
        for t in TAGS:
            f = root / s / t / "results.json"
            if f.exists():
                rows.append((t, json.loads(f.read_text())["points"][i]["runs"][ours]))
        for name, r in rows:
            p50, p90, h = r["ttft_ms"]["p50"] / 1000, r["ttft_ms"]["p90"] / 1000, r["hit_ratio"]
            vs_off = f"{h / o['hit_ratio']:.2f}x, {p50 / (o['ttft_ms']['p50'] / 1000):.2f}x, {p90 / (o['ttft_ms']['p90'] / 1000):.2f}x"
            vs_g = f"{h / g['hit_ratio']:.2f}x, {p50 / (g['ttft_ms']['p50'] / 1000):.2f}x, {p90 / (g['ttft_ms']['p90'] / 1000):.2f}x"
            gap = f"{(h - lru) / (mn - lru):+.0%}" if mn > lru else "-"
            print(f"| {s} | {pt['load_percent']}% | {name} | {p50:.3f} / {p90:.3f} | {h:.3f} | {vs_off} | {vs_g} | {gap} |")
    print(f"| {s} | bounds | pooled LRU {lru:.3f}, Belady MIN {mn:.3f} | | | | | |")
