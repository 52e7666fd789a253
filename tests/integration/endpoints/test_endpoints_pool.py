"""EndpointPool against real HTTP servers on loopback (aiohttp apps serving /health, /v1/models, /metrics)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from prefixroute.extproc.endpoints.pool import EndpointPool
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.types import EndpointId, EndpointState
from helpers.waiting import until_async

pytestmark = pytest.mark.integration

FAST = PoolSettings(resolve_interval_s=0.05, probe_interval_s=0.05, probe_timeout_s=0.3, unhealthy_after_failures=2,
                    scrape_interval_s=0.02, scrape_timeout_s=0.3, metrics_stale_after_s=0.3, models_interval_s=0.1,
                    failure_probe_delay_s=0.3)
VLLM_METRICS = (b"# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
                b'vllm:num_requests_running{model_name="m"} 4.0\nvllm:num_requests_waiting{model_name="m"} 1.0\n'
                b'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
                b'vllm:cache_config_info{block_size="16",num_gpu_blocks="2000"} 1.0\n')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeEndpoint:
    """A real HTTP server whose answers the test changes while the pool watches it."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or free_port()
        self.health_status = 200
        self.models = ["m"]
        self.metrics = VLLM_METRICS
        self.metrics_delay_s = 0.0
        self.metrics_status = 200
        self.num_scrapes = 0
        self.num_probes = 0
        self._runner: web.AppRunner | None = None

    @property
    def endpoint(self) -> EndpointId:
        return EndpointId(f"{self.host}:{self.port}")

    async def _health(self, _: web.Request) -> web.Response:
        self.num_probes += 1
        return web.Response(status=self.health_status, text="")

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def _metrics(self, _: web.Request) -> web.Response:
        self.num_scrapes += 1
        if self.metrics_delay_s:
            await asyncio.sleep(self.metrics_delay_s)
        return web.Response(status=self.metrics_status, body=self.metrics, content_type="text/plain")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@pytest.fixture
async def servers() -> AsyncIterator[Callable[[int], Awaitable[list[FakeEndpoint]]]]:
    started: list[FakeEndpoint] = []

    async def make(n: int) -> list[FakeEndpoint]:
        out = [FakeEndpoint() for _ in range(n)]
        for s in out:
            await s.start()
        started.extend(out)
        return out

    yield make
    for s in started:
        await s.stop()


@pytest.fixture
async def pools() -> AsyncIterator[Callable[..., Awaitable[EndpointPool]]]:
    made: list[EndpointPool] = []

    async def make(endpoints: list[str], settings: PoolSettings = FAST, **kw: object) -> EndpointPool:
        pool = EndpointPool(settings, endpoints, **kw)
        made.append(pool)
        await pool.start()
        return pool

    yield make
    for p in made:
        await p.close()


def state(pool: EndpointPool, ep: str) -> EndpointState:
    return next(s for s in pool.snapshot() if s.endpoint == ep)


async def test_ready_with_models_and_vllm_metrics(servers, pools):
    a, b = await servers(2)
    b.models = ["m", "lora-sql"]
    pool = await pools([a.endpoint, b.endpoint])
    assert not any(s.healthy for s in pool.snapshot())  # nothing is up before its first probe
    assert await pool.wait_ready(5)
    await until_async(lambda: all(s.scraped_at_s is not None for s in pool.snapshot()), 5)
    sa, sb = state(pool, a.endpoint), state(pool, b.endpoint)
    assert sb.models == frozenset({"m", "lora-sql"}) and sa.models == frozenset({"m"})
    assert (sa.num_requests_running, sa.num_requests_waiting, sa.kv_cache_usage_ratio) == (4, 1, 0.5)
    assert (sa.num_gpu_blocks, sa.block_size) == (2000, 16)
    assert [s.endpoint for s in pool.snapshot()] == [a.endpoint, b.endpoint]  # configured order


async def test_sglang_metric_names(servers, pools):
    (a,) = await servers(1)
    a.metrics = b"sglang:num_running_reqs 2\nsglang:num_queue_reqs 9\nsglang:token_usage 0.8\n"
    pool = await pools([a.endpoint])
    await until_async(lambda: state(pool, a.endpoint).num_requests_waiting == 9, 5)
    s = state(pool, a.endpoint)
    assert (s.num_requests_running, s.kv_cache_usage_ratio) == (2, 0.8)


