"""Benchmark results for the dashboard's Benchmarks page: `prefixroute bench --out DIR` writes DIR/results.json;
`find_bench_results` finds them, `load_bench_result` reads one, `bench_frame` makes one row per router."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import pandas as pd

from prefixroute.dashboard.data import balance_ratio


@dataclasses.dataclass(frozen=True)
class BenchResult:
    path: str
    mtime_s: float
    workload: Mapping[str, Any]
    upper_bound_hit_ratio: float | None
    runs: list[Mapping[str, Any]]

    @property
    def label(self) -> str:
        name = str(self.workload.get("name") or self.workload.get("workload") or self.workload.get("trace") or "?")
        run_dir = os.path.basename(os.path.dirname(self.path)) or self.path
        return run_dir if run_dir == name else f"{run_dir} · {name}"


def bench_roots(bench_dir: str | os.PathLike) -> list[str]:
    """The folders the Benchmarks page searches: `bench_dir` (--bench-dir), then the state folder's bench/, where
    `prefixroute bench` writes without --out; once each."""
    from prefixroute.state import state_dir

    roots = [os.path.abspath(os.fspath(bench_dir)), str(state_dir() / "bench")]
    return list(dict.fromkeys(roots))


def find_bench_results(bench_dir: str | os.PathLike, max_depth: int = 3) -> list[str]:
    """`results.json` files under `bench_dir` (itself included, at most `max_depth` levels down),
    newest first. A missing directory gives []."""
    root = os.fspath(bench_dir)
    if not os.path.isdir(root):
        return []
    found = []
    base_depth = root.rstrip(os.sep).count(os.sep)
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath.rstrip(os.sep).count(os.sep) - base_depth >= max_depth:
            dirnames[:] = []
        if "results.json" in filenames:
            found.append(os.path.join(dirpath, "results.json"))
    return sorted(found, key=lambda p: (-os.path.getmtime(p), p))


class NotChartable(ValueError):
    """A readable results.json of another kind (a load sweep: `prefixroute bench sweep`), which this page does not
    chart; its report.md beside it has the tables."""


def load_bench_result(path: str) -> BenchResult:
    """Parse one results.json; raises NotChartable for a sweep's results and ValueError with the reason when it
    is not the bench format."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if isinstance(doc, dict) and doc.get("kind") == "sweep":
        raise NotChartable(f"{path}: a load sweep (its report.md has the tables)")
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
        raise ValueError(f"{path}: no \"runs\" list (not a `prefixroute bench` results.json)")
    runs = [r for r in doc["runs"] if isinstance(r, dict) and r.get("router")]
    workload = doc.get("workload") if isinstance(doc.get("workload"), dict) else {}
    return BenchResult(path, os.path.getmtime(path), workload, doc.get("upper_bound_hit_ratio"), runs)


def skipped_summary(skipped: list[tuple[str, ValueError]]) -> str:
    """One short line for the files the page does not chart: how many are load sweeps, how many unreadable."""
    num_sweeps = sum(isinstance(exc, NotChartable) for _, exc in skipped)
    parts = []
    if num_sweeps:
        parts.append(f"{num_sweeps} load sweep{'s' * (num_sweeps != 1)} (their report.md has the tables)")
    if len(skipped) - num_sweeps:
        parts.append(f"{len(skipped) - num_sweeps} not in the `prefixroute bench` format")
    return "Not charted here: " + ", ".join(parts) + "." if parts else ""


def bench_frame(result: BenchResult) -> pd.DataFrame:
    """One row per run: router, requests, errors, hit_ratio, ttft_ms_p50/p90/p99, e2e_ms_p50,
    throughput_rps, balance_ratio (from endpoint_share)."""
    out = []
    for r in result.runs:
        ttft = r.get("ttft_ms") or {}
        e2e = r.get("e2e_ms") or {}
        share = r.get("endpoint_share") or {}
        out.append({"router": r["router"], "requests": r.get("requests"), "errors": r.get("errors"),
                    "hit_ratio": r.get("hit_ratio"), "ttft_ms_p50": ttft.get("p50"), "ttft_ms_p90": ttft.get("p90"),
                    "ttft_ms_p99": ttft.get("p99"), "e2e_ms_p50": e2e.get("p50"),
                    "throughput_rps": r.get("throughput_rps"),
                    "balance_ratio": balance_ratio(share) if share else None})
    return pd.DataFrame(out, columns=["router", "requests", "errors", "hit_ratio", "ttft_ms_p50", "ttft_ms_p90",
                                      "ttft_ms_p99", "e2e_ms_p50", "throughput_rps", "balance_ratio"])


def bench_ttft_long(frame: pd.DataFrame) -> pd.DataFrame:
    """Long frame router, percentile, value_ms for grouped TTFT bars."""
    rows = [{"router": r["router"], "percentile": p, "value_ms": r[f"ttft_ms_{p}"]}
            for r in frame.to_dict("records") for p in ("p50", "p90", "p99") if r[f"ttft_ms_{p}"] is not None]
    return pd.DataFrame(rows, columns=["router", "percentile", "value_ms"])
