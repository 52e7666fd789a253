"""The pool's scrapes take a bounded share of an endpoint's time: an endpoint whose /metrics is slow to build
(real vLLM's ~50 KB page costs its API server's event loop 4-6 ms on a CPU host) is scraped less often, one that
answers at once keeps the configured interval, and a router whose own loop stalls does not mistake its stall
for the endpoint's cost. Real HTTP servers on loopback, on threads of their own (as the health judgement's
tests use)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from prefixroute.extproc.endpoints.pool import EndpointPool
from prefixroute.extproc.endpoints.settings import PoolSettings

from helpers.threaded_endpoint import ThreadedEndpoint, stall_loop

pytestmark = pytest.mark.integration

SETTINGS = PoolSettings(probe_interval_s=0.2, models_interval_s=5.0)  # the scrape settings' defaults
assert (SETTINGS.scrape_interval_s, SETTINGS.max_scrape_time_ratio, SETTINGS.metrics_stale_after_s) == (0.1, 0.02, 1.0)


class SlowMetricsEndpoint(ThreadedEndpoint):
    """A stand-in whose /metrics takes `metrics_delay_s` to answer (the page being built), counting scrapes."""

    def __init__(self, metrics_delay_s: float) -> None:
        super().__init__()
        self.metrics_delay_s = metrics_delay_s
        self.num_scrapes = 0
        handler = self._handler
        outer = self
        do_get = handler.do_GET

        def do_GET(h) -> None:  # noqa: N802, ANN001 - the stdlib's name
            if h.path == "/metrics":
                outer.num_scrapes += 1
                time.sleep(outer.metrics_delay_s)
            do_get(h)

        handler.do_GET = do_GET


async def _scrapes_in(settings: PoolSettings, delays_s: list[float], seconds: float) -> tuple[list[int], EndpointPool]:
    eps = [SlowMetricsEndpoint(d) for d in delays_s]
    pool = EndpointPool(settings, [e.endpoint for e in eps])
    await pool.start()
    try:
        assert await pool.wait_ready(10)
        await asyncio.sleep(0.5)  # a few scrapes to learn each endpoint's cost
        before = [e.num_scrapes for e in eps]
        await asyncio.sleep(seconds)
        return [e.num_scrapes - b for e, b in zip(eps, before)], pool
    finally:
        await pool.close()
        for e in eps:
            e.stop()


async def test_a_slow_metrics_page_is_scraped_less_often_and_a_fast_one_keeps_the_interval() -> None:
    (fast, slow), pool = await _scrapes_in(SETTINGS, [0.0, 0.03], 3.0)
    print(f"scrapes in 3 s at the 100 ms interval: fast endpoint {fast}, 30 ms endpoint {slow}")
    # 30 ms a scrape at 2% -> every 1.5 s, capped at half the 1 s staleness limit: ~6 in 3 s; the fast one ~30
    # (a loopback round trip of this test's stand-in takes 1-3 ms on a loaded host, at most 150 ms between).
    assert fast >= 18, fast
    assert 3 <= slow <= 9, slow
    # Without the bound the slow endpoint is scraped every 130 ms, as the fast one.
    (fast_off, slow_off), _ = await _scrapes_in(dataclasses.replace(SETTINGS, max_scrape_time_ratio=0.0),
                                                [0.0, 0.03], 3.0)
    print(f"bound off: fast endpoint {fast_off}, 30 ms endpoint {slow_off}")
    assert slow_off >= 16, slow_off


async def test_an_occasional_stall_of_the_router_is_not_counted_as_the_endpoints_cost() -> None:
    """The router's loop stalls 300 ms every 700 ms: every few scrapes' round trips span a stall (which the
    loop-lag sampler counts to within 50 ms, and the median of five leaves out); the endpoint answers at once,
    so its interval stays the configured one."""
    async def stalls(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await stall_loop(0.3, 0.3)
            await asyncio.sleep(0.4)

    eps = [SlowMetricsEndpoint(0.0)]
    pool = EndpointPool(SETTINGS, [e.endpoint for e in eps])
    await pool.start()
    try:
        assert await pool.wait_ready(10)
        await asyncio.sleep(0.5)
        before = eps[0].num_scrapes
        await stalls(3.5)
        fast = eps[0].num_scrapes - before
    finally:
        await pool.close()
        eps[0].stop()
    print(f"scrapes in 3.5 s, the router stalling 300 ms of every 700: {fast}")
    assert fast >= 12, fast  # ~20 (the stalls take 43% of the time); the bound would allow ~7