async def test_health_down_after_consecutive_failures_and_up_after_one_success(servers, pools):
    a, b = await servers(2)
    pool = await pools([a.endpoint, b.endpoint])
    assert await pool.wait_ready(5)
    a.health_status = 503
    await until_async(lambda: not state(pool, a.endpoint).healthy, 5)
    assert a.num_probes >= 2 and state(pool, b.endpoint).healthy
    a.health_status = 200
    await until_async(lambda: state(pool, a.endpoint).healthy, 5)


async def test_one_failed_probe_does_not_mark_down(servers, pools):
    (a,) = await servers(1)
    pool = await pools([a.endpoint], dataclasses.replace(FAST, probe_interval_s=0.2, unhealthy_after_failures=3))
    assert await pool.wait_ready(5)
    probes = a.num_probes
    a.health_status = 500
    await until_async(lambda: a.num_probes >= probes + 1, 5)
    a.health_status = 200
    await until_async(lambda: a.num_probes >= probes + 3, 5)  # two good probes after the failed one
    assert state(pool, a.endpoint).healthy


async def test_killed_server_goes_down_and_comes_back(servers, pools):
    (a,) = await servers(1)
    pool = await pools([a.endpoint])
    assert await pool.wait_ready(5)
    await a.stop()  # connections refused from now on
    await until_async(lambda: not state(pool, a.endpoint).healthy, 5)
    await a.start()
    await until_async(lambda: state(pool, a.endpoint).healthy, 5)


async def test_metrics_become_stale_when_scrapes_stop_landing(servers, pools):
    (a,) = await servers(1)
    pool = await pools([a.endpoint])
    await until_async(lambda: state(pool, a.endpoint).num_requests_running == 4, 5)
    a.metrics_status = 500  # /metrics broken, /health fine
    t0 = time.monotonic()
    await until_async(lambda: state(pool, a.endpoint).num_requests_running is None, 5)
    waited = time.monotonic() - t0
    s = state(pool, a.endpoint)
    assert s.healthy and s.kv_cache_usage_ratio is None and s.num_requests_waiting is None
    assert s.num_gpu_blocks == 2000  # capacity is configuration, not load: kept
    assert waited >= FAST.metrics_stale_after_s * 0.5
    a.metrics_status = 200
    await until_async(lambda: state(pool, a.endpoint).num_requests_running == 4, 5)


async def test_a_hung_endpoint_does_not_stall_the_others(servers, pools):
    slow, fast = await servers(2)
    pool = await pools([slow.endpoint, fast.endpoint])
    assert await pool.wait_ready(5)
    slow.metrics_delay_s = 10.0  # every scrape of `slow` hangs until its timeout
    scrapes = slow.num_scrapes
    await until_async(lambda: slow.num_scrapes > scrapes, 5)  # a scrape of `slow` is hanging now
    before = fast.num_scrapes
    await asyncio.sleep(0.6)  # a fixed window on purpose: the figure is the scrape rate of `fast` meanwhile
    # 0.6 s at one scrape per 20 ms: expect ~30; demand a third of that on a loaded machine
    assert fast.num_scrapes - before >= 10
    assert state(pool, fast.endpoint).scraped_at_s is not None
    await until_async(lambda: state(pool, slow.endpoint).num_requests_running is None, 5)  # slow's figures expire


async def test_model_list_refresh_picks_up_new_adapters(servers, pools):
    (a,) = await servers(1)
    pool = await pools([a.endpoint])
    assert await pool.wait_ready(5)
    a.models = ["m", "lora-new"]
    await until_async(lambda: "lora-new" in state(pool, a.endpoint).models, 5)


async def test_endpoint_without_model_list_serves_any_model(pools):
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        pool = await pools([f"127.0.0.1:{port}"])
        assert await pool.wait_ready(5)
        s = pool.snapshot()[0]
        assert s.healthy and s.models == frozenset() and s.num_requests_running is None
    finally:
        await runner.cleanup()


