"""The virtual suite: one command that runs routers on many request sets of the virtual fleet, each against a
baseline router in the same run, and prints one table per set and one aggregate line per router. Not a test: it
prints figures, for choosing defaults and for checking that a change helps on sets it was not tuned on.

    python -m prefixroute.bench.suite --trace TRACE.jsonl --out DIR [--env NAME=VALUE ...] [--jobs 2]
    python -m prefixroute.bench.suite --compare DIR_A DIR_B      # two suites' aggregates side by side

Sets (`SETS`): slices of a Mooncake-format conversation trace (``--trace``; skipped without it) at the trace's own
rate, a denser and a lighter rate, on 4 x 70B (the bench's default profile) and 4 x 8B; the agent-loop shapes;
`mix`; `documents`; and the seed's setting (288 system prompts of 8k tokens) swept from 40% to 300% of capacity.
Each set is one ``prefixroute bench --virtual`` run in a process of its own (so ``--env`` settings, e.g.
``PREFIXROUTE_TTFT_WORK_WEIGHT=4``, reach the router exactly as they reach a gateway), every router of a set on
the same request sequence. The virtual fleet runs in simulated time: a set's figures do not depend on this
machine's load, so two suites differ only by what changed between them.

Per point (a set, or a set at one load): each router's hit ratio less the baseline's, its TTFT P50 / P90 / P99 over
the baseline's, its met-deadline share and sheds (with how many were false: the request met its deadline when the
same sequence was replayed with the queue holding but never shedding, and with no queue). Per router: the mean
hit-ratio difference, the geometric means of the TTFT ratios, the summed met-deadline difference, the sheds and
false sheds, and how many points it lost (P90 or P99 over 1.05x the baseline's, or a hit ratio 0.005 under it):
what it gets wrong counts beside what it gets right. The same
aggregate against each other router of the runs too (ours with its queue against ours without it: what the queue
itself gains and loses, the rule a default-on mechanism is held to).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

DEFAULT_ROUTERS = ("prefixroute:prefix+flow", "prefixroute:prefix-flow")
DEFAULT_BASELINE = "sim:sglang-cache-aware"
LOST_RATIO = 1.05
"""A point is lost when the router's TTFT P90 or P99 is over this times the baseline's (the bench's tolerance in
the issue targets), or its hit ratio is `LOST_HIT` under the baseline's."""
LOST_HIT = 0.005


@dataclasses.dataclass(frozen=True)
class SuiteSet:
    """One request set: its name and the ``prefixroute bench`` arguments that make it (routers and output
    added by the suite). `trace`: the set slices the ``--trace`` file."""

    name: str
    args: tuple[str, ...]
    trace: bool = False


def _conv(name: str, start: int, stop: int, *extra: str) -> SuiteSet:
    return SuiteSet(name, ("--servers", "4", "--trace-start", str(start), "--trace-stop", str(stop), *extra),
                    trace=True)


SETS: tuple[SuiteSet, ...] = (
    # A conversation trace: five slices of ~918 requests at the trace's rate (70B), one 1.33x denser (far past
    # capacity), one 1.5x lighter (under it), and two on 8B servers (one at 2x the rate).
    _conv("conv-0", 0, 918),
    _conv("conv-600", 600, 1518),
    _conv("conv-1274", 1274, 2192),
    _conv("conv-2192", 2192, 3110),
    _conv("conv-3110", 3110, 4028),
    _conv("conv-1800-dense", 1800, 2718, "--trace-time-scale", "0.75"),
    _conv("conv-2600-light", 2600, 3518, "--trace-time-scale", "1.5"),
    _conv("conv-1274-8b", 1274, 2192, "--profile", "llama-3.1-8b-h200"),
    _conv("conv-0-8b-dense", 0, 918, "--profile", "llama-3.1-8b-h200", "--trace-time-scale", "0.5"),
    SuiteSet("agent-loops", ("--workload", "agent-loops", "--servers", "4", "--num-requests", "1200")),
    SuiteSet("agent-loops-many", ("--workload", "agent-loops-many", "--servers", "4", "--num-requests", "1200")),
    SuiteSet("mix", ("--workload", "mix", "--servers", "4", "--num-requests", "300")),
    SuiteSet("documents", ("--workload", "documents", "--servers", "4", "--num-requests", "300")),
    SuiteSet("shared-prompts-288", ("--workload", "shared-prompts", "--num-groups", "288", "--num-requests", "1500",
                                    "--servers", "4", "--sweep-load-percents", "40,110,250,300")),
)


