"""Load sweeps: the arrival rate as a share of the fleet's capacity, every router per load point.

`prefixroute bench --sweep-load-percents 40,80,110 [--virtual] ...`:

- **capacity** (bench/capacity.py, `find_capacity`, the sweep's 100%): the highest Poisson rate at which
  ``sim:oracle`` keeps the median queueing of the workload's requests at or under one cold prefill of its
  typical prompt, on the virtual fleet of the same workload, profile, servers and ``--server-args``, for real
  and virtual sweeps alike (one definition of 100%);
- **virtual** (`run_virtual_sweep`): ours and the ``sim:`` models on one request sequence per point, each
  router's gap to ``sim:oracle``, and the time model's prediction error for policies that keep
  ``predictions``;
- **real** (`run_real_sweep`): each router on fresh real processes (`runner.run_bench`: model servers, our
  gateway or a peer router, the streaming client) on one request sequence per point, with progress and an
  ETA from a virtual-time plan of the same runs.

Output (bench/sweep_report.py, `write_sweep_outputs`): DIR/results.json (the sweep document, ``"kind":
"sweep"``), DIR/report.md, DIR/ttft_vs_load.png and DIR/hit_ratio_vs_load.png; a real sweep also keeps each
point's run document and logs in DIR/points/PCT/.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from prefixroute.bench import results as bench_results
from prefixroute.bench import virtual_run
from prefixroute.bench import workloads as wl_mod
from prefixroute.bench.capacity import CAPACITY_DEFINITION, Capacity, find_capacity, retimed
from prefixroute.bench.fleet import FleetConfig, distinct_free_ports
from prefixroute.bench.routers import RouterSpec, parse_router
from prefixroute.bench.runner import host_cpu_times, run_bench
from prefixroute.bench.settings import DEFAULT_ROUTERS
from prefixroute.bench.upper_bound import fleet_bounds, upper_bound
from prefixroute.bench.virtual_run import SIM_ROUTERS
from prefixroute.bench.workload_spec import Workload
from prefixroute.extproc.routing.settings import DEFAULT_POLICY
from prefixroute.model_servers.profiles import EngineSpec
from prefixroute.model_servers.virtual_fleet import SimRequest

Log = Callable[[str], None]

DEFAULT_VIRTUAL_PERCENTS = (20.0, 40.0, 60.0, 80.0, 100.0, 120.0)
DEFAULT_REAL_PERCENTS = (40.0, 80.0, 110.0)
VIRTUAL_SWEEP_NUM_REQUESTS = 1500
"""Requests per point of a virtual sweep when --num-requests is not given: the P99 is then the mean of the 15
slowest requests, not one outlier."""
PREDICTION_WARMUP_PER_ENDPOINT = 200
"""The time model's prediction error counts each endpoint's first tokens after its first this many (the rates
it learns online have settled by then)."""
REAL_RUN_OVERHEAD_S = 10.0
"""A real run's cost beyond its requests until one run measured it: fresh servers and router start, settle, the
last responses, scrape and stop."""

PREDICTION_DEFINITION = (
    "median absolute percentage error |predicted - actual| / actual of the primary's predicted TTFT, over the "
    f"first tokens after each endpoint's first {PREDICTION_WARMUP_PER_ENDPOINT} (all first tokens when no "
    "endpoint had that many: scope 'all')")


# --------------------------------------------------------------------------------------------- routers


def default_routers(virtual: bool) -> tuple[str, ...]:
    """A sweep's routers when --routers is left at the bench's default. Virtual: every policy of ours (least to
    most informed, as the bench's default), then the ``sim:`` models (the oracle last: every gap's reference).
    Real: random (the no-information baseline), the default policy and sglang-router (the real sweep in docs/benchmarks.md)."""
    if virtual:
        sims = sorted(SIM_ROUTERS, key=lambda n: n == "sim:oracle")
        return (*(r for r in DEFAULT_ROUTERS if r.startswith("prefixroute:")), *sims)
    return tuple(dict.fromkeys(("prefixroute:random", f"prefixroute:{DEFAULT_POLICY}", "sglang-router")))


def prediction_error(predictions: Sequence[tuple[str, float, float]],
                     warmup: int = PREDICTION_WARMUP_PER_ENDPOINT) -> tuple[float | None, str, int]:
    """(median absolute percentage error, scope, requests counted) of (endpoint, predicted_s, actual_s) in
    first-token order (`PREDICTION_DEFINITION`). Scope ``after N per endpoint`` or ``all``; error None when
    nothing was predicted."""
    seen: dict[str, int] = {}
    tail = []
    for ep, p, a in predictions:
        k = seen.get(ep, 0)
        seen[ep] = k + 1
        if k >= warmup and a > 0:
            tail.append(abs(p - a) / a)
    scope = f"after {warmup} per endpoint"
    if not tail:
        tail = [abs(p - a) / a for _, p, a in predictions if a > 0]
        scope = "all"
    if not tail:
        return None, scope, 0
    return round(statistics.median(tail), 4), scope, len(tail)


def _entry(summary: Mapping[str, Any]) -> dict[str, Any]:
    extra = summary.get("extra") or {}
    return {"requests": summary["requests"], "errors": summary["errors"], "ttft_ms": summary["ttft_ms"],
            "hit_ratio": summary["hit_ratio"], "max_share_over_fair": extra.get("max_share_over_fair"),
            "throughput_rps": summary.get("throughput_rps"), "num_shed": extra.get("num_shed", 0),
            "goodput": extra.get("goodput"),
            **({"false_sheds": extra["false_sheds"]} if "false_sheds" in extra else {}),
            **({"hit_ratio_by_tier": extra["hit_ratio_by_tier"]} if "hit_ratio_by_tier" in extra else {})}


SLO_COLD_PREFILLS = 5.0
"""The sweep's tighter service level beside goodput (bench/results.py: TTFT within the deadline): the share of
requests whose TTFT is within 5 cold prefills of the workload's median prompt (the capacity's
``cold_prefill_s``); a shed or failed request is a miss. (Sweeps before goodput was judged by the deadline
called this share ``goodput_ratio``.)"""


def slo_met_ratio(results: Sequence[Any], slo_ms: float) -> float | None:
    """Share of `results` (RequestResult) served with TTFT <= `slo_ms`; None when there are none."""
    if not results:
        return None
    good = sum(1 for r in results if r.ok and r.ttft_ms is not None and r.ttft_ms <= slo_ms)
    return round(good / len(results), 4)


def _add_gaps(runs: Mapping[str, dict], reference: str = "sim:oracle") -> None:
    """Each run's gap per percentile to `reference` (``gap_to_oracle``) and, when it ran, to the oracle behind
    the gateway queue (``gap_to_oracle_flow``: the reference for routers with flow control)."""
    for ref_name, key in ((reference, "gap_to_oracle"), ("sim:oracle+flow", "gap_to_oracle_flow")):
        ref = runs.get(ref_name)
        if not ref:
            continue
        for e in runs.values():
            e[key] = {q: (round((v - ref["ttft_ms"][q]) / ref["ttft_ms"][q], 4)
                          if v is not None and ref["ttft_ms"].get(q) else None)
                      for q, v in e["ttft_ms"].items()}


def _document(workload: Workload, *, virtual: bool, spec: EngineSpec, num_servers: int, server_args: Sequence[str],
              capacity: Capacity, bound: float, num_requests: int, seed: int) -> dict[str, Any]:
    # The workload without the arrival figures of the single run it was built for: each point has its own.
    described = {k: v for k, v in workload.describe().items() if k not in ("arrival", "rate_rps", "duration_s")}
    return {"kind": "sweep", "virtual": virtual, "workload": described,
            "num_requests_per_point": num_requests, "num_servers": num_servers, "profile": spec.profile.name,
            "server_args": list(server_args), "time_scale": spec.config.time_scale, "seed": seed,
            "upper_bound_hit_ratio": round(bound, 4), "capacity_rps": round(capacity.rps, 3),
            "capacity": capacity.describe(), "points": [],
            "bounds": fleet_bounds(workload, num_servers, spec.profile.name, server_args)}


# --------------------------------------------------------------------------------------------- virtual


def run_virtual_sweep(workload: Workload, routers: Sequence[str], *, num_servers: int, spec: EngineSpec,
                      load_percents: Sequence[float] = DEFAULT_VIRTUAL_PERCENTS, seed: int = 0,
                      server_args: Sequence[str] = (), endpoint_ids: Sequence[str] | None = None,
                      log: Log = print) -> dict:
    """Poisson arrivals at each of `load_percents` of `find_capacity`, every router of `routers` (ours and ``sim:``
    models; peers are skipped with a note) on the same request sequence per point; open loop (``after_index``
    turns still wait for their previous turn). Returns the sweep document (module doc): per point and router
    TTFT p50/p90/p99 (ms), hit ratio, max endpoint share over fair, errors, each percentile's gap to
    ``sim:oracle`` when it ran ((router - oracle) / oracle; negative = better than the oracle), and, for
    policies that keep ``predictions``, the time model's error (`prediction_error`)."""
    bound = upper_bound(workload).hit_ratio
    sims0 = virtual_run.build_sim_requests(wl_mod.apply_arrivals(workload, "poisson", rate_rps=1.0, seed=seed), spec)
    cap = find_capacity(workload, spec, num_servers, seed=seed, sims=sims0, endpoint_ids=endpoint_ids, log=log)
    log(f"capacity of {workload.name} on {num_servers} x {spec.profile.name}: {cap.rps:.3f} req/s "
        f"({CAPACITY_DEFINITION}; cold prefill of the median prompt of {cap.typical_prompt_tokens} tokens = "
        f"{cap.cold_prefill_s:.3f}s; found in {cap.search_wall_s:.1f}s); throughput figure {cap.throughput_rps:.3f}")
    doc = _document(workload, virtual=True, spec=spec, num_servers=num_servers, server_args=server_args,
                    capacity=cap, bound=bound, num_requests=len(workload.requests), seed=seed)
    doc["prediction_error_definition"] = PREDICTION_DEFINITION
    skipped: dict[str, str] = {}
    policies: dict[str, VirtualModel] = {}
    for name in routers:
        if name.startswith("sim:"):
            if name not in SIM_ROUTERS:
                raise ValueError(f"unknown simulated router {name!r}; choose one of {', '.join(SIM_ROUTERS)}")
            policies[name] = VirtualModel(name)
            continue
        r = parse_router(name)
        if r.kind != "prefixroute":
            skipped[name] = "an external program: not simulated in --virtual (run without --virtual)"
            log(f"sweep: skipping {name}: {skipped[name]}")
            continue
        policies[name] = VirtualModel.of(r)
    t_start = time.perf_counter()
    for k, pct in enumerate(load_percents):
        rate = cap.rps * pct / 100.0
        wl = wl_mod.apply_arrivals(workload, "poisson", rate_rps=rate, seed=seed)
        sims = retimed(sims0, wl)
        runs: dict[str, dict] = {}
        for name, model in policies.items():
            t0 = time.perf_counter()
            predictions: list[tuple[str, float, float]] = []
            counts: dict = {}
            res, endpoints, _ = model.simulate(wl, num_servers=num_servers, spec=spec, seed=seed, sims=sims,
                                               endpoint_ids=endpoint_ids, predictions=predictions, flow_counts=counts)
            entry = _entry(bench_results.summarize_run(name, res, endpoints))
            if counts:
                entry["flow"] = counts
            entry["slo_met_ratio"] = slo_met_ratio(res, SLO_COLD_PREFILLS * cap.cold_prefill_s * 1000.0)
            entry.update(virtual_run.judge_sheds(res, lambda queued: dataclasses.replace(
                model, flow=model.flow if queued else None,
                policy=model.policy if queued else virtual_run.unqueued_policy(model.policy)).simulate(
                wl, num_servers=num_servers, spec=spec, seed=seed, sims=sims, endpoint_ids=endpoint_ids,
                shed=False)[0]))
            entry["wall_s"] = round(time.perf_counter() - t0, 2)
            if predictions:
                err, scope, n = prediction_error(predictions)
                entry.update(prediction_mape=err, prediction_scope=scope, prediction_requests=n)
            runs[name] = entry
        _add_gaps(runs)
        doc["points"].append({"load_percent": pct, "rate_rps": round(rate, 4), "runs": runs})
        elapsed = time.perf_counter() - t_start
        eta = elapsed / (k + 1) * (len(load_percents) - k - 1)
        log(f"sweep [{k + 1}/{len(load_percents)}]: {pct:g}% of capacity ({rate:.2f} req/s) done; "
            f"ETA {format_duration(eta)}")
    doc["routers"] = list(policies)
    if skipped:
        doc["skipped"] = skipped
    return doc