async def test_passive_failure_is_confirmed_by_a_probe_then_marks_down_at_once_and_a_probe_restores(servers,
                                                                                                    pools):
    (a,) = await servers(1)
    pool = await pools([a.endpoint], dataclasses.replace(FAST, probe_interval_s=30.0))
    assert await pool.wait_ready(5)
    changes: list[bool] = []
    pool.add_listener(lambda snap: changes.append(snap[0].healthy))
    a.health_status = 503  # the gateway's failure was real: the confirming probe fails too
    t0 = time.monotonic()
    pool.report_failure(a.endpoint)
    # the regular probe is 30 s away: only the report's own probe can take it down this fast
    await until_async(lambda: not state(pool, a.endpoint).healthy, 2)
    assert time.monotonic() - t0 < 1.0
    a.health_status = 200
    t1 = time.monotonic()
    await until_async(lambda: state(pool, a.endpoint).healthy, 5)
    took = time.monotonic() - t1
    assert took >= FAST.failure_probe_delay_s * 0.5  # re-probed after failure_probe_delay_s, not 30 s
    # Other structural updates (a models refresh) may notify while it is down: compare health transitions.
    transitions = [healthy for healthy, _ in itertools.groupby(changes)]
    assert transitions[:3] == [True, False, True]
    assert pool.num_unconfirmed_failures == 0


async def test_a_passive_failure_the_probe_does_not_confirm_leaves_the_endpoint_up(servers, pools):
    """Forged reports (issue 11, finding 2): the endpoint answers its probe, so no report takes it down."""
    (a,) = await servers(1)
    pool = await pools([a.endpoint], dataclasses.replace(FAST, probe_interval_s=30.0))
    assert await pool.wait_ready(5)
    changes: list[bool] = []
    pool.add_listener(lambda snap: changes.append(snap[0].healthy))
    probes = a.num_probes
    for _ in range(200):  # a flood of reports
        pool.report_failure(a.endpoint)
        await asyncio.sleep(0.005)  # paces the flood over ~1 s (a rate, not a wait)
    assert state(pool, a.endpoint).healthy and all(changes)
    assert pool.num_unconfirmed_failures >= 1
    # about one probe per failure_probe_delay_s (0.3 s) over ~1 s of flood, not one per report
    assert a.num_probes - probes <= 1 + 1.5 / FAST.failure_probe_delay_s, a.num_probes - probes
    assert pool.num_ignored_failure_reports >= 190


async def test_wait_ready_times_out_when_an_endpoint_is_dead(servers, pools):
    (a,) = await servers(1)
    pool = await pools([a.endpoint, f"127.0.0.1:{free_port()}"])
    assert not await pool.wait_ready(0.5)
    assert await pool.wait_ready(2, num_healthy=1)


async def test_in_flight_counts(servers, pools):
    a, b = await servers(2)
    pool = await pools([a.endpoint, b.endpoint])
    pool.acquire(a.endpoint)
    pool.acquire(a.endpoint)
    pool.acquire(b.endpoint)
    assert dict(pool.in_flight) == {a.endpoint: 2, b.endpoint: 1}
    pool.release(a.endpoint)
    pool.release(b.endpoint)
    pool.release(b.endpoint)  # an extra release (e.g. a duplicate end-of-stream) never goes negative
    assert dict(pool.in_flight) == {a.endpoint: 1, b.endpoint: 0}


async def test_removed_endpoint_leaves_the_snapshot_and_listeners_hear_of_it(servers, pools):
    a, b = await servers(2)
    pool = await pools([a.endpoint, b.endpoint])
    assert await pool.wait_ready(5)
    seen: list[tuple[str, ...]] = []
    pool.add_listener(lambda snap: seen.append(tuple(s.endpoint for s in snap)))
    pool.acquire(b.endpoint)
    pool.set_endpoints([a.endpoint])
    assert seen[-1] == (a.endpoint,) and [s.endpoint for s in pool.snapshot()] == [a.endpoint]
    assert pool.in_flight[b.endpoint] == 1  # its request still runs; the count falls when it ends
    pool.release(b.endpoint)
    assert b.endpoint not in pool.in_flight
    probes = b.num_probes
    await asyncio.sleep(0.3)  # lets time pass on purpose: several probe intervals, and none may reach `b`
    assert b.num_probes == probes  # no longer watched
    c = (await servers(1))[0]
    pool.set_endpoints([a.endpoint, c.endpoint])
    await until_async(lambda: state(pool, c.endpoint).healthy, 5)


