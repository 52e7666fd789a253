"""Load sweeps (issue 12): the arrival rate as a share of the fleet's capacity, every router per load point.

`prefixroute bench --sweep-load-percents 40,80,110 [--virtual] ...`:

- **capacity** (`find_capacity`, the sweep's 100%): the highest Poisson rate at which ``sim:oracle`` (the
  virtual fleet's router that sees every server's true cache and queue) keeps the median *queueing* of the
  workload's requests at or under one cold prefill of its typical prompt. Queueing of a request = its TTFT minus
  its own prefill on an idle endpoint (`idle_prefill_s` of the prompt tokens it did not find cached, on top of
  those it did, in ``max_num_batched_tokens`` chunks: what the same server would take with nothing else to
  do). Typical prompt = the median prompt length in tokens (as the server counts them); its cold prefill is
  `idle_prefill_s` of it with nothing cached. Computed on the virtual fleet of the same workload (same
  requests), profile, server count and ``--server-args`` (so ``--time-scale=N`` lowers it N-fold), for real
  and virtual sweeps alike, so both share one definition of 100%. The search is seeded (the sweep's seed: the
  same arrival sequence, scaled) and deterministic: geometric bracketing from the throughput figure, then
  geometric bisection until the bracket is within `CAPACITY_PRECISION`; the rate returned is one where the
  criterion held. Memoised per (workload, spec, servers, seed, endpoint ids) in this process.
  The older throughput figure (`throughput_capacity_rps`: servers x prefill tokens/s over the uncached tokens a
  request needs at the upper-bound hit ratio) is kept in the output as a second number: it ignores queueing and
  the bunching of first uses, so it overstates what a fleet serves (2x on shared-prompts).
- **virtual** (`run_virtual_sweep`): ours and the ``sim:`` models on one request sequence per point, each
  router's gap to ``sim:oracle``, and the time model's prediction error for policies that keep
  ``predictions``;
- **real** (`run_real_sweep`): each router on fresh real processes (`runner.run_bench`: model servers, our
  gateway or a peer router, the streaming client) on one request sequence per point, with progress and an
  ETA from a virtual-time plan of the same runs.

Output (`write_sweep_outputs`): DIR/results.json (the sweep document, ``"kind": "sweep"``), DIR/report.md (the
table and the command), DIR/ttft_vs_load.png (TTFT p50/p90/p99 against load, one line per router) and
DIR/hit_ratio_vs_load.png; a real sweep also keeps each point's run document and logs in DIR/points/PCT/.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from prefixroute.bench import results as bench_results
from prefixroute.bench import workloads as wl_mod
from prefixroute.bench.client import RequestResult
from prefixroute.bench.workload_spec import Workload
from prefixroute.model_servers.profiles import EngineSpec
from prefixroute.model_servers.virtual_fleet import SimRequest

Log = Callable[[str], None]

DEFAULT_VIRTUAL_PERCENTS = (20.0, 40.0, 60.0, 80.0, 100.0, 120.0)
DEFAULT_REAL_PERCENTS = (40.0, 80.0, 110.0)
VIRTUAL_SWEEP_NUM_REQUESTS = 1500
"""Requests per point of a virtual sweep when --num-requests is not given: the P99 is then the mean of the 15
slowest requests, not one outlier."""
CAPACITY_PRECISION = 1.05
"""The capacity search stops when its bracket (criterion holds at lo, fails at hi) has hi / lo at most this."""
PREDICTION_WARMUP_PER_ENDPOINT = 200
"""The time model's prediction error counts each endpoint's first tokens after its first this many (the rates
it learns online have settled by then: issue 12's target)."""
REAL_RUN_OVERHEAD_S = 10.0
"""A real run's cost beyond its requests until one run measured it: fresh servers and router start, settle, the
last responses, scrape and stop."""

CAPACITY_DEFINITION = (
    "the highest Poisson rate at which sim:oracle keeps the median queueing (TTFT minus the request's own "
    "prefill of its uncached tokens on an idle endpoint) at or under one cold prefill of the workload's median "
    "prompt, on the virtual fleet of the same workload, profile, servers and --server-args")
THROUGHPUT_DEFINITION = ("servers x prefill tokens/s (full chunks, the profile's cost model) / (mean prompt tokens "
                         "x (1 - upper-bound hit ratio))")
PREDICTION_DEFINITION = (
    "median absolute percentage error |predicted - actual| / actual of the primary's predicted TTFT, over the "
    f"first tokens after each endpoint's first {PREDICTION_WARMUP_PER_ENDPOINT} (all first tokens when no "
    "endpoint had that many: scope 'all')")


# ------------------------------------------------------------------------------------------- capacity


def idle_prefill_s(spec: EngineSpec, new_tokens: int, cached_tokens: int = 0) -> float:
    """Seconds an idle server of `spec` takes to its first token for a prompt with `new_tokens` to compute on top
    of `cached_tokens` cached: ``max_num_batched_tokens`` chunks, each priced by the profile's cost model over the
    context computed so far, times the time scale (the engine's own step arithmetic for a lone sequence). At
    least one token is computed (a fully cached prompt recomputes its last)."""
    cfg = spec.config
    cost = spec.cost_model
    chunk = cfg.max_num_batched_tokens
    left = max(1, int(new_tokens))
    done = max(0, int(cached_tokens))
    t = 0.0
    while left > 0:
        n = min(chunk, left)
        t += cost.prefill_time_s(n, done)
        done += n
        left -= n
    return t * cfg.time_scale


def queueing_s(results: Sequence[RequestResult], spec: EngineSpec) -> list[float]:
    """Per successful request: TTFT minus `idle_prefill_s` of its uncached prompt tokens (as the server reported
    them) on top of its cached ones. Never negative (a rounding hair is clipped)."""
    out = []
    for r in results:
        if not r.ok or r.ttft_ms is None:
            continue
        cached = r.cached_tokens or 0
        own = idle_prefill_s(spec, r.prompt_tokens - cached, cached)
        out.append(max(0.0, r.ttft_ms / 1000.0 - own))
    return out


def typical_prompt_tokens(sims: Sequence[SimRequest]) -> int:
    """The workload's typical prompt: the median prompt length in tokens, as the server tokenizes it."""
    return int(statistics.median(len(s.prompt_ids) for s in sims)) if sims else 1


def prefill_capacity_tokens_per_s(spec: EngineSpec) -> float:
    """One server's prefill throughput in tokens/s: a full chunk (``max_num_batched_tokens``) per step, with the
    server's own cost model and time scale."""
    chunk = spec.config.max_num_batched_tokens
    return chunk / (spec.cost_model.prefill_time_s(chunk) * spec.config.time_scale)


def throughput_capacity_rps(workload: Workload, bound_hit_ratio: float, spec: EngineSpec, num_servers: int) -> float:
    """The second capacity figure (`THROUGHPUT_DEFINITION`): requests/s at which the fleet's prefill throughput
    equals the uncached prefill the workload needs at its upper-bound hit ratio. It ignores queueing and the
    bunching of a workload's first uses, so queues form well below it."""
    from prefixroute.bench.upper_bound import upper_bound

    ub = upper_bound(workload)
    mean_prompt = ub.prompt_tokens / max(1, ub.num_requests)
    uncached = max(1.0, mean_prompt * (1.0 - bound_hit_ratio))
    return num_servers * prefill_capacity_tokens_per_s(spec) / uncached


@dataclasses.dataclass(frozen=True)
class Capacity:
    """The sweep's 100% and how it was found (`find_capacity`)."""

    rps: float
    typical_prompt_tokens: int
    cold_prefill_s: float  # the criterion: median queueing at or under this
    throughput_rps: float
    search: tuple[dict, ...]  # every rate tried, in order: rate_rps, p50/p90 queueing s, holds
    search_wall_s: float

    def describe(self) -> dict[str, Any]:
        return {"rps": round(self.rps, 3), "definition": CAPACITY_DEFINITION,
                "typical_prompt_tokens": self.typical_prompt_tokens,
                "cold_prefill_s": round(self.cold_prefill_s, 4),
                "throughput_rps": round(self.throughput_rps, 3), "throughput_definition": THROUGHPUT_DEFINITION,
                "search": list(self.search), "search_wall_s": round(self.search_wall_s, 2)}


_CAPACITY_CACHE: dict[tuple, Capacity] = {}


def _workload_key(workload: Workload) -> tuple:
    return (workload.name, json.dumps(workload.params, sort_keys=True, default=str), len(workload.requests),
            tuple((r.index, r.num_chars(), r.after_index, r.max_tokens, r.group_id) for r in workload.requests))


def _spec_key(spec: EngineSpec) -> tuple:
    return (spec.profile.name, spec.config, spec.served_model_name, spec.max_model_len, spec.default_max_tokens,
            spec.lora_modules)


def oracle_queueing(workload: Workload, sims: Sequence[SimRequest], spec: EngineSpec, num_servers: int,
                    rate_rps: float, *, seed: int = 0, endpoint_ids: Sequence[str] | None = None
                    ) -> tuple[float, float]:
    """(P50, P90) queueing in seconds of ``sim:oracle`` on `workload` at Poisson `rate_rps` (seeded by `seed`);
    `sims` = `build_sim_requests` of the workload (any arrival times: they are replaced)."""
    from prefixroute.bench import virtual_run

    wl = wl_mod.apply_arrivals(workload, "poisson", rate_rps=rate_rps, seed=seed)
    res, _, _ = virtual_run.simulate_policy(wl, "sim:oracle", num_servers=num_servers, spec=spec, seed=seed,
                                        sims=retimed(sims, wl), endpoint_ids=endpoint_ids)
    q = sorted(queueing_s(res, spec))
    if not q:
        return float("inf"), float("inf")
    return _quantile(q, 0.5), _quantile(q, 0.9)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(sorted_values), q * 100))