# ------------------------------------------------------------------------------------------------ real


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


@dataclasses.dataclass(frozen=True)
class VirtualModel:
    """What the virtual fleet runs for a router name: the policy (or ``sim:`` model) and, for ours, the whole
    name's ``@SOURCE`` (prefix-index source) and ``+flow`` / ``-flow`` (flow control), so a sweep of
    ``prefixroute:prefix@feedback+flow`` simulates exactly that router, not its bare policy."""

    policy: str
    index_source: str = ""
    flow: Any = None  # FlowSettings, None: flow control off (a ``sim:`` model's own default applies)

    @classmethod
    def of(cls, router: RouterSpec) -> VirtualModel:
        return cls(router.policy, router.index_source, virtual_run.flow_settings_for(router))

    def simulate(self, wl: Workload, **kw: Any) -> tuple[list, list[str], float]:
        """`virtual_run.simulate_policy` of this model (keyword arguments passed on)."""
        return virtual_run.simulate_policy(wl, self.policy, index_source=self.index_source, flow=self.flow, **kw)


def _virtual_model_of(name: str) -> VirtualModel | None:
    """The model the virtual fleet runs for a real router, None if it has none."""
    r = parse_router(name)
    if r.kind == "prefixroute":
        return VirtualModel.of(r)
    if r.kind == "sglang-router" and r.policy == "cache_aware":
        return VirtualModel("sim:sglang-cache-aware")
    return None


