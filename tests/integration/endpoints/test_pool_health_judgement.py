"""EndpointPool's health judgement against real HTTP servers on loopback: a router whose own event loop stalls
never ejects healthy endpoints for it, a fleet that times out all at once is routed to in panic mode, and
real evidence (refused connections, HTTP errors) still takes endpoints out at once.

The servers run in threads of their own (the stdlib's threading HTTP server), so stalling the test's event loop
(where the pool runs) starves the router only, as a busy or CPU-starved router process is: they answer /health
in about a millisecond throughout. A stall is a callback that blocks the loop (``time.sleep``: no CPU taken
from the other tests of a shared machine), then yields, so every loop iteration lasts the stall; a probe takes
a few iterations (the servers close each connection after answering, so every probe connects anew), and its
timeout fires before its answer is read: every endpoint marked down in the same iteration, as the starved
router in front of real vLLM did.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.server
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from prometheus_client import CollectorRegistry, generate_latest

from prefixroute.extproc.endpoints.metrics import PoolHealthCollector
from prefixroute.extproc.endpoints.pool import EndpointPool
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.routing.request import parse_request
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.types import EndpointState
from helpers.threaded_endpoint import METRICS, ThreadedEndpoint, stall_loop
from helpers.waiting import until_async

pytestmark = pytest.mark.integration

FAST = PoolSettings(probe_interval_s=0.05, probe_timeout_s=0.3, unhealthy_after_failures=2, scrape_interval_s=0.02,
                    scrape_timeout_s=0.3, metrics_stale_after_s=0.3, models_interval_s=0.5,
                    failure_probe_delay_s=0.3)


@pytest.fixture
def endpoints() -> Iterator[list[ThreadedEndpoint]]:
    made = [ThreadedEndpoint() for _ in range(3)]
    yield made
    for e in made:
        e.stop()


@contextlib.asynccontextmanager
async def watched_pool(eps: list[ThreadedEndpoint], settings: PoolSettings = FAST
                       ) -> AsyncIterator[tuple[EndpointPool, list[tuple[EndpointState, ...]]]]:
    """A started, ready pool over `eps`, and every snapshot its listeners were given from then on."""
    pool = EndpointPool(settings, [e.endpoint for e in eps])
    await pool.start()
    try:
        assert await pool.wait_ready(10)
        seen: list[tuple[EndpointState, ...]] = []
        pool.add_listener(seen.append)
        yield pool, seen
    finally:
        await pool.close()




def marked_down(seen: list[tuple[EndpointState, ...]]) -> set[str]:
    return {s.endpoint for snap in seen for s in snap if not s.healthy}


async def test_a_stalled_router_loop_ejects_no_healthy_endpoint(endpoints):
    async with watched_pool(endpoints) as (pool, seen):
        # Every loop iteration lasts 0.2 s, a probe takes about four (0.3 s timeout). Before probes were judged
        # against the loop's lag, all three were marked down within 2 s, in the same iteration.
        await stall_loop(4.0, 0.2)
        assert not marked_down(seen), [[(s.endpoint, s.healthy) for s in snap] for snap in seen]
        assert all(s.healthy and not s.panic for s in pool.snapshot())
        figures = pool.health_figures()
        discounted = sum(n for (_, outcome), n in figures["probes"].items() if outcome == "discounted_for_lag")
        assert discounted >= 3 and not figures["ejections"], figures
        assert figures["loop_stall_s"] >= 2.0 and figures["loop_lag_s"] >= 0.4, figures
        # Each discounted probe is judged by the endpoint's next counted one: they answered, the discount was right.
        await until_async(lambda: pool.health_figures()["discounted_judged"]["ok"] >= 3, 10)
        assert pool.health_figures()["discounted_judged"]["failed"] == 0
        # The loop runs on time again: a server that now hangs is taken out by its timeouts as before.
        endpoints[0].health_delay_s = 1.0
        await until_async(lambda: not next(s for s in pool.snapshot() if s.endpoint == endpoints[0].endpoint).healthy,
                          10)
        assert pool.health_figures()["ejections"] == {(endpoints[0].endpoint, "timeout"): 1}
        endpoints[0].health_delay_s = 0.0


async def test_scraped_figures_outlive_the_loops_stall_not_the_servers_silence(endpoints):
    async with watched_pool(endpoints[:1]) as (pool, _):
        await until_async(lambda: pool.snapshot()[0].num_requests_running == 4, 5)
        for _ in range(6):  # 0.6 s stalls, twice the 0.3 s staleness limit: each judged right after it
            time.sleep(0.6)  # blocks the loop on purpose: the router's own stall
            assert pool.snapshot()[0].num_requests_running == 4  # the router could not scrape: not stale
            await asyncio.sleep(0)
        assert pool.health_figures()["metrics_kept_for_lag"] >= 1


async def test_all_endpoints_timing_out_at_once_are_routed_in_panic_mode(endpoints):
    async with watched_pool(endpoints) as (pool, seen):
        for e in endpoints:
            e.health_delay_s = 1.0  # every probe times out (0.3 s) while the loop runs on time
        await until_async(lambda: pool.in_panic and all(s.panic for s in pool.snapshot()), 10)
        # Never a snapshot with nothing to route to: the second endpoint down tipped it into panic mode
        # (1 of 3 pass, under 50%), and from then on the timed-out ones are routed as if healthy.
        assert all(any(s.healthy for s in snap) for snap in seen)
        assert all(s.healthy and s.address for s in pool.snapshot())
        # The router routes on (a pick, not 503 "no healthy endpoint").
        core = RouterCore(RoutingSettings(rng_seed=0))
        req = parse_request("POST", "/v1/chat/completions", {},
                            b'{"model":"m","messages":[{"role":"user","content":"hello"}]}', core.settings)
        picked = core.route(req, pool.snapshot(), pool.in_flight).endpoints[0]
        pool.acquire(picked)
        figures = pool.health_figures()
        assert figures["panic_picks"] == 1
        assert sum(n for (_, cause), n in figures["ejections"].items() if cause == "timeout") == 3
        assert figures["num_panics"] == 1 and figures["panic"] == 1.0
        # One of them now refuses connections (it died): out of the panic set at once, the others stay routed.
        dead = endpoints[2]
        dead.stop()
        await until_async(lambda: not next(s for s in pool.snapshot() if s.endpoint == dead.endpoint).healthy, 5)
        assert [s.healthy for s in pool.snapshot()] == [True, True, False]
        # They answer again: out of panic mode, its time counted.
        for e in endpoints[:2]:
            e.health_delay_s = 0.0
        await until_async(lambda: not pool.in_panic, 10)
        assert [(s.healthy, s.panic) for s in pool.snapshot()] == [(True, False), (True, False), (False, False)]
        assert pool.health_figures()["panic_seconds"] > 0
        # What /metrics shows of it (the router registers this collector).
        registry = CollectorRegistry()
        registry.register(PoolHealthCollector(pool))
        text = generate_latest(registry).decode()
        assert "prefixroute_pool_panic 0.0" in text and "prefixroute_pool_panics_total 1.0" in text
        assert "prefixroute_pool_panic_picks_total 1.0" in text
        assert f'prefixroute_endpoint_ejections_total{{cause="timeout",endpoint="{dead.endpoint}"}} 1.0' in text
        assert f'prefixroute_endpoint_ejections_total{{cause="connection",endpoint="{dead.endpoint}"}}' not in text


@pytest.mark.parametrize("how", ["refused", "http_503"])
async def test_real_failures_still_eject_every_endpoint(endpoints, how):
    async with watched_pool(endpoints) as (pool, _):
        t0 = time.monotonic()
        for e in endpoints:
            if how == "refused":
                e.stop()
            else:
                e.health_status = 503
        await until_async(lambda: not any(s.healthy for s in pool.snapshot()), 5)
        took = time.monotonic() - t0
        assert not pool.in_panic  # a dead process or an HTTP error is the server's own word: no panic routing
        cause = "connection" if how == "refused" else "status"
        assert {c for (_, c) in pool.health_figures()["ejections"]} == {cause}
        print(f"all three down {took:.2f} s after they {how}")


async def test_panic_mode_off_lets_timeouts_eject_every_endpoint(endpoints):
    async with watched_pool(endpoints, dataclasses.replace(FAST, healthy_panic_threshold_ratio=0.0)) as (pool, _):
        for e in endpoints:
            e.health_delay_s = 1.0
        await until_async(lambda: not any(s.healthy for s in pool.snapshot()), 10)
        assert not pool.in_panic
        for e in endpoints:
            e.health_delay_s = 0.0