def find_capacity(workload: Workload, spec: EngineSpec, num_servers: int, *, seed: int = 0,
                  sims: Sequence[SimRequest] | None = None, endpoint_ids: Sequence[str] | None = None,
                  precision: float = CAPACITY_PRECISION, log: Log = lambda _m: None) -> Capacity:
    """The sweep's capacity (module doc, `CAPACITY_DEFINITION`). Deterministic for a given workload, spec,
    server count and seed; memoised in this process. ValueError when no rate in [throughput / 4096,
    throughput x 256] brackets the criterion (a workload the oracle queues on at any rate, or never)."""
    from prefixroute.bench import virtual_run
    from prefixroute.bench.upper_bound import upper_bound

    key = (_workload_key(workload), _spec_key(spec), num_servers, seed, tuple(endpoint_ids or ()), precision)
    hit = _CAPACITY_CACHE.get(key)
    if hit is not None:
        return hit
    t0 = time.perf_counter()
    if sims is None:
        sims = virtual_run.build_sim_requests(wl_mod.apply_arrivals(workload, "poisson", rate_rps=1.0, seed=seed), spec)
    typical = typical_prompt_tokens(sims)
    limit_s = idle_prefill_s(spec, typical)
    throughput = throughput_capacity_rps(workload, upper_bound(workload).hit_ratio, spec, num_servers)
    trace: list[dict] = []
    memo: dict[float, bool] = {}

    def holds(rate: float) -> bool:
        if rate not in memo:
            p50, p90 = oracle_queueing(workload, sims, spec, num_servers, rate, seed=seed, endpoint_ids=endpoint_ids)
            memo[rate] = p50 <= limit_s
            trace.append({"rate_rps": round(rate, 4), "p50_queueing_s": round(p50, 4),
                          "p90_queueing_s": round(p90, 4), "holds": memo[rate]})
            log(f"capacity search: {rate:.3f} req/s -> oracle P50 queueing {p50:.3f}s "
                f"({'<=' if memo[rate] else '>'} {limit_s:.3f}s)")
        return memo[rate]

    # The throughput figure overstates capacity by ~2x on prefix-heavy workloads: start at half of it.
    rate = throughput / 2.0
    if holds(rate):
        lo, hi = rate, None
        for _ in range(8):
            if not holds(lo * 2.0):
                hi = lo * 2.0
                break
            lo *= 2.0
    else:
        lo, hi = None, rate
        for _ in range(11):
            if holds(hi / 2.0):
                lo = hi / 2.0
                break
            hi /= 2.0
    if lo is None or hi is None:
        raise ValueError(f"capacity search: no rate between {throughput / 4096:.3g} and {throughput * 256:.3g} "
                         f"req/s brackets the criterion (oracle P50 queueing <= {limit_s:.3f}s)")
    while hi / lo > precision:
        mid = (lo * hi) ** 0.5
        if holds(mid):
            lo = mid
        else:
            hi = mid
    cap = Capacity(lo, typical, limit_s, throughput, tuple(trace), time.perf_counter() - t0)
    _CAPACITY_CACHE[key] = cap
    return cap


