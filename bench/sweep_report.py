"""A load sweep's outputs (`write_sweep_outputs`): DIR/results.json (the sweep document, ``"kind": "sweep"``),
DIR/report.md (`render_report`: the table and the command), DIR/ttft_vs_load.png (TTFT p50/p90/p99 against load,
one line per router) and DIR/hit_ratio_vs_load.png (`plot_sweep`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefixroute.bench.report import (GOODPUT_NOTE, flow_count_lines, goodput_text, render_bounds,
                                      render_bounds_by_router, shed_text, write_files)
from prefixroute.bench.sweep import PREDICTION_DEFINITION, seconds_text

PLOT_FILES = ("ttft_vs_load.png", "hit_ratio_vs_load.png")


def _bounds_lines(doc: Mapping[str, Any]) -> list[str]:
    """The capacity bounds (MIN and one pooled LRU, at GPU and at GPU + CPU capacity) and, per load point, every
    router beside them (`report.render_bounds_by_router`)."""
    bounds = doc.get("bounds")
    if not bounds:
        return []
    lines = render_bounds(bounds)
    for p in doc["points"]:
        runs = [{"router": name, "hit_ratio": e["hit_ratio"],
                 "extra": {"hit_ratio_by_tier": e["hit_ratio_by_tier"]} if "hit_ratio_by_tier" in e else {}}
                for name, e in p["runs"].items()]
        table = render_bounds_by_router(runs, bounds)
        if table:
            lines += [f"At {p['load_percent']:g}% load. " + table[0]] + table[1:]
    return lines


def render_report(doc: Mapping[str, Any], command: str = "") -> str:
    """report.md of a sweep: the fleet, the capacity (both figures, the definition), one row per point and
    router, skipped routers, the plots."""
    wl = doc["workload"]
    cap = doc["capacity"]
    real = not doc.get("virtual")
    lines = [f"# Load sweep ({'real processes' if real else 'virtual fleet'}): {wl.get('name')}", ""]
    if command:
        lines += ["Command:", "", "```", command, "```", ""]
    params = ", ".join(f"{k}={v}" for k, v in wl.items() if not isinstance(v, (dict, list)))
    lines += [f"Workload: {params}; {doc['num_requests_per_point']} requests per point (one Poisson sequence per "
              f"point, shared by every router)", "",
              f"Fleet: {doc['num_servers']} x {doc['profile']}, time scale {doc['time_scale']:g}"
              + (f", server args {' '.join(doc['server_args'])}" if doc.get("server_args") else ""), "",
              f"Capacity (100%): **{cap['rps']:.3f} req/s** = {cap['definition']}. Median prompt "
              f"{cap['typical_prompt_tokens']} tokens, cold prefill {cap['cold_prefill_s']:.3f} s; "
              f"{len(cap['search'])} oracle runs, {cap['search_wall_s']:.1f} s. Throughput figure (for "
              f"reference): {cap['throughput_rps']:.3f} req/s = {cap['throughput_definition']}.", "",
              f"Upper bound (one infinite cache): hit ratio {doc['upper_bound_hit_ratio']:.3f}", ""]
    gaps = any("gap_to_oracle" in e for p in doc["points"] for e in p["runs"].values())
    preds = any("prediction_mape" in e for p in doc["points"] for e in p["runs"].values())
    head = ["load", "rate req/s", "router", "TTFT p50 s", "p90 s", "p99 s", "hit ratio", "goodput req/s",
            "met deadline", "shed", "max share/fair", "errors"]
    if gaps:
        head += ["gap p50", "gap p90", "gap p99"]
    if preds:
        head += ["prediction MAPE"]
    if real:
        head += ["virtual p50 / p99 s", "host CPU"]
    lines += ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:+.0%}"

    for p in doc["points"]:
        for name, e in p["runs"].items():
            t = e["ttft_ms"]
            hr = "-" if e["hit_ratio"] is None else f"{e['hit_ratio']:.3f}"
            share = "-" if e.get("max_share_over_fair") is None else f"{e['max_share_over_fair']:.2f}"
            row = [f"{p['load_percent']:g}%", f"{p['rate_rps']:.2f}", name, seconds_text(t.get("p50")),
                   seconds_text(t.get("p90")), seconds_text(t.get("p99")), hr, *goodput_text(e).split(" | "),
                   shed_text(e), share, str(e["errors"])]
            if gaps:
                g = e.get("gap_to_oracle") or {}
                row += [pct(g.get("p50")), pct(g.get("p90")), pct(g.get("p99"))]
            if preds:
                m = e.get("prediction_mape")
                row += ["-" if m is None else f"{m:.1%} ({e['prediction_scope']})"]
            if real:
                v = (e.get("virtual_estimate") or {}).get("ttft_ms") or {}
                row += [f"{seconds_text(v.get('p50'))} / {seconds_text(v.get('p99'))}" if v else "-",
                        "-" if e.get("host_cpu_busy_ratio") is None else f"{e['host_cpu_busy_ratio']:.0%}"]
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", GOODPUT_NOTE, ""]
    lines += flow_count_lines([(f"{p['load_percent']:g}% {name}", e.get("flow"))
                               for p in doc["points"] for name, e in p["runs"].items()])
    lines += _bounds_lines(doc)
    if gaps:
        lines += ["gap = (router - sim:oracle) / sim:oracle per percentile: negative is better than the oracle "
                  "(a greedy router with true state, not a proven optimum).", ""]
    if preds:
        lines += [f"prediction MAPE: {doc.get('prediction_error_definition', PREDICTION_DEFINITION)}.", ""]
    if real:
        lines += ["virtual = the virtual fleet's figures for the same requests (our policies; sglang-router's "
                  "cache_aware as sim:sglang-cache-aware). host CPU = the whole host's busy share of its cores "
                  "while the requests were replayed (client, Envoy, router, servers and anything else running).",
                  ""]
    skipped = doc.get("skipped") or {}
    if skipped:
        lines += ["Skipped routers:", ""] + [f"- {k}: {v}" for k, v in skipped.items()] + [""]
    lines += ["Plots: " + ", ".join(f"![{p}]({p})" for p in PLOT_FILES), ""]
    return "\n".join(lines)


def plot_sweep(out_dir: Path, doc: Mapping[str, Any]) -> list[Path]:
    """ttft_vs_load.png (p50, p90, p99 panels; one line per router; log y) and hit_ratio_vs_load.png (one line
    per router, the upper bound dashed). Returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = doc["points"]
    routers = list(dict.fromkeys(n for p in points for n in p["runs"]))
    x = [p["load_percent"] for p in points]
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    for ax, q in zip(axes, ("p50", "p90", "p99")):
        for name in routers:
            ys = [(p["runs"].get(name) or {}).get("ttft_ms", {}).get(q) for p in points]
            pts = [(xi, y / 1000.0) for xi, y in zip(x, ys) if y]
            if pts:
                ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=name)
        ax.set_yscale("log")
        ax.set_xlabel("load (% of capacity)")
        ax.set_title(f"TTFT {q}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("time to first token (s, log)")
    axes[-1].legend(fontsize=8)
    fig.suptitle(f"{doc['workload'].get('name')}: capacity {doc['capacity_rps']:.2f} req/s "
                 f"({'real processes' if not doc.get('virtual') else 'virtual fleet'})")
    paths.append(out_dir / PLOT_FILES[0])
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in routers:
        pts = [(xi, (p["runs"].get(name) or {}).get("hit_ratio")) for xi, p in zip(x, points)]
        pts = [(a, b * 100) for a, b in pts if b is not None]
        if pts:
            ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=name)
    ub = doc.get("upper_bound_hit_ratio")
    if ub is not None:
        ax.axhline(ub * 100, color="tab:red", linestyle="--", label=f"upper bound {ub * 100:.1f}%")
    ax.set_xlabel("load (% of capacity)")
    ax.set_ylabel("prefix-cache hit ratio (% of prompt tokens)")
    ax.set_ylim(0, 100)
    ax.set_title("KV-cache hit ratio against load")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(out_dir / PLOT_FILES[1])
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_sweep_outputs(out_dir: str | Path, doc: dict, command: str = "") -> dict[str, Path]:
    """DIR/results.json (the document, with `command`), DIR/report.md and the plots; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if command:
        doc["command"] = command
    return write_files(out, doc, render_report(doc, command), lambda: plot_sweep(out, doc))
