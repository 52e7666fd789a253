"""`prefixroute bench --virtual`: the live router on a virtual-time fleet of simulated servers.

One code path with the live gateway, minus the network:
- the router is the ext_proc service's own `PoolRouter` (`parse_request` + `RouterCore` + in-flight
  accounting), over `SimulatedPool` (the live pool's interface over the fleet, bench/sim_pool.py), with one
  `RoutingSettings` (policy, and --seed as the routing seed, as the real bench gives the gateway) and the
  default `PoolSettings`, both read with their ``PREFIXROUTE_*`` environment variables as the gateway reads
  them. It sees what a live router sees: load figures scraped every scrape interval (up to one interval old),
  its own in-flight counts (acquired at the pick, released when the response ends, where the gateway
  releases), the request headers a live client sends;
- every request is the body a live client sends (`RequestSpec.body`, `CLIENT_HEADERS`): the router parses
  those bytes, and the simulated server builds its engine request from the same bytes with the HTTP server's
  parser (`SimRequest.from_body`), so tokenization, chat template, model/LoRA, ``cache_salt``, the
  ``max_tokens`` default and 400s (prompt over the context window) are the server's;
- the servers are `VirtualFleet` engines built from the `EngineSpec` of ``prefixroute model-server --profile
  P <--server-args>`` (`engine_spec`: the server's own settings parser), on a simulated clock. 8-256 servers
  and whole traces run in seconds to minutes of CPU, with the same results.json as a real run.

Not modelled: network and router latency (a decision takes no virtual time), failures (simulated servers
never fail, so no failover), health probes (every server is up from the start, as after a live pool's
`wait_ready`).

Arrivals, as the live client (`bench/client.py`) sends them:
- open loop (trace or Poisson times): a request arrives at its time, but never before its ``after_index``
  request (the previous turn of its session) has finished, plus its ``think_s``: it is then sent that long
  after that turn ends;
- closed loop (no times): ``concurrency`` clients each take the next request in index order, wait for its
  ``after_index`` request if that is still running, send it, and take the next one when it finishes.
Both use the fleet's ``on_finish`` callback; a refused request (router or server 4xx) finishes at once.

Limits (reported in results.json ``extra``):
- ITL is each request's mean inter-token time ((finish - first token) / (tokens - 1)), one sample per
  generated token, because the fleet reports no per-token times;
- peer routers (sglang-router, vllm-router) are separate programs and are skipped; ``sim:sglang-cache-aware``
  runs `SglangCacheAwareModel`, our model of sglang-router's cache_aware policy, on the same requests, so a
  comparison takes seconds.
"""

from __future__ import annotations

import collections

import argparse
import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence

import orjson

from prefixroute import settings as settings_mod
from prefixroute.bench import results as bench_results
from prefixroute.bench.client import RequestResult
from prefixroute.bench.flow_virtual import FleetFlow, OracleFlow, Route
from prefixroute.bench.routers import PRIOR_ENV, RouterSpec, parse_router
from prefixroute.bench.sim_pool import SimulatedPool
from prefixroute.bench.sim_routers import (  # noqa: F401 - re-exported: tests and sweeps name them here
    FLOW_SIM_ROUTERS, ORACLES, SIM_ROUTERS, OracleModel, SglangCacheAwareModel)
from prefixroute.bench.workload_spec import RequestSpec, Workload
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.kv_events.tiers import TieredKVEventIndex
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.factory import build_router, new_event_index, uses_kv_events
from prefixroute.extproc.flow.metrics import flow_counts as metrics_flow_counts
from prefixroute.extproc.flow.router import RouterView
from prefixroute.extproc.flow.settings import FlowSettings
from prefixroute.extproc.lifecycle import LifecycleListener, Pick
from prefixroute.extproc.routing.request import InferenceRequest, parse_request
from prefixroute.extproc.service import PoolRouter
from prefixroute.extproc.tenants import Tenants, TenantSettings
from prefixroute.model_servers.profiles import EngineSpec
from prefixroute.model_servers.server import ServerSettings
from prefixroute.model_servers.virtual_fleet import SimRequest, SimResult, VirtualFleet

