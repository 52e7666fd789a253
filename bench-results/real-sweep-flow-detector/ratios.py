"""Per point, each router's TTFT P50 / P90 (successful requests, as the sweep's report), its ratios to
sglang-router's, goodput (bench.sweep.goodput_ratio's definition: TTFT <= 5 x the capacity's cold prefill of the
median prompt; shed and failed requests are misses) and its ratio to sglang-router's, and the shed share (429 and
503 answers over requests sent), from what capture.py kept. Usage: python ratios.py DIR (writes DIR/ratios.md)."""
import json
import sys
from pathlib import Path

from prefixroute.bench.results import percentiles
from prefixroute.bench.sweep import GOODPUT_SLO_COLD_PREFILLS

REF = "sglang-router"
out = Path(sys.argv[1])
cap = json.loads((out / "capacity.json").read_text())
slo_ms = GOODPUT_SLO_COLD_PREFILLS * cap["cold_prefill_s"] * 1000.0
lines = [f"Capacity (100%) {cap['rps']} req/s; goodput SLO = {GOODPUT_SLO_COLD_PREFILLS:g} x cold prefill "
         f"{cap['cold_prefill_s']} s = {slo_ms / 1000:.2f} s.", "",
         "| load | router | requests | p50 / p90 (s) | p50 / p90 vs sglang-router | goodput | goodput vs sglang-router "
         "| shed | other errors |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
points = sorted((out / "points").glob("*pct"), key=lambda p: float(p.name.removesuffix("pct")))
for point in points:
    f = point / "ttfts.json"
    if not f.exists():
        continue
    runs = json.loads(f.read_text())
    rows = {}
    for name, r in runs.items():
        pc = percentiles(r["ttft_ms"], (50, 90))
        kinds = r.get("error_kinds") or {}
        shed = kinds.get("http 429", 0) + kinds.get("http 503", 0)
        good = sum(1 for t in r["ttft_ms"] if t <= slo_ms) / r["requests"] if r["requests"] else None
        rows[name] = dict(p50=pc["p50"], p90=pc["p90"], good=good, shed=shed, n=r["requests"],
                          other=r["errors"] - shed)
    ref = rows.get(REF)
    for name, x in rows.items():
        rp = (f"{x['p50'] / ref['p50']:.2f}x / {x['p90'] / ref['p90']:.2f}x" if ref and ref["p50"] and x["p50"]
              else "-")
        rg = f"{x['good'] / ref['good']:.2f}x" if ref and ref["good"] and x["good"] is not None else "-"
        lines.append(f"| {point.name.removesuffix('pct')}% | {name} | {x['n']} | {x['p50'] / 1000:.2f} / "
                     f"{x['p90'] / 1000:.2f} | {rp} | {x['good']:.3f} | {rg} | {x['shed'] / x['n']:.1%} "
                     f"({x['shed']}) | {x['other']} |")
text = "\n".join(lines) + "\n"
(out / "ratios.md").write_text(text)
print(text)