def plan_real_sweep(workload: Workload, routers: Sequence[str], rates: Sequence[float], *, num_servers: int,
                    spec: EngineSpec, sims: Sequence[SimRequest], seed: int = 0) -> list[list[dict]]:
    """Per point, per router: the virtual fleet's run of the same requests (``est_s``: its last finish, the
    real run's replay time without the router's own costs; ``ttft_ms``: the virtual figures, None for a router
    the fleet does not model, whose ``est_s`` is then the arrival span plus the model's tail)."""
    plan = []
    for rate in rates:
        wl = wl_mod.apply_arrivals(workload, "poisson", rate_rps=rate, seed=seed)
        sm = retimed(sims, wl)
        row = []
        span = max((r.arrival_s or 0.0) for r in wl.requests)
        for name in routers:
            model = _virtual_model_of(name)
            if model is None:
                row.append({"router": name, "est_s": None, "ttft_ms": None, "hit_ratio": None})
                continue
            res, _, _ = model.simulate(wl, num_servers=num_servers, spec=spec, seed=seed, sims=sm)
            finish = max((r.start_s + (r.e2e_ms or 0.0) / 1000.0 for r in res if r.ok), default=span)
            s = bench_results.summarize_run(name, res)
            row.append({"router": name, "model": model.policy, "est_s": round(finish, 2), "ttft_ms": s["ttft_ms"],
                        "hit_ratio": s["hit_ratio"]})
        known = [c["est_s"] for c in row if c["est_s"] is not None]
        for c in row:
            if c["est_s"] is None:
                c["est_s"] = round(max(known) if known else span, 2)
        plan.append(row)
    return plan


