"""Run `prefixroute bench ARGS...` (a real sweep) unchanged, keeping two figures the real sweep computes and drops:
each run's successful TTFTs (ms) in OUT/points/PCT/ttfts.json (router -> {requests, ttft_ms}) and the capacity in
OUT/capacity.json, so goodput (the bench's SLO: TTFT <= 5 cold prefills of the median prompt, shed and failed
requests misses) can be computed per router (ratios.py). Written per run: a sweep cut short keeps what finished.
Usage: python capture.py bench --workload ... --out DIR"""
import json
import sys
from pathlib import Path

from prefixroute import cli
from prefixroute.bench import sweep

_run_bench, _find_capacity = sweep.run_bench, sweep.find_capacity
_out: dict[str, Path] = {}


def run_bench(wl, bound, routers, fleet, out_dir, **kw):
    doc, ttfts = _run_bench(wl, bound, routers, fleet, out_dir, **kw)
    path = Path(out_dir) / "ttfts.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    for run in doc.get("runs", []):
        saved[run["router"]] = {"requests": run["requests"], "errors": run["errors"],
                                "error_kinds": run["extra"].get("error_kinds"),
                                "ttft_ms": [round(t, 3) for t in ttfts.get(run["router"], [])]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved) + "\n")
    return doc, ttfts


def find_capacity(*args, **kw):
    cap = _find_capacity(*args, **kw)
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(json.dumps(cap.describe(), indent=2) + "\n")
    return cap


sweep.run_bench, sweep.find_capacity = run_bench, find_capacity
sys.argv = ["prefixroute", *sys.argv[1:]]
sys.exit(cli.main())
