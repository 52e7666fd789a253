"""`prefixroute bench --virtual`: our policies' scheduling code against a virtual-time fleet.

The live router's pure parts (`parse_request` + `RouterCore`: the same Scheduler, scorers and prefix index
as the ext_proc service) route each request at its arrival time; the model servers' `VirtualFleet` (same
engine core, KV cache and cost model as the HTTP servers) serves it on a simulated clock. 8-256 servers
and whole traces run in seconds to minutes of CPU, with the same results.json as a real run.

What the router sees: a fresh `EndpointState` snapshot per request (a perfect, zero-delay scraper) and
in-flight counts equal to each server's running + waiting requests (the router's own count, exact here
because nothing is lost). The live gateway's scrape interval and staleness are therefore not modelled.
Each request is released (`RouterCore.on_release`, router built with ``track_prefill=True``) when it
finishes, where the gateway releases its in-flight count, so the prefix policy's outstanding-prefill
estimate (cold placement) is in use here; the live gateway uses it once it makes the same call.

Arrivals, as the live client (`bench/client.py`) sends them:
- open loop (trace or Poisson times): a request arrives at its time, but never before its ``after_index``
  request (the previous turn of its session) has finished: it is then sent the moment that turn ends;
- closed loop (no times): ``concurrency`` clients each take the next request in index order, wait for its
  ``after_index`` request if that is still running, send it, and take the next one when it finishes.
Both use the fleet's ``on_finish`` callback; a request refused before the fleet (router 4xx, prompt over the
context window) counts as finished at once for its dependents.

Limits (reported in results.json ``extra``):
- ITL is each request's mean inter-token time ((finish - first token) / (tokens - 1)), one sample per
  generated token, because the fleet reports no per-token times;
- peer routers (sglang-router, vllm-router) are separate programs and are skipped; ``sim:sglang-cache-aware``
  runs `SglangCacheAwareModel`, our model of sglang-router's cache_aware policy, so a comparison takes seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from prefixroute.bench import results as bench_results
from prefixroute.bench.client import RequestResult
from prefixroute.bench.runner import RouterSpec, parse_router
from prefixroute.bench.workloads import Workload


class VirtualFleetUnavailable(RuntimeError):
    """The virtual fleet or the routing core cannot be imported, or the workload cannot be simulated."""


def _imports() -> tuple[Any, ...]:
    try:
        from prefixroute.model_servers.virtual import SimRequest, VirtualFleet
        from prefixroute.extproc.routing.request import parse_request
        from prefixroute.extproc.routing.router import RouterCore
        from prefixroute.extproc.routing.settings import RoutingSettings
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
    """`SimRequest`s in arrival order (index order under closed loop), each carrying its parsed router request (`meta`). Independent of the
    policy, so one list serves every policy of a run (rendering + tokenizing is the expensive part).
    A request the router refuses (e.g. 413 body too large) keeps ``meta`` = the `OpenAIError`."""
    SimRequest, _, parse_request, _, _ = _imports()
    from prefixroute.openai_errors import OpenAIError

    sims = []
    for spec in sorted(workload.requests, key=lambda r: (r.arrival_s or 0.0, r.index)):
        try:
            parsed = parse_request("POST", spec.path, {}, orjson.dumps(spec.body(model)), routing_settings)
        except OpenAIError as exc:
            parsed = exc
        if spec.messages is not None:
            sim = SimRequest.from_messages(str(spec.index), spec.arrival_s or 0.0, [dict(m) for m in spec.messages],
                                           spec.max_tokens, meta=parsed)
        else:
            sim = SimRequest.from_text(str(spec.index), spec.arrival_s or 0.0, spec.prompt or "", spec.max_tokens,
                                       meta=parsed)
        sims.append(sim)
    return sims


class SglangCacheAwareModel:
    """OUR MODEL of sglang-router's ``cache_aware`` policy (field notes section 3), written from its public
    description, not their code, for side-by-side comparisons in virtual time:

    - each endpoint has a tree of the request texts sent to it (characters; here approximated by chained
      hashes of `block_chars`-character blocks, so matches are counted in whole blocks);
    - load = requests in flight on the endpoint; if ``max - min > balance_abs_threshold`` (64) and
      ``max > balance_rel_threshold x min`` (1.5), the least-loaded endpoint is chosen;
    - else, if the longest prefix match / text length > ``cache_threshold`` (0.3), the endpoint with the
      longest match; else the endpoint with the smallest tree (fewest characters stored);
    - the chosen endpoint's tree then gets the text. Ties go to the first endpoint in fleet order (the
      behaviour field notes section 5 reports at zero load). Trees are not evicted (theirs evict by size
      well beyond these runs' text volume).

    Text routed on: the completion prompt, or the chat messages' contents joined by newlines (an
    assumption about their text extraction).
    """

    def __init__(self, endpoint_ids: Sequence[str], *, block_chars: int = 16, cache_threshold: float = 0.3,
                 balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5) -> None:
        from prefixroute.extproc.routing.prefix_index import PrefixIndex

        self.endpoint_ids = list(endpoint_ids)
        self.block_chars = block_chars
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.trees = PrefixIndex(1 << 40)  # one chained-hash set per endpoint: the tree, as prefix paths

    @staticmethod
    def request_text(req: Any) -> str:
        if req.text is not None:
            return req.text
        return "\n".join(str(m.get("content", "")) for m in req.messages or ())

    def choose(self, text: str, in_flight: Sequence[int]) -> int:
        from prefixroute.extproc.routing.hashing import hash_blocks, seed_for

        hashes = hash_blocks(text, seed_for(None, None), self.block_chars, 1 << 30)
        lo, hi = min(in_flight), max(in_flight)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            i = in_flight.index(lo)
        else:
            matches = self.trees.match(hashes) if hashes else {}
            best = max(matches.values(), default=0)
            if text and best * self.block_chars / len(text) > self.cache_threshold:
                i = next(j for j, ep in enumerate(self.endpoint_ids) if matches.get(ep) == best)
            else:
                sizes = [self.trees.num_entries(ep) for ep in self.endpoint_ids]
                i = sizes.index(min(sizes))
        if hashes:
            self.trees.record(hashes, self.endpoint_ids[i])
        return i

    def route(self, req: Any, fleet: Any) -> int:
        in_flight = [len(e.running) + len(e.waiting) for e in fleet.engines]
        return self.choose(self.request_text(req), in_flight)


SIM_ROUTERS: dict[str, Callable[[Sequence[str]], Any]] = {
    "sim:sglang-cache-aware": SglangCacheAwareModel,
}
"""Models of other routers that --virtual can run by name (``sim:NAME``)."""


class _Arrivals:
    """Releases a workload's `SimRequest`s to the fleet as the live client would send them (module doc).

    `initial()` is the iterable for ``fleet.run``; `on_finish` is its callback. Requests are copied, so the
    prepared list can serve the next policy unchanged. Skipped requests (refused, too long) are finished at
    once for their dependents and, in closed loop, cost their client no time.
    """

    def __init__(self, workload: Workload, sims: Sequence[Any], skipped: set[str], concurrency: int) -> None:
        import dataclasses

        self.closed = any(r.arrival_s is None for r in workload.requests)
        self.concurrency = max(1, concurrency)
        deps = {str(r.index): str(r.after_index) for r in workload.requests if r.after_index is not None}
        ids = {s.request_id for s in sims}
        self.skipped = skipped
        # a dependency outside the workload (or refused) never blocks: the live client ignores/finishes it
        self.after = {k: v for k, v in deps.items() if v in ids and v not in skipped}
        self.sims = [dataclasses.replace(s) for s in sims]
        self.finished: set[str] = set()
        self.parked: dict[str, list[Any]] = {}  # unfinished request id -> requests waiting for it
        self._queue = iter(sorted((s for s in self.sims if s.request_id not in skipped), key=lambda s: int(
            s.request_id))) if self.closed else None

    def initial(self) -> list[Any]:
        if self.closed:
            out: list[Any] = []
            for _ in range(self.concurrency):
                out += self._next_for_client(0.0)
            return out
        out = []
        for s in self.sims:  # sorted by arrival
            if s.request_id in self.skipped:
                continue
            dep = self.after.get(s.request_id)
            if dep is None:
                out.append(s)
            else:
                self.parked.setdefault(dep, []).append(s)
        return out

    def _next_for_client(self, now_s: float) -> list[Any]:
        """Closed loop: a client takes the next request; it waits (parked) if its previous turn still runs."""
        for s in self._queue:  # type: ignore[union-attr]
            s.arrival_s = now_s
            dep = self.after.get(s.request_id)
            if dep is not None and dep not in self.finished:
                self.parked.setdefault(dep, []).append(s)
                return []
            return [s]
        return []

    def on_finish(self, result: Any, fleet: Any) -> list[Any]:
        rid = result.request_id
        self.finished.add(rid)
        # Open loop: a waiting turn goes now or at its own time (the fleet moves earlier times to now).
        # Closed loop: its client was blocked on this request, so it is sent now.
        out = self.parked.pop(rid, [])
        if self.closed:
            for s in out:
                s.arrival_s = fleet.now_s
            out = out + self._next_for_client(fleet.now_s)
        return out


def simulate_policy(workload: Workload, policy: str, *, num_servers: int, profile: str = "", seed: int = 0,
                    fleet_kwargs: dict[str, Any] | None = None, sims: list[Any] | None = None,
                    concurrency: int = 16) -> tuple[list[RequestResult], list[str], float]:
    """Route `workload` with one of our policies (or a ``sim:`` model of another router, see `SIM_ROUTERS`)
    on a fresh virtual fleet.

    Returns (per-request results in request order, endpoint ids, CPU seconds the simulation took).
    `sims` (from `build_sim_requests` with default routing settings) may be passed to reuse them.
    `concurrency` is the number of clients of a closed-loop workload (no arrival times).
    """
    _, VirtualFleet, _, RouterCore, RoutingSettings = _imports()
    fleet = VirtualFleet(profile or "llama-3.1-8b-h200", num_servers, **(fleet_kwargs or {}))
    if sims is None:
        sims = build_sim_requests(workload, fleet.served, RoutingSettings())
    if policy.startswith("sim:"):
        if policy not in SIM_ROUTERS:
            raise ValueError(f"unknown simulated router {policy!r}; choose one of {', '.join(SIM_ROUTERS)}")
        route = SIM_ROUTERS[policy](fleet.endpoint_ids).route
        router = None
    else:
        router = RouterCore(RoutingSettings(policy=policy, rng_seed=seed), track_prefill=True)
        router.sync_endpoints(fleet.endpoint_states())
        routed: dict[str, Any] = {}  # request id -> (parsed request, decision) until it finishes

        def route(req: Any, fl: Any) -> str:
            states = fl.endpoint_states()
            in_flight = {s.endpoint: (s.num_requests_running or 0) + (s.num_requests_waiting or 0) for s in states}
            decision = router.route(req.meta, states, in_flight)
            routed[req.request_id] = (req.meta, decision)
            return decision.endpoints[0]

    # A prompt the model cannot hold is a 400 on a real server, a body the router refuses its 4xx: record
    # them as such instead of simulating them.
    refused = {s.request_id: s.meta for s in sims if isinstance(s.meta, Exception)}
    too_long = {s.request_id for s in sims if len(s.prompt_ids) + s.max_tokens > fleet.max_model_len}
    too_long |= set(refused)
    arrivals = _Arrivals(workload, sims, too_long, concurrency)
    on_finish = arrivals.on_finish
    if router is not None:
        def on_finish(result: Any, fl: Any) -> list[Any]:
            # as the gateway releases its in-flight count when the response ends
            got = routed.pop(result.request_id, None)
            if got is not None:
                router.on_release(*got)
            return arrivals.on_finish(result, fl)
    t0 = time.process_time()
    sim_results = fleet.run(arrivals.initial(), route, on_finish=on_finish)
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
        if r.first_token_s is None:  # engine quirk (a prefill left at exactly 1 token): no first-token time
            out.append(RequestResult(index=spec.index, group_id=spec.group_id, start_s=r.arrival_s,
                                     error="simulation recorded no first-token time"))
            continue
        mean_gap_ms = (r.finished_s - r.first_token_s) * 1000.0 / (n - 1) if n > 1 else None
        out.append(RequestResult(index=spec.index, group_id=spec.group_id, start_s=r.arrival_s, status=200,
                                 ttft_ms=r.ttft_s * 1000.0, itl_ms=[mean_gap_ms] * (n - 1) if mean_gap_ms else [],
                                 e2e_ms=r.e2e_s * 1000.0, prompt_tokens=r.prompt_tokens,
                                 completion_tokens=n, cached_tokens=r.cached_tokens, endpoint=r.endpoint))
    return out, list(fleet.endpoint_ids), cpu_s


def run_virtual(workload: Workload, upper_bound_hit_ratio: float | None, routers: Sequence[str], *,
                num_servers: int, profile: str = "", seed: int = 0, concurrency: int = 0,
                server_args: Sequence[str] = (), log: Callable[[str], None] = print) -> tuple[dict, dict]:
    """Every `prefixroute:*` router (and ``sim:*`` model) of `routers` on a fresh virtual fleet; same document
    as a real run. `concurrency` = clients of a closed-loop workload."""
    _, VirtualFleet, _, _, RoutingSettings = _imports()
    kwargs = _fleet_kwargs(server_args)
    model = VirtualFleet(profile or "llama-3.1-8b-h200", 1, **kwargs).served
    sims = build_sim_requests(workload, model, RoutingSettings())
    runs, ttfts, skipped = [], {}, {}
    for name in routers:
        if name.startswith("sim:"):
            if name not in SIM_ROUTERS:
                raise ValueError(f"unknown simulated router {name!r}; choose one of {', '.join(SIM_ROUTERS)}")
            spec = RouterSpec(name, "sim", name)
        else:
            spec = parse_router(name)
        if spec.kind not in ("prefixroute", "sim"):
            skipped[spec.name] = "an external program: not simulated in --virtual (run without --virtual)"
            log(f"skipping {spec.name}: {skipped[spec.name]}")
            continue
        t0 = time.perf_counter()
        res, endpoints, cpu_s = simulate_policy(workload, spec.policy, num_servers=num_servers, profile=profile,
                                                seed=seed, fleet_kwargs=kwargs, sims=sims,
                                                concurrency=concurrency or 16)
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