def run_real_sweep(workload: Workload, routers: Sequence[str], fleet: FleetConfig, out_dir: Path, *,
                   spec: EngineSpec, load_percents: Sequence[float] = DEFAULT_REAL_PERCENTS, seed: int = 0,
                   log: Log = print, **run_kw: Any) -> dict:
    """Each router of `routers` on fresh real processes (`runner.run_bench` on `fleet`) at each of `load_percents`
    of `find_capacity` (computed on the virtual fleet of `spec`: the servers' profile and --server-args); one
    Poisson request sequence per point shared by every router, the same server ports for every run (endpoint ids
    compare). Routers that cannot run here (a peer not installed, a failed start) are skipped and listed in
    ``skipped``. Each point's full run document and logs go to OUT/points/PCT/. Progress: a line per run with the
    time left, from a virtual-time plan of the runs (`plan_real_sweep`) corrected by the runs measured so far.
    `run_kw` goes to `runner.run_bench` (seed, concurrency, timeouts, progress)."""
    for name in routers:
        parse_router(name)
    bound = upper_bound(workload).hit_ratio
    sims0 = virtual_run.build_sim_requests(wl_mod.apply_arrivals(workload, "poisson", rate_rps=1.0, seed=seed), spec)
    cap = find_capacity(workload, spec, fleet.num_servers, seed=seed, sims=sims0, log=log)
    log(f"capacity of {workload.name} on {fleet.num_servers} x {spec.profile.name} (time scale "
        f"{spec.config.time_scale:g}): {cap.rps:.3f} req/s ({CAPACITY_DEFINITION}; cold prefill of the median "
        f"prompt of {cap.typical_prompt_tokens} tokens = {cap.cold_prefill_s:.3f}s); throughput figure "
        f"{cap.throughput_rps:.3f} req/s")
    rates = [cap.rps * p / 100.0 for p in load_percents]
    plan = plan_real_sweep(workload, routers, rates, num_servers=fleet.num_servers, spec=spec, sims=sims0, seed=seed)
    est = [[c["est_s"] + REAL_RUN_OVERHEAD_S for c in row] for row in plan]
    log(f"real sweep: {len(load_percents)} points x {len(routers)} routers, {len(workload.requests)} requests each; "
        f"estimated {format_duration(sum(map(sum, est)))} (virtual-time plan + {REAL_RUN_OVERHEAD_S:g}s per run)")
    if not fleet.ports:
        fleet = dataclasses.replace(fleet, ports=distinct_free_ports(fleet.num_servers))
    doc = _document(workload, virtual=False, spec=spec, num_servers=fleet.num_servers, server_args=fleet.server_args,
                    capacity=cap, bound=bound, num_requests=len(workload.requests), seed=seed)
    doc["routers"] = list(routers)
    sweep = _RealSweep(workload, tuple(routers), fleet, out_dir, bound, seed, log, run_kw,
                       _SweepEta(est, tuple(routers)))
    for pi, (pct, rate) in enumerate(zip(load_percents, rates)):
        doc["points"].append(sweep.run_point(pi, pct, rate, plan[pi]))
    if sweep.eta.skipped:
        doc["skipped"] = sweep.eta.skipped
    doc["wall_s"] = round(sweep.eta.elapsed_s(), 1)
    return doc


