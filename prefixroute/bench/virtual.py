"""`prefixroute bench --virtual`: our policies' scheduling code against a virtual-time fleet.

The live router's pure parts (`parse_request` + `RouterCore`: the same Scheduler, scorers and prefix index
as the ext_proc service) route each request at its arrival time; the model servers' `VirtualFleet` (same
engine core, KV cache and cost model as the HTTP servers) serves it on a simulated clock. 8-256 servers
and whole traces run in seconds to minutes of CPU, with the same results.json as a real run.

What the router sees: a fresh `EndpointState` snapshot per request (a perfect, zero-delay scraper) and
in-flight counts equal to each server's running + waiting requests (the router's own count, exact here
because nothing is lost). The live gateway's scrape interval and staleness are therefore not modelled.

Limits (reported in results.json ``extra``):
- open-loop only: closed-loop arrivals need per-request completion callbacks, which the fleet API does
  not give; a closed-loop workload is refused with a message;
- ``after_index`` dependencies (multi-turn) are not enforced: a turn is sent at its arrival time even if
  the previous turn is still running (with Poisson gaps longer than a turn's latency this changes nothing);
- ITL is each request's mean inter-token time ((finish - first token) / (tokens - 1)), one sample per
  generated token, because the fleet reports no per-token times;
- peer routers (sglang-router, vllm-router) are separate programs and are skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from prefixroute.bench import results as bench_results
from prefixroute.bench.client import RequestResult
from prefixroute.bench.runner import parse_router
from prefixroute.bench.workloads import Workload


class VirtualFleetUnavailable(RuntimeError):
    """The virtual fleet or the routing core cannot be imported, or the workload cannot be simulated."""


def _imports() -> tuple[Any, ...]:
    try:
        from prefixroute.model_servers.virtual import SimRequest, VirtualFleet
        from prefixroute.routing.request import parse_request
        from prefixroute.routing.router import RouterCore
        from prefixroute.routing.settings import RoutingSettings
    except ImportError as exc:  # pragma: no cover - only when a component is missing
        raise VirtualFleetUnavailable(f"cannot import the virtual fleet or routing core: {exc}") from exc
    return SimRequest, VirtualFleet, parse_request, RouterCore, RoutingSettings


def _fleet_kwargs(server_args: Sequence[str]) -> dict[str, Any]:
    """Map the model-server flags that the virtual fleet also takes (``--time-scale=X`` or ``--time-scale X``)."""
    known = {"--time-scale": ("time_scale", float), "--num-gpu-blocks": ("num_gpu_blocks", int),
             "--max-num-seqs": ("max_num_seqs", int), "--max-num-batched-tokens": ("max_num_batched_tokens", int),
             "--block-size": ("block_size", int)}
    out: dict[str, Any] = {}
    args = list(server_args)
    i = 0
    while i < len(args):
        flag, _, val = args[i].partition("=")
        if flag in known and not val and i + 1 < len(args):
            i += 1
            val = args[i]
        if flag in known:
            name, tp = known[flag]
            out[name] = tp(val)
        i += 1
    return out


def build_sim_requests(workload: Workload, model: str, routing_settings: Any) -> list[Any]:
    """`SimRequest`s in arrival order, each carrying its parsed router request (`meta`). Independent of the
    policy, so one list serves every policy of a run (rendering + tokenizing is the expensive part).
    A request the router refuses (e.g. 413 body too large) keeps ``meta`` = the `OpenAIError`."""
    SimRequest, _, parse_request, _, _ = _imports()
    from prefixroute.openai_errors import OpenAIError

    if any(r.arrival_s is None for r in workload.requests):
        raise VirtualFleetUnavailable("--virtual needs arrival times (trace or poisson), not closed-loop arrivals")
    sims = []
    for spec in sorted(workload.requests, key=lambda r: (r.arrival_s, r.index)):
        try:
            parsed = parse_request("POST", spec.path, {}, orjson.dumps(spec.body(model)), routing_settings)
        except OpenAIError as exc:
            parsed = exc
        if spec.messages is not None:
            sim = SimRequest.from_messages(str(spec.index), spec.arrival_s, [dict(m) for m in spec.messages],
                                           spec.max_tokens, meta=parsed)
        else:
            sim = SimRequest.from_text(str(spec.index), spec.arrival_s, spec.prompt or "", spec.max_tokens,
                                       meta=parsed)
        sims.append(sim)
    return sims


def simulate_policy(workload: Workload, policy: str, *, num_servers: int, profile: str = "", seed: int = 0,
                    fleet_kwargs: dict[str, Any] | None = None,
                    sims: list[Any] | None = None) -> tuple[list[RequestResult], list[str], float]:
    """Route `workload` with one of our policies on a fresh virtual fleet.

    Returns (per-request results in request order, endpoint ids, CPU seconds the simulation took).
    `sims` (from `build_sim_requests` with default routing settings) may be passed to reuse them.
    """
    _, VirtualFleet, _, RouterCore, RoutingSettings = _imports()
    fleet = VirtualFleet(profile or "llama-3.1-8b-h200", num_servers, **(fleet_kwargs or {}))
    router = RouterCore(RoutingSettings(policy=policy, rng_seed=seed))
    router.sync_endpoints(fleet.endpoint_states())
    if sims is None:
        sims = build_sim_requests(workload, fleet.served, router.settings)

    def route(req: Any, fl: Any) -> str:
        states = fl.endpoint_states()
        in_flight = {s.endpoint: (s.num_requests_running or 0) + (s.num_requests_waiting or 0) for s in states}
        return router.route(req.meta, states, in_flight).endpoints[0]

    # A prompt the model cannot hold is a 400 on a real server, a body the router refuses its 4xx: record
    # them as such instead of simulating them.
    refused = {s.request_id: s.meta for s in sims if isinstance(s.meta, Exception)}
    too_long = {s.request_id for s in sims if len(s.prompt_ids) + s.max_tokens > fleet.max_model_len}
    too_long |= set(refused)
    t0 = time.process_time()
    sim_results = fleet.run([s for s in sims if s.request_id not in too_long], route)
    cpu_s = time.process_time() - t0
    by_id = {r.request_id: r for r in sim_results}
    out = []
    for spec in workload.requests:
        r = by_id.get(str(spec.index))
        if str(spec.index) in refused:
            err = refused[str(spec.index)]
            out.append(RequestResult(index=spec.index, group_id=spec.group_id, start_s=spec.arrival_s or 0.0,
                                     status=getattr(err, "status", 400), error=f"http {getattr(err, 'status', 400)}: "
                                                                              f"router refused: {err}"))
            continue
        if str(spec.index) in too_long:
            out.append(RequestResult(index=spec.index, group_id=spec.group_id, start_s=spec.arrival_s or 0.0,
                                     status=400, error=f"http 400: prompt + max_tokens exceeds the context "
                                                       f"window of {fleet.max_model_len} tokens"))
            continue
        if r is None:
            out.append(RequestResult(index=spec.index, group_id=spec.group_id, start_s=spec.arrival_s or 0.0,
                                     error="not finished in simulation"))
            continue
        n = r.completion_tokens
        mean_gap_ms = (r.finished_s - r.first_token_s) * 1000.0 / (n - 1) if n > 1 else None
        out.append(RequestResult(index=spec.index, group_id=spec.group_id, start_s=r.arrival_s, status=200,
                                 ttft_ms=r.ttft_s * 1000.0, itl_ms=[mean_gap_ms] * (n - 1) if mean_gap_ms else [],
                                 e2e_ms=r.e2e_s * 1000.0, prompt_tokens=r.prompt_tokens,
                                 completion_tokens=n, cached_tokens=r.cached_tokens, endpoint=r.endpoint))
    return out, list(fleet.endpoint_ids), cpu_s


def run_virtual(workload: Workload, upper_bound_hit_ratio: float | None, routers: Sequence[str], *,
                num_servers: int, profile: str = "", seed: int = 0, concurrency: int = 0,
                server_args: Sequence[str] = (), log: Callable[[str], None] = print) -> tuple[dict, dict]:
    """Every `prefixroute:*` router of `routers` on a fresh virtual fleet; same document as a real run."""
    del concurrency  # closed loop is refused in simulate_policy
    _, VirtualFleet, _, _, RoutingSettings = _imports()
    kwargs = _fleet_kwargs(server_args)
    model = VirtualFleet(profile or "llama-3.1-8b-h200", 1, **kwargs).served
    sims = build_sim_requests(workload, model, RoutingSettings())
    runs, ttfts, skipped = [], {}, {}
    for name in routers:
        spec = parse_router(name)
        if spec.kind != "prefixroute":
            skipped[spec.name] = "an external program: not simulated in --virtual (run without --virtual)"
            log(f"skipping {spec.name}: {skipped[spec.name]}")
            continue
        t0 = time.perf_counter()
        res, endpoints, cpu_s = simulate_policy(workload, spec.policy, num_servers=num_servers, profile=profile,
                                                seed=seed, fleet_kwargs=kwargs, sims=sims)
        wall_s = time.perf_counter() - t0
        log(f"{spec.name}: simulated {len(res)} requests on {num_servers} servers in {wall_s:.1f}s")
        runs.append(bench_results.summarize_run(spec.name, res, endpoints, extra={
            "policy": spec.policy, "virtual": True, "sim_cpu_s": round(cpu_s, 3), "wall_s": round(wall_s, 3),
            "itl_definition": "per-request mean inter-token time"}))
        ttfts[spec.name] = [r.ttft_ms for r in res if r.ok and r.ttft_ms is not None]
    doc = bench_results.results_document(workload.describe(), upper_bound_hit_ratio, runs)
    doc["workload"].update(num_servers=num_servers, virtual=True, fleet=kwargs or {})
    if skipped:
        doc["skipped"] = skipped
    return doc, ttfts