@dataclasses.dataclass(frozen=True)
class Point:
    """One router at one point of a set, against the baseline at the same point."""

    set_name: str
    load: str  # "" or "110%" (a swept set)
    router: str
    hit_ratio: float
    ttft_s: tuple[float, float, float]  # p50, p90, p99
    met_ratio: float
    num_shed: int
    base_hit_ratio: float
    base_ttft_s: tuple[float, float, float]
    base_met_ratio: float
    # Of `num_shed`, those that met their deadline when the same requests were replayed with the queue holding but
    # never shedding, and with no gateway queue at all (the virtual fleet's counterfactuals; 0 when not judged).
    num_false_shed: int = 0
    num_false_shed_unqueued: int = 0

    @property
    def ttft_ratios(self) -> tuple[float, float, float]:
        return tuple(x / b if b > 0 else 1.0 for x, b in zip(self.ttft_s, self.base_ttft_s))  # type: ignore[return-value]

    @property
    def lost(self) -> bool:
        r = self.ttft_ratios
        return r[1] > LOST_RATIO or r[2] > LOST_RATIO or self.hit_ratio < self.base_hit_ratio - LOST_HIT


def _runs(doc: Mapping[str, Any]) -> Iterator[tuple[str, str, Mapping[str, Any]]]:
    """(load, router name, run) of a bench results document, single run or sweep."""
    if "points" in doc:
        for pt in doc["points"]:
            for name, run in pt["runs"].items():
                yield f"{pt['load_percent']:g}%", name, run
    else:
        for run in doc["runs"]:
            yield "", run["router"], run


def _figures(run: Mapping[str, Any]) -> tuple[float, tuple[float, float, float], float, tuple[int, int, int]]:
    extra = run.get("extra", run)  # a sweep's run carries its figures at its top level
    t = run["ttft_ms"]
    goodput = extra.get("goodput") or {}
    judged = extra.get("false_sheds") or {}
    return (run["hit_ratio"] or 0.0, (t["p50"] / 1000.0, t["p90"] / 1000.0, t["p99"] / 1000.0),
            goodput.get("met_ratio", 0.0),
            (extra.get("num_shed", 0), judged.get("num_false", 0), judged.get("num_false_unqueued", 0)))


def points_of(set_name: str, doc: Mapping[str, Any], baseline: str) -> list[Point]:
    """Every non-baseline router's points in `doc` against `baseline` at the same load (none without it)."""
    base: dict[str, tuple] = {}
    for load, name, run in _runs(doc):
        if name == baseline:
            base[load] = _figures(run)
    out = []
    for load, name, run in _runs(doc):
        if name == baseline or load not in base:
            continue
        hit, ttft, met, (shed, false, false_unqueued) = _figures(run)
        bhit, bttft, bmet, _ = base[load]
        out.append(Point(set_name, load, name, hit, ttft, met, shed, bhit, bttft, bmet, false, false_unqueued))
    return out


