"""SimulatedPool: the live pool's contract over a virtual-time fleet (scrape cadence, staleness, listeners,
in-flight), and PoolRouter running on it."""

from __future__ import annotations

import orjson
import pytest

from prefixroute.bench.sim_pool import SimulatedPool
from prefixroute.extproc.endpoints import Pool
from prefixroute.extproc.endpoints.pool import EndpointPool
from prefixroute.extproc.endpoints.scrape import parse_metrics
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.service import PoolRouter
from prefixroute.model_servers import metrics
from prefixroute.model_servers.profiles import EngineSpec
from prefixroute.model_servers.server import ServerSettings
from prefixroute.model_servers.virtual_fleet import SimRequest, VirtualFleet

SPEC = EngineSpec.from_settings(ServerSettings(lora_modules=("sql",)))


def request(rid: str, t: float, tokens: int = 2000, max_tokens: int = 200) -> SimRequest:
    body = orjson.dumps({"prompt": f"request {rid} " + "word " * (tokens // 2), "max_tokens": max_tokens})
    return SimRequest.from_body(rid, t, "/v1/completions", body, SPEC)


def test_both_pools_implement_the_protocol_members():
    members = {m for m in dir(Pool) if not m.startswith("_")}
    assert members == {"snapshot", "in_flight", "endpoints", "add_listener", "acquire", "release", "report_failure"}
    for cls in (EndpointPool, SimulatedPool):
        assert members <= set(dir(cls)), cls


def test_a_scrape_shows_what_the_servers_metrics_page_shows():
    fleet = VirtualFleet(SPEC, num_servers=2)
    seen = []

    def route(req, f):
        if req.request_id == "3":  # both servers busy by now: a fresh pool scrapes every server at once
            for state, core in zip(SimulatedPool(f).snapshot(), f.engines):
                page = parse_metrics(metrics.render(core, model_name=f.served).encode())
                seen.append(((state.num_requests_running, state.num_requests_waiting, state.kv_cache_usage_ratio,
                              state.num_gpu_blocks, state.block_size, state.num_cpu_blocks,
                              state.prefix_cache_tokens),
                             (page.num_requests_running, page.num_requests_waiting, page.kv_cache_usage_ratio,
                              page.num_gpu_blocks, page.block_size, page.num_cpu_blocks, page.prefix_cache_tokens)))
                assert (state.healthy, state.address, state.models) == (True, state.endpoint, {SPEC.served_model_name,
                                                                                                 "sql"})
        return int(req.request_id) % 2

    fleet.run([request(str(i), i * 0.001) for i in range(4)], route)
    assert len(seen) == 2 and all(mine == page for mine, page in seen)
    assert sum(mine[0] for mine, _ in seen) >= 2  # the page had something to show


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_router_sees_load_up_to_one_scrape_interval_old(seed):
    interval = 0.1
    fleet = VirtualFleet(SPEC, num_servers=1)
    pool = SimulatedPool(fleet, PoolSettings(scrape_interval_s=interval), seed=seed)
    observed = []  # (time, running as published, running in the engine, snapshot object)

    def observe():
        observed.append((fleet.now_s, pool.snapshot()[0].num_requests_running, fleet.engines[0].num_running,
                         pool.snapshot()))
        fleet.call_at(fleet.now_s + 0.002, observe)

    fleet.call_at(0.0, observe)
    fleet.run([request("late", 1.0)], lambda r, f: 0)
    published_at = next(t for t, shown, _, _ in observed if t >= 1.0 and shown == 1)
    assert 1.0 < published_at <= 1.0 + interval + 0.002  # stale for part of an interval, never longer
    assert any(t >= 1.0 and shown == 0 and true == 1 for t, shown, true, _ in observed)
    # Idle before the arrival: ten scrapes found nothing new, so the snapshot object never changed.
    assert len({id(snap) for t, _, _, snap in observed if t < 1.0}) == 1


def test_scrapes_spread_over_the_interval_and_stretch_with_the_pool_size():
    fleet = VirtualFleet(SPEC, num_servers=40)
    pool = SimulatedPool(fleet, PoolSettings(scrape_interval_s=0.1, max_scrapes_per_s=200.0), seed=0)
    assert pool.scrape_interval_s == pytest.approx(0.2)  # 40 endpoints / 200 scrapes/s, as the live pool
    seen_busy: dict[str, float] = {}

    def observe():
        for s in pool.snapshot():
            if s.num_requests_running and s.endpoint not in seen_busy:
                seen_busy[s.endpoint] = fleet.now_s
        fleet.call_at(fleet.now_s + 0.001, observe)

    fleet.call_at(0.0, observe)
    # every server busy from t=0 for longer than an interval; each one's scrape shows it at its own phase
    fleet.run([request(str(i), 0.0, max_tokens=100) for i in range(40)], lambda r, f: int(r.request_id))
    times = sorted(seen_busy.values())
    assert len(times) == 40 and 0 < times[0] and times[-1] <= 0.2 + 0.001 and times[-1] - times[0] > 0.1


def test_listeners_in_flight_and_passive_failure():
    fleet = VirtualFleet(SPEC, num_servers=2)
    pool = SimulatedPool(fleet, PoolSettings(failure_probe_delay_s=0.5))
    heard = []
    pool.add_listener(lambda snap: heard.append(tuple(s.healthy for s in snap)))
    assert heard == [(True, True)]  # called at once
    ep = pool.endpoints[0]
    pool.acquire(ep)
    pool.acquire(ep)
    pool.release(ep)
    pool.release(ep)
    pool.release(ep)  # never below zero
    assert dict(pool.in_flight) == {ep: 0, pool.endpoints[1]: 0}

    def route(req, f):
        if req.request_id == "a":
            pool.report_failure(ep)
        return 1

    fleet.run([request("a", 0.0, max_tokens=400), request("b", 0.2), request("c", 2.0)], route)
    assert heard[1:] == [(False, True), (True, True)]  # down at once, back after the re-probe delay


def test_pool_router_routes_a_simulation_and_sizes_the_index_from_the_scraped_capacity():
    fleet = VirtualFleet(SPEC, num_servers=3)
    pool = SimulatedPool(fleet)
    router = PoolRouter(RouterCore(RoutingSettings(rng_seed=0), track_prefill=True), pool)
    cfg = SPEC.config
    capacity = cfg.num_gpu_blocks * cfg.block_size // router.settings.tokens_per_block
    assert all(router.core.index.capacity(ep) == capacity for ep in pool.endpoints)
    picks = {}

    def route(req, f):
        pick = picks[req.request_id] = router.route("POST", req.path, req.headers, req.body)
        assert pick.endpoints == pick.endpoint_ids  # the simulated pool publishes ids as addresses
        return pick.endpoint_ids[0]

    res = fleet.run([request(str(i), i * 0.01) for i in range(12)], route,
                    on_finish=lambda r, f: router.release(picks[r.request_id]))
    assert len(res) == 12 and all(r.status == 200 for r in res)
    assert sum(pool.in_flight.values()) == 0
    assert router.endpoint_of("sim-2:8000") == "sim-2:8000"