def retimed(sims: Sequence[SimRequest], workload: Workload) -> list[SimRequest]:
    """`sims` (parsed once: tokenizing is the expensive part) with `workload`'s arrival times, in arrival order."""
    at = {str(r.index): r.arrival_s or 0.0 for r in workload.requests}
    out = [dataclasses.replace(s, arrival_s=at[s.request_id]) for s in sims]
    out.sort(key=lambda s: (s.arrival_s, int(s.request_id)))
    return out


# --------------------------------------------------------------------------------------------- routers


def default_routers(virtual: bool) -> tuple[str, ...]:
    """A sweep's routers when --routers is left at the bench's default. Virtual: every policy of ours (least to
    most informed, as the bench's default), then the ``sim:`` models (the oracle last: every gap's reference).
    Real: random (the no-information baseline), the default policy and sglang-router (issue 12's real sweep)."""
    from prefixroute.bench.settings import DEFAULT_ROUTERS
    from prefixroute.extproc.routing.settings import DEFAULT_POLICY

    if virtual:
        from prefixroute.bench.virtual_run import SIM_ROUTERS

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
            "throughput_rps": summary.get("throughput_rps")}


def _add_gaps(runs: Mapping[str, dict], reference: str = "sim:oracle") -> None:
    ref = runs.get(reference)
    if not ref:
        return
    for e in runs.values():
        e["gap_to_oracle"] = {q: (round((v - ref["ttft_ms"][q]) / ref["ttft_ms"][q], 4)
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
            "capacity": capacity.describe(), "points": []}


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
    from prefixroute.bench import virtual_run
    from prefixroute.bench.routers import parse_router
    from prefixroute.bench.upper_bound import upper_bound

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
    policies: dict[str, str] = {}
    for name in routers:
        if name.startswith("sim:"):
            if name not in virtual_run.SIM_ROUTERS:
                raise ValueError(f"unknown simulated router {name!r}; choose one of {', '.join(virtual_run.SIM_ROUTERS)}")
            policies[name] = name
            continue
        r = parse_router(name)
        if r.kind != "prefixroute":
            skipped[name] = "an external program: not simulated in --virtual (run without --virtual)"
            log(f"sweep: skipping {name}: {skipped[name]}")
            continue
        policies[name] = r.policy
    t_start = time.perf_counter()
    for k, pct in enumerate(load_percents):
        rate = cap.rps * pct / 100.0
        wl = wl_mod.apply_arrivals(workload, "poisson", rate_rps=rate, seed=seed)
        sims = retimed(sims0, wl)
        runs: dict[str, dict] = {}
        for name, policy in policies.items():
            t0 = time.perf_counter()
            predictions: list[tuple[str, float, float]] = []
            res, endpoints, _ = virtual_run.simulate_policy(wl, policy, num_servers=num_servers, spec=spec, seed=seed,
                                                        sims=sims, endpoint_ids=endpoint_ids,
                                                        predictions=predictions)
            entry = _entry(bench_results.summarize_run(name, res, endpoints))
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


def _virtual_model_of(name: str) -> str | None:
    """The policy (or ``sim:`` model) the virtual fleet runs for a real router, None if it has none."""
    from prefixroute.bench.routers import parse_router

    r = parse_router(name)
    if r.kind == "prefixroute":
        return r.policy
    if r.kind == "sglang-router" and r.policy == "cache_aware":
        return "sim:sglang-cache-aware"
    return None


def plan_real_sweep(workload: Workload, routers: Sequence[str], rates: Sequence[float], *, num_servers: int,
                    spec: EngineSpec, sims: Sequence[SimRequest], seed: int = 0) -> list[list[dict]]:
    """Per point, per router: the virtual fleet's run of the same requests (``est_s``: its last finish, the
    real run's replay time without the router's own costs; ``ttft_ms``: the virtual figures, None for a router
    the fleet does not model, whose ``est_s`` is then the arrival span plus the model's tail)."""
    from prefixroute.bench import virtual_run

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
            res, _, _ = virtual_run.simulate_policy(wl, model, num_servers=num_servers, spec=spec, seed=seed, sims=sm)
            finish = max((r.start_s + (r.e2e_ms or 0.0) / 1000.0 for r in res if r.ok), default=span)
            s = bench_results.summarize_run(name, res)
            row.append({"router": name, "model": model, "est_s": round(finish, 2), "ttft_ms": s["ttft_ms"],
                        "hit_ratio": s["hit_ratio"]})
        known = [c["est_s"] for c in row if c["est_s"] is not None]
        for c in row:
            if c["est_s"] is None:
                c["est_s"] = round(max(known) if known else span, 2)
        plan.append(row)
    return plan


def run_real_sweep(workload: Workload, routers: Sequence[str], fleet: Any, out_dir: Path, *, spec: EngineSpec,
                   load_percents: Sequence[float] = DEFAULT_REAL_PERCENTS, seed: int = 0, log: Log = print,
                   **run_kw: Any) -> dict:
    """Each router of `routers` on fresh real processes (`runner.run_bench`: `fleet`, a `runner.FleetConfig`) at
    each of `load_percents` of `find_capacity` (computed on the virtual fleet of `spec`: the servers' profile and
    --server-args); one Poisson request sequence per point shared by every router, the same server ports for
    every run (endpoint ids compare). Routers that cannot run here (a peer not installed, a failed start) are
    skipped and listed in ``skipped``. Each point's full run document and logs go to OUT/points/PCT/. Progress:
    a line per run with the time left, from a virtual-time plan of the runs (`plan_real_sweep`) corrected by the
    runs measured so far. `run_kw` goes to `runner.run_bench` (seed, concurrency, timeouts, progress)."""
    from prefixroute.bench import virtual_run
    from prefixroute.bench.fleet import distinct_free_ports
    from prefixroute.bench.routers import parse_router
    from prefixroute.bench.runner import host_cpu_times, run_bench
    from prefixroute.bench.upper_bound import upper_bound

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
    total_est = sum(map(sum, est))
    log(f"real sweep: {len(load_percents)} points x {len(routers)} routers, {len(workload.requests)} requests each; "
        f"estimated {format_duration(total_est)} (virtual-time plan + {REAL_RUN_OVERHEAD_S:g}s per run)")
    if not fleet.ports:
        fleet = dataclasses.replace(fleet, ports=distinct_free_ports(fleet.num_servers))
    doc = _document(workload, virtual=False, spec=spec, num_servers=fleet.num_servers, server_args=fleet.server_args,
                    capacity=cap, bound=bound, num_requests=len(workload.requests), seed=seed)
    doc["routers"] = list(routers)
    skipped: dict[str, str] = {}
    done_est = done_real = 0.0
    n_runs = len(load_percents) * len(routers)
    k = 0
    t_sweep = time.perf_counter()
    for pi, (pct, rate) in enumerate(zip(load_percents, rates)):
        wl = wl_mod.apply_arrivals(workload, "poisson", rate_rps=rate, seed=seed)
        point_dir = out_dir / "points" / f"{pct:g}pct"
        runs: dict[str, dict] = {}
        point_runs, point_ttfts = [], {}
        for ri, name in enumerate(routers):
            k += 1
            if name in skipped:
                continue
            log(f"sweep [{k}/{n_runs}] {pct:g}% ({rate:.2f} req/s) {name}: starting")
            cpu0 = host_cpu_times()
            t0 = time.perf_counter()
            d, ttfts = run_bench(wl, bound, [name], fleet, point_dir, log=log, seed=seed, **run_kw)
            dt = time.perf_counter() - t0
            cpu1 = host_cpu_times()
            if d.get("skipped"):
                skipped.update(d["skipped"])
                continue
            s = d["runs"][0]
            point_runs.append(s)
            point_ttfts.update(ttfts)
            e = _entry(s)
            extra = s.get("extra") or {}
            e.update(wall_s=round(dt, 1), replay_s=extra.get("wall_s"), server_hit_ratio=extra.get("server_hit_ratio"),
                     send_lag_p99_ms=(extra.get("send_lag_ms") or {}).get("p99"),
                     host_cpu_busy_ratio=extra.get("host_cpu_busy_ratio"))
            if cpu0 and cpu1 and cpu1[1] > cpu0[1]:
                e["host_cpu_busy_ratio_with_startup"] = round((cpu1[0] - cpu0[0]) / (cpu1[1] - cpu0[1]), 3)
            v = plan[pi][ri]
            if v.get("ttft_ms") is not None:
                e["virtual_estimate"] = {"model": v["model"], "ttft_ms": v["ttft_ms"], "hit_ratio": v["hit_ratio"]}
            runs[name] = e
            done_est += est[pi][ri]
            done_real += dt
            left = sum(est[pj][rj] for pj in range(len(rates)) for rj in range(len(routers))
                       if pj * len(routers) + rj >= k and routers[rj] not in skipped)
            t = e["ttft_ms"]
            log(f"sweep [{k}/{n_runs}] {pct:g}% {name}: done in {format_duration(dt)}: TTFT p50/p90/p99 "
                f"{_s(t['p50'])}/{_s(t['p90'])}/{_s(t['p99'])} s, hit ratio {e['hit_ratio']}, errors {e['errors']}, "
                f"host CPU {e.get('host_cpu_busy_ratio')}; ETA {format_duration(left * done_real / done_est)} "
                f"(elapsed {format_duration(time.perf_counter() - t_sweep)})")
        point_dir.mkdir(parents=True, exist_ok=True)
        pdoc = bench_results.results_document(wl.describe(), bound, point_runs)
        pdoc["workload"]["num_servers"] = fleet.num_servers
        (point_dir / "results.json").write_text(json.dumps(pdoc, indent=2) + "\n")
        doc["points"].append({"load_percent": pct, "rate_rps": round(rate, 4), "runs": runs})
    if skipped:
        doc["skipped"] = skipped
    doc["wall_s"] = round(time.perf_counter() - t_sweep, 1)
    return doc


def _s(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.3f}"


# ---------------------------------------------------------------------------------------------- output

PLOT_FILES = ("ttft_vs_load.png", "hit_ratio_vs_load.png")


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
    head = ["load", "rate req/s", "router", "TTFT p50 s", "p90 s", "p99 s", "hit ratio", "max share/fair", "errors"]
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
            row = [f"{p['load_percent']:g}%", f"{p['rate_rps']:.2f}", name, _s(t.get("p50")), _s(t.get("p90")),
                   _s(t.get("p99")), hr, share, str(e["errors"])]
            if gaps:
                g = e.get("gap_to_oracle") or {}
                row += [pct(g.get("p50")), pct(g.get("p90")), pct(g.get("p99"))]
            if preds:
                m = e.get("prediction_mape")
                row += ["-" if m is None else f"{m:.1%} ({e['prediction_scope']})"]
            if real:
                v = (e.get("virtual_estimate") or {}).get("ttft_ms") or {}
                row += [f"{_s(v.get('p50'))} / {_s(v.get('p99'))}" if v else "-",
                        "-" if e.get("host_cpu_busy_ratio") is None else f"{e['host_cpu_busy_ratio']:.0%}"]
            lines.append("| " + " | ".join(row) + " |")
    lines.append("")
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
    files = {"results": out / "results.json", "report": out / "report.md"}
    files["results"].write_text(json.dumps(doc, indent=2) + "\n")
    files["report"].write_text(render_report(doc, command))
    try:
        paths = plot_sweep(out, doc)
    except ImportError as exc:  # matplotlib comes with the [bench] extra; the numbers do not need it
        print(f"no plots: {exc} (pip install 'prefixroute[bench]')", file=sys.stderr)
        paths = []
    for p in paths:
        files[p.stem] = p
    return files