@dataclasses.dataclass
class _SweepEta:
    """A real sweep's progress: `est` [point][router] the virtual-time plan's estimate of each run (seconds),
    scaled by how the runs measured so far compare with theirs; the routers skipped so far (never run again)."""

    est: list[list[float]]
    routers: tuple[str, ...]
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    done_est_s: float = 0.0
    done_real_s: float = 0.0
    t0: float = dataclasses.field(default_factory=time.perf_counter)

    @property
    def num_runs(self) -> int:
        return len(self.est) * len(self.routers)

    def ran(self, pi: int, ri: int, wall_s: float) -> None:
        self.done_est_s += self.est[pi][ri]
        self.done_real_s += wall_s

    def left_s(self, k: int) -> float:
        """Seconds left after the `k`-th run (1-based, point-major order), the skipped routers' runs left out."""
        n = len(self.routers)
        left = sum(self.est[pj][rj] for pj in range(len(self.est)) for rj in range(n)
                   if pj * n + rj >= k and self.routers[rj] not in self.skipped)
        return left * self.done_real_s / self.done_est_s

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0


@dataclasses.dataclass
class _RealSweep:
    """One real sweep under way: runs one point's routers at a time (`run_point`), keeps the ETA and skips."""

    workload: Workload
    routers: tuple[str, ...]
    fleet: FleetConfig
    out_dir: Path
    bound: float
    seed: int
    log: Log
    run_kw: dict[str, Any]
    eta: _SweepEta

    def run_point(self, pi: int, pct: float, rate: float, plan_row: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Every router not skipped at `rate` (the `pi`-th point, `pct` % of capacity); writes the point's run
        document to OUT/points/PCT/results.json and returns the sweep document's point."""
        wl = wl_mod.apply_arrivals(self.workload, "poisson", rate_rps=rate, seed=self.seed)
        point_dir = self.out_dir / "points" / f"{pct:g}pct"
        runs: dict[str, dict] = {}
        point_runs = []
        for ri, name in enumerate(self.routers):
            k = pi * len(self.routers) + ri + 1
            if name in self.eta.skipped:
                continue
            self.log(f"sweep [{k}/{self.eta.num_runs}] {pct:g}% ({rate:.2f} req/s) {name}: starting")
            ran = self._run_one(wl, name, point_dir, plan_row[ri])
            if ran is None:
                continue
            summary, runs[name], wall_s = ran
            point_runs.append(summary)
            self.eta.ran(pi, ri, wall_s)
            t, e = runs[name]["ttft_ms"], runs[name]
            self.log(f"sweep [{k}/{self.eta.num_runs}] {pct:g}% {name}: done in {format_duration(wall_s)}: TTFT "
                     f"p50/p90/p99 {seconds_text(t['p50'])}/{seconds_text(t['p90'])}/{seconds_text(t['p99'])} s, "
                     f"hit ratio {e['hit_ratio']}, errors {e['errors']}, host CPU {e.get('host_cpu_busy_ratio')}; "
                     f"ETA {format_duration(self.eta.left_s(k))} (elapsed {format_duration(self.eta.elapsed_s())})")
        point_dir.mkdir(parents=True, exist_ok=True)
        pdoc = bench_results.results_document(wl.describe(), self.bound, point_runs)
        pdoc["workload"]["num_servers"] = self.fleet.num_servers
        (point_dir / "results.json").write_text(json.dumps(pdoc, indent=2) + "\n")
        return {"load_percent": pct, "rate_rps": round(rate, 4), "runs": runs}

    def _run_one(self, wl: Workload, name: str, point_dir: Path, planned: Mapping[str, Any]
                 ) -> tuple[dict[str, Any], dict[str, Any], float] | None:
        """`name` on fresh processes for `wl`: (its run summary, its sweep entry, wall seconds with startup), or
        None when it was skipped (recorded with the reason)."""
        cpu0 = host_cpu_times()
        t0 = time.perf_counter()
        d, _ttfts = run_bench(wl, self.bound, [name], self.fleet, point_dir, log=self.log, seed=self.seed,
                              **self.run_kw)
        wall_s = time.perf_counter() - t0
        cpu1 = host_cpu_times()
        if d.get("skipped"):
            self.eta.skipped.update(d["skipped"])
            return None
        busy = round((cpu1[0] - cpu0[0]) / (cpu1[1] - cpu0[1]), 3) if cpu0 and cpu1 and cpu1[1] > cpu0[1] else None
        return d["runs"][0], _real_entry(d["runs"][0], wall_s, busy, planned), wall_s


def _real_entry(summary: Mapping[str, Any], wall_s: float, busy_with_startup: float | None,
                planned: Mapping[str, Any]) -> dict[str, Any]:
    """A real run's entry in the sweep document: `_entry`, the run's wall time and replay figures, the host's busy
    share of its cores (during the replay; with startup when known), and the virtual fleet's estimate of the same
    run (`planned`, a `plan_real_sweep` cell) when it has one."""
    e = _entry(summary)
    extra = summary.get("extra") or {}
    e.update(wall_s=round(wall_s, 1), replay_s=extra.get("wall_s"), server_hit_ratio=extra.get("server_hit_ratio"),
             send_lag_p99_ms=(extra.get("send_lag_ms") or {}).get("p99"),
             host_cpu_busy_ratio=extra.get("host_cpu_busy_ratio"))
    if busy_with_startup is not None:
        e["host_cpu_busy_ratio_with_startup"] = busy_with_startup
    flow = (extra.get("router_metrics") or {}).get("flow")
    if flow:  # flow control's counters, scraped from the router at the end of the run
        e["flow"] = flow
    if planned.get("ttft_ms") is not None:
        e["virtual_estimate"] = {"model": planned["model"], "ttft_ms": planned["ttft_ms"],
                                 "hit_ratio": planned["hit_ratio"]}
    return e


def seconds_text(ms: float | None) -> str:
    """Milliseconds as seconds with 3 decimals ("-" for None): the sweep's tables and logs."""
    return "-" if ms is None else f"{ms / 1000:.3f}"
