"""The capacity of a fleet for a workload: the 100% of a load sweep, `find_capacity`.

The highest Poisson rate at which ``sim:oracle`` (the virtual fleet's router that sees every server's true cache
and queue) keeps the median *queueing* of the workload's requests at or under one cold prefill of its typical
prompt. Queueing of a request = its TTFT minus its own prefill on an idle endpoint (`idle_prefill_s` of the
prompt tokens it did not find cached, on top of those it did, in ``max_num_batched_tokens`` chunks: what the
same server would take with nothing else to do). Typical prompt = the median prompt length in tokens (as the
server counts them); its cold prefill is `idle_prefill_s` of it with nothing cached. Computed on the virtual
fleet of the same workload (same requests), profile, server count and ``--server-args`` (so
``--time-scale=N`` lowers it N-fold), for real and virtual sweeps alike, so both share one definition of 100%.
The search is seeded (the sweep's seed: the same arrival sequence, scaled) and deterministic: geometric
bracketing from the throughput figure, then geometric bisection until the bracket is within
`CAPACITY_PRECISION`; the rate returned is one where the criterion held. Memoised per (workload, spec,
servers, seed, endpoint ids) in this process.

The older throughput figure (`throughput_capacity_rps`: servers x prefill tokens/s over the uncached tokens a
request needs at the upper-bound hit ratio) is kept in the output as a second number: it ignores queueing and
the bunching of first uses, so it overstates what a fleet serves (2x on shared-prompts).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from prefixroute.bench import virtual_run
from prefixroute.bench import workloads as wl_mod
from prefixroute.bench.client import RequestResult
from prefixroute.bench.upper_bound import upper_bound
from prefixroute.bench.workload_spec import Workload
from prefixroute.model_servers.profiles import EngineSpec
from prefixroute.model_servers.virtual_fleet import SimRequest

CAPACITY_PRECISION = 1.05
"""The capacity search stops when its bracket (criterion holds at lo, fails at hi) has hi / lo at most this."""

CAPACITY_DEFINITION = (
    "the highest Poisson rate at which sim:oracle keeps the median queueing (TTFT minus the request's own "
    "prefill of its uncached tokens on an idle endpoint) at or under one cold prefill of the workload's median "
    "prompt, on the virtual fleet of the same workload, profile, servers and --server-args")
THROUGHPUT_DEFINITION = ("servers x prefill tokens/s (full chunks, the profile's cost model) / (mean prompt tokens "
                         "x (1 - upper-bound hit ratio))")


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
    wl = wl_mod.apply_arrivals(workload, "poisson", rate_rps=rate_rps, seed=seed)
    res, _, _ = virtual_run.simulate_policy(wl, "sim:oracle", num_servers=num_servers, spec=spec, seed=seed,
                                        sims=retimed(sims, wl), endpoint_ids=endpoint_ids)
    q = sorted(queueing_s(res, spec))
    if not q:
        return float("inf"), float("inf")
    return _quantile(q, 0.5), _quantile(q, 0.9)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(sorted_values), q * 100))


def find_capacity(workload: Workload, spec: EngineSpec, num_servers: int, *, seed: int = 0,
                  sims: Sequence[SimRequest] | None = None, endpoint_ids: Sequence[str] | None = None,
                  precision: float = CAPACITY_PRECISION, log: Callable[[str], None] = lambda _m: None) -> Capacity:
    """The sweep's capacity (module doc, `CAPACITY_DEFINITION`). Deterministic for a given workload, spec,
    server count and seed; memoised in this process. ValueError when no rate in [throughput / 4096,
    throughput x 256] brackets the criterion (a workload the oracle queues on at any rate, or never)."""
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