def aggregate(points: Sequence[Point]) -> dict[str, dict[str, float]]:
    """Per router: points, mean hit difference, geometric-mean TTFT ratios, summed met-deadline difference,
    sheds and lost points (module docstring)."""
    out: dict[str, dict[str, float]] = {}
    for router in dict.fromkeys(p.router for p in points):
        ps = [p for p in points if p.router == router]
        n = len(ps)
        logs = [sum(math.log(max(p.ttft_ratios[i], 1e-9)) for p in ps) / n for i in range(3)]
        out[router] = {
            "points": n,
            "mean_hit_diff": round(sum(p.hit_ratio - p.base_hit_ratio for p in ps) / n, 4),
            "ttft_p50_ratio": round(math.exp(logs[0]), 3),
            "ttft_p90_ratio": round(math.exp(logs[1]), 3),
            "ttft_p99_ratio": round(math.exp(logs[2]), 3),
            "met_ratio_diff_sum": round(sum(p.met_ratio - p.base_met_ratio for p in ps), 3),
            "num_shed": sum(p.num_shed for p in ps),
            "num_false_shed": sum(p.num_false_shed for p in ps),
            "num_false_shed_unqueued": sum(p.num_false_shed_unqueued for p in ps),
            "num_lost": sum(p.lost for p in ps),
        }
    return out


def _sheds(num: int, false: int, false_unqueued: int) -> str:
    return f"{num} ({false} / {false_unqueued})" if num else "0"


def render(points: Sequence[Point], agg: Mapping[str, Mapping[str, float]], baseline: str) -> str:
    lines = [f"Against {baseline} at the same point: hit = hit ratio less its; TTFT = P50 / P90 / P99 over its; "
             f"met = share of requests with a first token within the deadline (its in brackets); "
             f"lost = P90 or P99 over {LOST_RATIO}x, or hit {LOST_HIT} under.", "",
             "| set | load | router | hit (diff) | TTFT p50 / p90 / p99 s | ratios | met (baseline) | shed (false / false "
             "with no queue) | lost |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in points:
        r = p.ttft_ratios
        lines.append(f"| {p.set_name} | {p.load} | {p.router} | {p.hit_ratio:.4f} ({p.hit_ratio - p.base_hit_ratio:+.4f})"
                     f" | {p.ttft_s[0]:.3f} / {p.ttft_s[1]:.3f} / {p.ttft_s[2]:.3f} | {r[0]:.2f} / {r[1]:.2f} / "
                     f"{r[2]:.2f} | {p.met_ratio:.3f} ({p.base_met_ratio:.3f}) | {_sheds(p.num_shed, p.num_false_shed, p.num_false_shed_unqueued)} | "
                     f"{'yes' if p.lost else ''} |")
    lines += ["", render_aggregate({"": agg})]
    return "\n".join(lines)


def render_aggregate(aggs: Mapping[str, Mapping[str, Mapping[str, float]]]) -> str:
    """One line per (suite, router): `aggs` maps a suite's label to its `aggregate`."""
    lines = ["| suite | router | points | mean hit diff | TTFT p50 / p90 / p99 (geomean ratio) | met diff (sum) "
             "| sheds (false / false with no queue) | lost points |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, agg in aggs.items():
        for router, a in agg.items():
            lines.append(f"| {label} | {router} | {a['points']} | {a['mean_hit_diff']:+.4f} | {a['ttft_p50_ratio']:.3f} / "
                         f"{a['ttft_p90_ratio']:.3f} / {a['ttft_p99_ratio']:.3f} | {a['met_ratio_diff_sum']:+.3f} | "
                         f"{_sheds(a['num_shed'], a.get('num_false_shed', 0), a.get('num_false_shed_unqueued', 0))} | "
                         f"{a['num_lost']} |")
    return "\n".join(lines)


def _run_set(s: SuiteSet, out: Path, routers: Sequence[str], trace: str | None, env: Mapping[str, str]) -> str:
    """Runs one set (skips it when its results are already in `out`); returns a line for the log."""
    target = out / s.name
    if (target / "results.json").exists():
        return f"{s.name}: kept the results already in {target}"
    args = [sys.executable, "-m", "prefixroute", "bench", "--virtual", *s.args,
            "--routers", ",".join(routers), "--out", str(target)]
    if s.trace:
        args += ["--trace", str(trace)]
    log = out / f"{s.name}.log"
    with open(log, "wb") as f:
        rc = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env}).returncode
    return f"{s.name}: {'done' if rc == 0 else f'FAILED (exit {rc}, see {log})'}"