CLIENT_HEADERS: Mapping[str, str] = {"content-type": "application/json"}
"""The headers the live bench client sends with every request (lower case, as Envoy hands them to ext_proc)."""

UNSIMULATED_SERVER_SETTINGS = ("fail_ratio", "extra_latency_ms", "refuse_connections", "max_body_bytes")
"""Model-server behaviours the virtual fleet does not reproduce: --server-args may not change them. (The
other non-engine flags, such as --port or --log-level, have no effect on a simulated run.)"""


class _ArgsError(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def engine_spec(profile: str = "", server_args: Sequence[str] = (), *, allow_unsimulated: bool = False) -> EngineSpec:
    """The spec of ``prefixroute model-server [--profile PROFILE] SERVER_ARGS`` (as the real bench starts its
    servers), parsed with the model server's own settings parser and environment variables; engine flags such
    as ``--time-scale`` (slower simulated GPUs) apply. ValueError, with the flag named, for an unknown flag, a
    bad value or, unless `allow_unsimulated` (a real sweep's capacity: the real servers do inject them), a
    behaviour the fleet does not simulate (`UNSIMULATED_SERVER_SETTINGS`)."""
    parser = _ArgsError(prog="prefixroute model-server", add_help=False)
    settings_mod.add_arguments(parser, ServerSettings)
    args = [*(("--profile", profile) if profile else ()), *server_args]
    try:
        ns, unknown = parser.parse_known_args(args)
        if unknown:
            raise ValueError(f"unknown model-server flag(s): {' '.join(unknown)}")
        s = settings_mod.from_namespace(ServerSettings, ns)
        defaults = ServerSettings()
        for name in () if allow_unsimulated else UNSIMULATED_SERVER_SETTINGS:
            if getattr(s, name) != getattr(defaults, name):
                raise ValueError(f"--{name.replace('_', '-')} is not simulated by --virtual (run without "
                                 f"--virtual to use it)")
        return EngineSpec.from_settings(s)
    except ValueError as exc:
        raise ValueError(f"--server-args {' '.join(server_args)!r}: {exc}") from None


def build_sim_requests(workload: Workload, spec: EngineSpec) -> list[SimRequest]:
    """The workload's requests as the live client sends them (body bytes, headers), parsed by the server side
    of `spec`; in arrival order (index order under closed loop). Independent of the router, so one list serves
    every router of a run (tokenizing is the expensive part)."""
    return [SimRequest.from_body(str(r.index), r.arrival_s or 0.0, r.path,
                                 orjson.dumps(r.body(spec.served_model_name)), spec, CLIENT_HEADERS)
            for r in sorted(workload.requests, key=lambda r: (r.arrival_s or 0.0, r.index))]


class _Arrivals:
    """Releases a workload's `SimRequest`s to the fleet as the live client would send them (module doc).

    `initial()` is the iterable for ``fleet.run``; `on_finish` is its callback. Requests are copied, so the
    prepared list can serve the next router unchanged.
    """

    def __init__(self, workload: Workload, sims: Sequence[SimRequest], concurrency: int) -> None:
        self.closed = any(r.arrival_s is None for r in workload.requests)
        self.concurrency = max(1, concurrency)
        deps = {str(r.index): str(r.after_index) for r in workload.requests if r.after_index is not None}
        self.think_s = {str(r.index): r.think_s for r in workload.requests if r.think_s > 0}
        ids = {s.request_id for s in sims}
        self.after = {k: v for k, v in deps.items() if v in ids}  # one outside the workload never blocks
        self.sims = [dataclasses.replace(s) for s in sims]
        self.finished: set[str] = set()
        self.parked: dict[str, list[SimRequest]] = {}  # unfinished request id -> requests waiting for it
        self._queue = iter(sorted(self.sims, key=lambda s: int(s.request_id))) if self.closed else None

    def initial(self) -> list[SimRequest]:
        if self.closed:
            out: list[SimRequest] = []
            for _ in range(self.concurrency):
                out += self._next_for_client(0.0)
            return out
        out = []
        for s in self.sims:  # sorted by arrival
            dep = self.after.get(s.request_id)
            if dep is None:
                out.append(s)
            else:
                self.parked.setdefault(dep, []).append(s)
        return out

    def _next_for_client(self, now_s: float) -> list[SimRequest]:
        """Closed loop: a client takes the next request; it waits (parked) if its previous turn still runs."""
        for s in self._queue:  # type: ignore[union-attr]
            s.arrival_s = now_s
            dep = self.after.get(s.request_id)
            if dep is not None and dep not in self.finished:
                self.parked.setdefault(dep, []).append(s)
                return []
            return [s]
        return []

    def on_finish(self, result: SimResult, fleet: VirtualFleet) -> list[SimRequest]:
        rid = result.request_id
        self.finished.add(rid)
        # Open loop: a waiting turn goes now or at its own time (the fleet moves earlier times to now).
        # Closed loop: its client was blocked on this request, so it is sent now.
        out = self.parked.pop(rid, [])
        if self.closed:
            for s in out:
                s.arrival_s = fleet.now_s
        for s in out:  # a think time after the previous turn (an agent's tool) delays the follow-up
            think = self.think_s.get(s.request_id)
            if think and s.arrival_s < fleet.now_s + think:
                s.arrival_s = fleet.now_s + think
        if self.closed:
            out = out + self._next_for_client(fleet.now_s)
        return out


class _TtftPredictions(LifecycleListener):
    """(primary endpoint, predicted TTFT s, actual TTFT s) of every pick with a prediction (the prefix policy's),
    at its TTFT sample (first token, then usage): a listener of the router's lifecycle, in first-token order."""

    def __init__(self, out: list[tuple[str, float, float]]) -> None:
        self.out = out

    def on_ttft_sample(self, pick: Pick) -> None:
        predicted_ms = pick.decision.predicted_ttft_ms
        if predicted_ms is not None and pick.ttft_s is not None:
            self.out.append((pick.endpoint_ids[0], predicted_ms / 1000.0, pick.ttft_s))


class _FleetRouting:
    """The live router service (`extproc.factory.build_router`) routing a virtual fleet: each request's pick,
    its first token (with its usage: the fleet knows both at once; live, the usage comes at the end) and its
    release, through the router service's one lifecycle (extproc/lifecycle.py), as the gateway reports them.
    The fleet reports a request only when it ends, so the requests routed and not yet past their first token
    are checked at each decision (all a policy can act on) and at their end."""

    def __init__(self, fleet: VirtualFleet, pool: SimulatedPool, routing: RoutingSettings,
                 predictions: list[tuple[str, float, float]] | None) -> None:
        self.fleet = fleet
        # KV events in process: each engine's events reach the router's events index at the step's virtual
        # time (a live router gets them over ZMQ about a millisecond later).
        event_index = None
        if uses_kv_events(routing):
            event_index = new_event_index(routing)
            apply_events = event_index.apply_events
            fleet.publish_kv_events(lambda ep, events: collections.deque(apply_events(ep, events), maxlen=0))
        # Who sent each request, as the gateway reads it: the operator's tenant settings (and environment).
        flow_names = settings_mod.from_namespace(FlowSettings)
        tenants = Tenants(settings_mod.from_namespace(TenantSettings), tenant_header=routing.tenant_header,
                          priority_header=flow_names.priority_header, objective_header=flow_names.objective_header,
                          fairness_header=flow_names.fairness_header)
        self.router = build_router(routing, pool, event_index=event_index, event_endpoints=fleet.endpoint_ids,
                                   clock=lambda: fleet.now_s, tenants=tenants)
        if predictions is not None:
            self.router.add_listener(_TtftPredictions(predictions))
        self.event_index = event_index
        # request id -> the router's (GPU, CPU) blocks at its pick (a tier-aware events index only)
        self.tier_pred: dict[str, tuple[int, int]] = {}
        self.picks: dict[str, Pick] = {}  # request id -> its pick, until the response ends
        self.no_token: dict[str, Pick] = {}  # request id -> pick, first token not yet delivered
        self.pick_time: dict[str, float] = {}
        self.engine_of = {ep: fleet.engines[i] for i, ep in enumerate(fleet.endpoint_ids)}
        self.parsed: dict[str, InferenceRequest] = {}  # held requests, parsed once for their cost and route

    def _first_token(self, rid: str, pick: Pick, first_token_s: float, prompt_tokens: int,
                     cached_tokens: int) -> None:
        del self.no_token[rid]
        self.router.first_token(pick, first_token_s - self.pick_time[rid])
        self.router.usage(pick, prompt_tokens, cached_tokens)

    def deliver_first_tokens(self) -> None:
        if not self.no_token:
            return
        waiting_on: dict[str, dict[str, Pick]] = {}
        for rid, pick in self.no_token.items():
            waiting_on.setdefault(pick.counted, {})[rid] = pick
        for ep, rids in waiting_on.items():
            for r in self.engine_of[ep].running:
                if r.first_token_s is not None and r.request_id in rids:
                    self._first_token(r.request_id, rids[r.request_id], r.first_token_s, r.num_prompt_tokens,
                                      r.num_cached_tokens)

    def route(self, req: SimRequest, fl: VirtualFleet) -> str:
        self.deliver_first_tokens()
        pick = self.router.route("POST", req.path, req.headers, self.parsed.pop(req.request_id, None) or req.body)
        if isinstance(self.event_index, TieredKVEventIndex) and pick.endpoint_ids:
            self.tier_pred[req.request_id] = self.event_index.last_tiers(pick.endpoint_ids[0])
        self.picks[req.request_id] = pick
        self.no_token[req.request_id] = pick
        self.pick_time[req.request_id] = fl.now_s
        return pick.endpoint_ids[0]

    def release(self, result: SimResult) -> None:
        pick = self.picks.pop(result.request_id, None)
        if pick is None:  # the router refused it (nothing was counted)
            return
        if result.request_id in self.no_token:
            if result.first_token_s is not None and result.status == 200:
                self._first_token(result.request_id, pick, result.first_token_s, result.prompt_tokens,
                                  result.cached_tokens)
            else:
                del self.no_token[result.request_id]
        self.pick_time.pop(result.request_id, None)
        self.router.release(pick)


def simulate_policy(workload: Workload, policy: str, *, num_servers: int, spec: EngineSpec | None = None,
                    seed: int = 0, sims: list[SimRequest] | None = None, concurrency: int = 16,
                    routing: RoutingSettings | None = None, pool_settings: PoolSettings | None = None,
                    endpoint_ids: Sequence[str] | None = None,
                    predictions: list[tuple[str, float, float]] | None = None, index_source: str = "",
                    flow: FlowSettings | None = None, shed: bool = True, flow_counts: dict | None = None,
                    ) -> tuple[list[RequestResult], list[str], float]:
    """Route `workload` with one of our policies through `PoolRouter` (or with a ``sim:`` model of another
    router, see `SIM_ROUTERS`) on a fresh virtual fleet of `spec` (default: `engine_spec()`).

    Returns (per-request results in request order, endpoint ids, CPU seconds the simulation took).
    `sims` (from `build_sim_requests` with the same spec) may be passed to reuse them. `concurrency` is the
    number of clients of a closed-loop workload (no arrival times). `routing` defaults to `policy` with `seed`
    (and the environment); `pool_settings` to the defaults (and the environment), as the gateway reads them.
    `endpoint_ids` names the servers (default ``sim-I:8000``): a real run's ids give the same rendezvous
    placement, so endpoint shares compare too. `predictions`, when given, receives (primary endpoint,
    predicted TTFT s, actual TTFT s) for each first token, in first-token order, of a policy that predicts TTFT
    (a lifecycle listener, `_TtftPredictions`); it stays empty for the other policies and the ``sim:`` models.
    `index_source` (a router name's ``@SOURCE``) sets the default routing's prefix-index source; "" = its
    default. `flow`: flow control in front of the router (the live gateway's queue, bench/flow_virtual.py: our
    policies judge saturation with the router's own view, the oracle with its true one); None: off
    (``sim:oracle+flow`` turns it on with the defaults). ``shed=False``: the flow queue never sheds for a
    deadline (`FleetFlow`), the counterfactual `false_sheds` judges a run's sheds against. `flow_counts`, when
    given and flow control ran, receives its counters (`extproc.flow.metrics.flow_counts`: held, released, shed
    by reason, predicted-late arrivals shed or held), as a live run's /metrics gives them.
    """
    spec = spec or engine_spec()
    fleet = VirtualFleet(spec, num_servers, endpoint_ids=endpoint_ids)
    if sims is None:
        sims = build_sim_requests(workload, spec)
    pool = SimulatedPool(fleet, pool_settings or settings_mod.from_namespace(PoolSettings), seed=seed)
    tier_pred: dict[str, tuple[int, int]] = {}  # request id -> the router's (GPU, CPU) blocks at its pick
    if policy in FLOW_SIM_ROUTERS and flow is None:
        flow = FlowSettings()
    flow_view: Callable[[Route], FleetFlow] | None = None
    if policy.startswith("sim:"):
        route, release, flow_view = _sim_routing(policy, fleet, pool, flow, shed)
    else:
        if routing is None:
            routing = _default_routing(policy, spec, seed, index_source)
        driver = _FleetRouting(fleet, pool, routing, predictions)
        route, release = driver.route, driver.release
        tier_pred = driver.tier_pred
        if flow is not None:
            flow_view = _router_flow(driver.router, pool, fleet, flow, driver.parsed,
                                     lambda now_s: driver.deliver_first_tokens(), shed)

    on_step = None
    if flow_view is not None:
        gate = flow_view(route)
        route, on_step = gate.route, gate.on_step  # type: ignore[assignment]
    arrivals = _Arrivals(workload, sims, concurrency)

    def on_finish(result: SimResult, fl: VirtualFleet) -> list[SimRequest]:
        release(result)  # where the gateway releases its in-flight count: the response ended
        return arrivals.on_finish(result, fl)

    t0 = time.process_time()
    sim_results = fleet.run(arrivals.initial(), route, on_finish=on_finish, on_step=on_step)
    cpu_s = time.process_time() - t0
    if flow_counts is not None and flow_view is not None:
        flow_counts.update(metrics_flow_counts(gate.control.stats))
    by_id = {r.request_id: r for r in sim_results}
    out = [_request_result(req, by_id.get(str(req.index))) for req in workload.requests]
    for r in out if tier_pred else ():
        r.predicted_tier_blocks = tier_pred.get(str(r.index))
    return out, list(fleet.endpoint_ids), cpu_s


def _sim_routing(policy: str, fleet: VirtualFleet, pool: SimulatedPool, flow: FlowSettings | None,
                 shed: bool = True) -> tuple[Route, Callable[[SimResult], None], Callable[[Route], FleetFlow] | None]:
    """The fleet's route and release callbacks for a ``sim:`` model of another router (`SIM_ROUTERS`), and
    the oracle's flow view when `flow` is on (its true queues and prices; None for the other models)."""
    if policy not in SIM_ROUTERS:
        raise ValueError(f"unknown simulated router {policy!r}; choose one of {', '.join(SIM_ROUTERS)}")
    ids = fleet.endpoint_ids
    in_flight = pool.in_flight
    flow_view: Callable[[Route], FleetFlow] | None = None
    if policy in ORACLES:
        oracle = OracleModel(fleet)

        def route(req: SimRequest, fl: VirtualFleet) -> int:
            i = oracle.choose(req)
            pool.acquire(ids[i])
            return i

        if flow is not None:
            view = OracleFlow(fleet, oracle._time_s, oracle._own.get)  # noqa: SLF001 - its own pricing
            oracle_flow = flow

            def flow_view(place: Route) -> FleetFlow:
                return FleetFlow(fleet, place, oracle_flow, loads=view.loads, cost_of=view.cost_of,
                                 group_of=view.group_of, shed=shed)
    else:
        model = SIM_ROUTERS[policy](fleet.endpoint_ids)

        def route(req: SimRequest, fl: VirtualFleet) -> int:
            i = model.choose(model.request_text(req.body), [in_flight[e] for e in ids])
            pool.acquire(ids[i])
            return i

    def release(result: SimResult) -> None:
        if policy in ORACLES:
            oracle.forget(result.request_id, ended=True)
        if result.endpoint is not None:
            pool.release(result.endpoint)

    return route, release, flow_view


def _default_routing(policy: str, spec: EngineSpec, seed: int, index_source: str) -> RoutingSettings:
    """`policy`'s routing settings as the real bench gives the gateway: the servers' own speed as the time
    model's prior (`runner.prior_gateway_args`, unless the environment sets one), `seed` as the routing seed,
    `index_source` ("" = the default), token blocks with the servers' own tokenizer for every source but round
    1's approximate (runner.gateway_event_args)."""
    prior = {} if any(os.environ.get(n) for n in PRIOR_ENV) else dict(zip(
        ("ttft_prior_tokens_per_s", "ttft_prior_base_s"), spec.time_model_prior()))
    source = {"index_source": index_source} if index_source else {}
    tok = {} if index_source == "approximate" else {"tokenizer": "sim"}
    return settings_mod.from_namespace(RoutingSettings, policy=policy, rng_seed=seed, **prior, **source, **tok)


def flow_settings_for(router: RouterSpec) -> FlowSettings | None:
    """Flow control for one of our routers in a virtual run, as the gateway would run it: its settings from the
    ``PREFIXROUTE_*`` environment (on by default), ``+flow`` / ``-flow`` in the name (`RouterSpec.flow`) turning
    it on or off; None when off."""
    if router.kind != "prefixroute":
        return None
    overrides = {} if router.flow is None else {"flow_control": router.flow}
    s = settings_mod.from_namespace(FlowSettings, **overrides)
    return s if s.flow_control else None


def _router_flow(router: PoolRouter, pool: SimulatedPool, fleet: VirtualFleet, flow: FlowSettings,
                 parsed: dict[str, InferenceRequest], deliver_first_tokens: Callable[[float], None],
                 shed: bool = True) -> Callable[[Route], FleetFlow]:
    """Flow control in front of our router on the fleet: saturation and costs from the router's own view
    (`RouterView`: its time model, index and scrapes, first tokens delivered first, as a live router hears them
    as they come), held requests parsed once (`parsed`, which the route function takes them from)."""
    view = RouterView(router, stale_after_s=pool.settings.metrics_stale_after_s, drain=flow.saturation_drain)

    def parse(req: SimRequest) -> InferenceRequest:
        p = parsed.get(req.request_id)
        if p is None:
            p = parsed[req.request_id] = parse_request("POST", req.path, router.tenants.parse_headers(req.headers),
                                                       req.body, router.settings, router.hasher, None,
                                                       router.text_cache)
        return p

    def loads() -> list:
        deliver_first_tokens(fleet.now_s)
        return view.loads()

    def make(place: Route) -> FleetFlow:
        return FleetFlow(fleet, place, flow, loads=loads, cost_of=lambda req: view.cost_of(parse(req)),
                         group_of=lambda req: view.group_of(parse(req)), tenants=router.tenants, shed=shed)
    return make


def _request_result(req: RequestSpec, r: SimResult | None) -> RequestResult:
    """What the live client would have measured (`bench.client.send_one`)."""
    if r is None:
        return RequestResult(index=req.index, group_id=req.group_id, start_s=req.arrival_s or 0.0,
                             error="not finished in simulation")
    base = {"index": req.index, "group_id": req.group_id, "start_s": r.arrival_s, "endpoint": r.endpoint}
    if r.status != 200:
        return RequestResult(**base, status=r.status, error=f"http {r.status}: {(r.error or '')[:200]}")
    if r.first_token_s is None:  # engine quirk (a prefill left at exactly 1 token): no first-token time
        return RequestResult(**base, error="simulation recorded no first-token time")
    n = r.completion_tokens
    mean_gap_ms = (r.finished_s - r.first_token_s) * 1000.0 / (n - 1) if n > 1 else None
    return RequestResult(**base, status=200, ttft_ms=(r.first_token_s - r.arrival_s) * 1000.0,
                         itl_ms=[mean_gap_ms] * (n - 1) if mean_gap_ms else [], e2e_ms=r.e2e_s * 1000.0,
                         prompt_tokens=r.prompt_tokens, completion_tokens=n, cached_tokens=r.cached_tokens,
                         cpu_cached_tokens=r.cpu_cached_tokens)


def unqueued_policy(policy: str) -> str:
    """The policy a run without the gateway queue uses: ``sim:oracle+flow`` -> ``sim:oracle``; others as is."""
    return policy.removesuffix("+flow") if policy in FLOW_SIM_ROUTERS else policy


def judge_sheds(results: Sequence[RequestResult], replay: Callable[[bool], list[RequestResult]]
                ) -> dict[str, dict]:
    """``{"false_sheds": bench_results.false_sheds(...)}`` when `results` shed any request, judged against
    ``replay(True)`` (the same run, its queue holding but never shedding for a deadline) and ``replay(False)``
    (the same requests with no gateway queue), run only then; {} when nothing was shed."""
    if not any(bench_results.is_shed(r) for r in results):
        return {}
    return {"false_sheds": bench_results.false_sheds(results, replay(True), unqueued=replay(False))}


def run_virtual(workload: Workload, upper_bound_hit_ratio: float | None, routers: Sequence[str], *,
                num_servers: int, spec: EngineSpec | None = None, seed: int = 0, concurrency: int = 0,
                server_args: Sequence[str] = (), endpoint_ids: Sequence[str] | None = None,
                log: Callable[[str], None] = print) -> tuple[dict, dict]:
    """Every `prefixroute:*` router (and ``sim:*`` model) of `routers` on a fresh virtual fleet of `spec`
    (default: `engine_spec()`; `server_args` are recorded as the flags it came from); same document as a real
    run. `concurrency` = clients of a closed-loop workload; `endpoint_ids` as in `simulate_policy`."""
    spec = spec or engine_spec()
    sims = build_sim_requests(workload, spec)
    runs, ttfts, skipped = [], {}, {}
    for name in routers:
        if name.startswith("sim:"):
            if name not in SIM_ROUTERS:
                raise ValueError(f"unknown simulated router {name!r}; choose one of {', '.join(SIM_ROUTERS)}")
            router = RouterSpec(name, "sim", name)
        else:
            router = parse_router(name)
        if router.kind not in ("prefixroute", "sim"):
            skipped[router.name] = "an external program: not simulated in --virtual (run without --virtual)"
            log(f"skipping {router.name}: {skipped[router.name]}")
            continue
        t0 = time.perf_counter()
        counts: dict = {}
        res, endpoints, cpu_s = simulate_policy(workload, router.policy, num_servers=num_servers, spec=spec,
                                                seed=seed, sims=sims, concurrency=concurrency or 16,
                                                endpoint_ids=endpoint_ids, index_source=router.index_source,
                                                flow=flow_settings_for(router), flow_counts=counts)
        wall_s = time.perf_counter() - t0
        log(f"{router.name}: simulated {len(res)} requests on {num_servers} servers in {wall_s:.1f}s")
        judged = judge_sheds(res, lambda queued: simulate_policy(
            workload, router.policy if queued else unqueued_policy(router.policy), num_servers=num_servers,
            spec=spec, seed=seed, sims=sims,
            concurrency=concurrency or 16, endpoint_ids=endpoint_ids, index_source=router.index_source,
            flow=flow_settings_for(router) if queued else None, shed=False)[0])
        runs.append(bench_results.summarize_run(router.name, res, endpoints, extra={
            "policy": router.policy, "virtual": True, "sim_cpu_s": round(cpu_s, 3), "wall_s": round(wall_s, 3),
            "itl_definition": "per-request mean inter-token time", **judged, **({"flow": counts} if counts else {})}))
        ttfts[router.name] = [r.ttft_ms for r in res if r.ok and r.ttft_ms is not None]
    doc = bench_results.results_document(workload.describe(), upper_bound_hit_ratio, runs)
    cfg = spec.config
    doc["workload"].update(num_servers=num_servers, virtual=True, fleet={
        "profile": spec.profile.name, "server_args": list(server_args), "num_gpu_blocks": cfg.num_gpu_blocks,
        "block_size": cfg.block_size, "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens, "time_scale": cfg.time_scale,
        "max_model_len": spec.max_model_len})
    if skipped:
        doc["skipped"] = skipped
    return doc, ttfts