async def test_router_core_follows_the_pool(servers, pools):
    """The pool's listener hook sizes the prefix index from scraped KV capacity and drops removed endpoints."""
    from prefixroute.extproc.routing.request import parse_request
    from prefixroute.extproc.routing.router import RouterCore
    from prefixroute.extproc.routing.settings import RoutingSettings

    a, b = await servers(2)
    b.metrics = b""
    pool = await pools([a.endpoint, b.endpoint])
    core = RouterCore(RoutingSettings(rng_seed=0))
    pool.add_listener(core.sync_endpoints)
    assert await pool.wait_ready(5)
    await until_async(lambda: core.index.capacity(a.endpoint) == 2000, 5)  # 2000 x 16 tokens / 16 tokens per block
    assert core.index.capacity(b.endpoint) == core.settings.default_index_capacity_blocks
    body = b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 640 + b'"}]}'
    req = parse_request("POST", "/v1/chat/completions", {}, body, core.settings)
    primary = core.route(req, pool.snapshot(), pool.in_flight).endpoints[0]
    assert core.index.num_entries(primary) == 10
    pool.set_endpoints([ep for ep in (a.endpoint, b.endpoint) if ep != primary])
    assert core.index.num_entries() == 0


# --- name resolution --------------------------------------------------------------------------------------------
class Resolver:
    """An injected resolver: answers from `table` (host -> IPs), a missing host does not resolve."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.lookups: list[float] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.lookups.append(time.monotonic())
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(self.table[host])


async def test_ip_literals_are_their_own_address_and_never_looked_up(servers, pools):
    (a,) = await servers(1)
    resolver = Resolver({})
    pool = await pools([a.endpoint, "[::1]:9", "[0:0::1]:10"], resolver=resolver)
    assert [s.address for s in pool.snapshot()] == [a.endpoint, "[::1]:9", "[::1]:10"]  # canonical form
    assert await pool.wait_ready(5, num_healthy=1)
    assert resolver.lookups == []


async def test_a_name_resolves_with_the_system_resolver_off_the_loop(pools):
    info = await asyncio.get_running_loop().getaddrinfo("localhost", None, type=socket.SOCK_STREAM)
    ip = info[0][4][0]  # the address the pool takes: getaddrinfo's first
    server = FakeEndpoint(host=ip)
    await server.start()
    try:
        pool = await pools([f"localhost:{server.port}"])
        assert await pool.wait_ready(5)
        s = pool.snapshot()[0]
        assert s.endpoint == f"localhost:{server.port}" and s.healthy
        assert s.address == (f"[{ip}]:{server.port}" if ":" in ip else f"{ip}:{server.port}")
        assert server.num_probes >= 1
    finally:
        await server.stop()


async def test_a_name_that_does_not_resolve_is_down_until_it_does(servers, pools):
    (a,) = await servers(1)
    resolver = Resolver({})
    # Lookups of a never-resolved name are retried at the probe interval, not the (long) resolve interval.
    pool = await pools([f"model-a:{a.port}"], dataclasses.replace(FAST, resolve_interval_s=30.0), resolver=resolver)
    assert not await pool.wait_ready(0.4)
    s = pool.snapshot()[0]
    assert (s.healthy, s.address) == (False, None) and a.num_probes == 0
    assert len(resolver.lookups) >= 3
    resolver.table["model-a"] = ["127.0.0.1"]
    assert await pool.wait_ready(5)
    assert pool.snapshot()[0].address == a.endpoint and pool.snapshot()[0].healthy


async def test_a_moved_endpoint_is_down_until_its_new_address_answers(servers, pools):
    (old,) = await servers(1)
    new = FakeEndpoint(port=old.port, host="127.0.0.2")  # the restarted container: new address, not up yet
    resolver = Resolver({"model-a": ["127.0.0.1"]})
    pool = await pools([f"model-a:{old.port}"], resolver=resolver)
    assert await pool.wait_ready(5)
    seen: list[tuple[str | None, bool]] = []
    pool.add_listener(lambda snap: seen.append((snap[0].address, snap[0].healthy)))
    resolver.table["model-a"] = ["127.0.0.2"]
    await until_async(lambda: pool.snapshot()[0].address == new.endpoint, 5)
    await asyncio.sleep(0.3)  # lets probes run on purpose: the endpoint must stay down meanwhile
    assert not pool.snapshot()[0].healthy  # the old address still answers, but it is not the endpoint any more
    await new.start()
    try:
        await until_async(lambda: pool.snapshot()[0].healthy, 5)
        assert new.num_probes >= 1
        assert [k for k, _ in itertools.groupby(seen)][:3] == [(old.endpoint, True), (new.endpoint, False),
                                                              (new.endpoint, True)]
        # A name with several addresses stays on the one it uses (no flapping between DNS answers).
        resolver.table["model-a"] = ["127.0.0.1", "127.0.0.2"]
        lookups = len(resolver.lookups)
        await until_async(lambda: len(resolver.lookups) >= lookups + 2, 5)
        assert pool.snapshot()[0].address == new.endpoint and pool.snapshot()[0].healthy
    finally:
        await new.stop()


async def test_a_failed_lookup_keeps_the_address_and_a_passive_failure_looks_up_at_once(servers, pools):
    (a,) = await servers(1)
    resolver = Resolver({"model-a": ["127.0.0.1"]})
    pool = await pools([f"model-a:{a.port}"], dataclasses.replace(FAST, resolve_interval_s=30.0), resolver=resolver)
    assert await pool.wait_ready(5)
    del resolver.table["model-a"]  # DNS outage
    lookups = len(resolver.lookups)
    a.health_status = 503  # the failure is real (confirmed by the report's probe)
    t0 = time.monotonic()
    pool.report_failure(pool.endpoints[0])
    await until_async(lambda: len(resolver.lookups) > lookups, 5)
    assert resolver.lookups[-1] - t0 < 1.0  # not the 30 s interval
    a.health_status = 200  # the endpoint still answers at its address
    await until_async(lambda: pool.snapshot()[0].healthy, 5)  # probed again at the address it kept
    assert pool.snapshot()[0].address == a.endpoint


# --- restart detection (issue 11, finding 10) -----------------------------------------------------------------
def _metrics(start_time: float | None, prompt_tokens: float) -> bytes:
    text = VLLM_METRICS + f'vllm:prompt_tokens_total{{model_name="m"}} {prompt_tokens}\n'.encode()
    if start_time is not None:
        text += f"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {start_time}\n".encode()
    return text


@pytest.mark.parametrize("before,after", [
    ((1_700_000_000.25, 500.0), (1_700_000_123.5, 900.0)),  # start time changed (counters even grew)
    ((None, 500.0), (None, 3.0)),  # no start time exposed: the counter went backwards
])
async def test_a_restart_bumps_the_epoch_once_and_notifies_listeners(servers, pools, before, after):
    (a,) = await servers(1)
    a.metrics = _metrics(*before)
    pool = await pools([a.endpoint])
    assert await pool.wait_ready(5)
    await until_async(lambda: a.num_scrapes >= 3, 5)
    assert state(pool, a.endpoint).restart_epoch == 0  # steady scrapes: no restart
    epochs: list[int] = []
    pool.add_listener(lambda snap: epochs.append(snap[0].restart_epoch))
    a.metrics = _metrics(*after)
    await until_async(lambda: state(pool, a.endpoint).restart_epoch == 1, 5)
    n = a.num_scrapes
    await until_async(lambda: a.num_scrapes >= n + 3, 5)
    assert state(pool, a.endpoint).restart_epoch == 1 and pool.num_restarts == 1  # once, not per scrape
    assert 1 in epochs  # a structural change: the router hears of it


async def test_a_restart_while_unreachable_is_caught_at_the_first_scrape_back(servers, pools):
    (a,) = await servers(1)
    a.metrics = _metrics(1_700_000_000.0, 10_000.0)
    pool = await pools([a.endpoint])
    assert await pool.wait_ready(5)
    await until_async(lambda: a.num_scrapes >= 2, 5)
    await a.stop()
    await until_async(lambda: not state(pool, a.endpoint).healthy, 5)
    b = FakeEndpoint(port=a.port)  # the restarted process on the same port, already past the old counters
    b.metrics = _metrics(1_700_000_050.0, 20_000.0)
    await b.start()
    try:
        await until_async(lambda: state(pool, a.endpoint).healthy, 5)
        await until_async(lambda: state(pool, a.endpoint).restart_epoch == 1, 5)
    finally:
        await b.stop()