def run_suite(out: Path, *, trace: str | None, routers: Sequence[str], baseline: str, env: Mapping[str, str],
              jobs: int, only: Sequence[str] = ()) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    sets = [s for s in SETS if (not only or s.name in only) and (trace or not s.trace)]
    if not trace:
        print("no --trace: the conversation-trace sets are skipped", flush=True)
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for line in pool.map(lambda s: _run_set(s, out, [*routers, baseline], trace, env), sets):
            print(line, flush=True)
    return collect(out, baseline, env=env, trace=trace)


def collect(out: Path, baseline: str, *, env: Mapping[str, str] | None = None, trace: str | None = None,
            ) -> dict[str, Any]:
    """The suite document of the sets found in `out` (in `SETS` order), written to out/suite.json. Beside the
    aggregate against `baseline`, ``aggregate_by_baseline`` holds each router's aggregate against every other
    router of the runs (e.g. ours with its queue against ours without: what the queue itself gains or loses)."""
    docs = {s.name: json.loads(p.read_text()) for s in SETS if (p := out / s.name / "results.json").exists()}
    points = [p for name, d in docs.items() for p in points_of(name, d, baseline)]
    routers = list(dict.fromkeys(name for d in docs.values() for _, name, _ in _runs(d)))
    by_baseline = {}
    for other in routers:
        if other != baseline:
            pts = [p for name, d in docs.items() for p in points_of(name, d, other) if p.router != baseline]
            if pts:
                by_baseline[other] = aggregate(pts)
    doc = {"baseline": baseline, "env": dict(env or {}), "trace": trace,
           "points": [dataclasses.asdict(p) for p in points], "aggregate": aggregate(points),
           "aggregate_by_baseline": by_baseline}
    (out / "suite.json").write_text(json.dumps(doc, indent=1))
    report = render(points, doc["aggregate"], baseline)
    for other, agg in by_baseline.items():
        report += f"\n\nAgainst {other} (same points):\n\n" + render_aggregate({"": agg})
    (out / "report.md").write_text(report + "\n")
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixroute.bench.suite", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="folder of the suite's results (a set already there is kept)")
    parser.add_argument("--trace", help="a Mooncake-format trace for the conversation sets (skipped without it)")
    parser.add_argument("--routers", default=",".join(DEFAULT_ROUTERS), help="routers to run, comma-separated")
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="the router every point is compared with")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment setting for every run (e.g. PREFIXROUTE_TTFT_WORK_WEIGHT=4); repeatable")
    parser.add_argument("--jobs", type=int, default=2, help="sets run at once (one process each)")
    parser.add_argument("--only", default="", help="only these sets, comma-separated")
    parser.add_argument("--compare", nargs="+", type=Path, metavar="DIR", help="print these suites' aggregates")
    a = parser.parse_args(argv)
    if a.compare:
        aggs = {}
        for d in a.compare:
            path = d / "suite.json"
            if not path.exists():
                parser.error(f"{path} not found: run the suite with --out {d} first")
            aggs[str(d)] = json.loads(path.read_text())["aggregate"]
        print(render_aggregate(aggs))
        return 0
    if a.out is None:
        parser.error("--out is required (or --compare)")
    env = {}
    for kv in a.env:
        name, sep, value = kv.partition("=")
        if not sep or not name:
            parser.error(f"--env takes NAME=VALUE, got {kv!r}")
        env[name] = value
    only = [x for x in a.only.split(",") if x]
    unknown = set(only) - {s.name for s in SETS}
    if unknown:
        parser.error(f"unknown sets: {', '.join(sorted(unknown))}; choose from {', '.join(s.name for s in SETS)}")
    if a.trace and not Path(a.trace).exists():
        parser.error(f"--trace {a.trace}: no such file")
    doc = run_suite(a.out, trace=a.trace, routers=[r for r in a.routers.split(",") if r], baseline=a.baseline,
                    env=env, jobs=a.jobs, only=only)
    print(render([Point(**{**p, "ttft_s": tuple(p["ttft_s"]), "base_ttft_s": tuple(p["base_ttft_s"])})
                  for p in doc["points"]], doc["aggregate"], a.baseline))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
