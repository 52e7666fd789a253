"""`PoolRouter` (RouterCore + a real EndpointPool probing real HTTP endpoints in-process): in-flight accounting,
passive failure from the served header, errors, addresses from the pool's snapshot (names, moves)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable

import orjson
import pytest
from aiohttp import web

from prefixroute.extproc.endpoints.pool import EndpointPool
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.service import PoolRouter
from prefixroute.openai_errors import OpenAIError
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.settings import RoutingSettings
from helpers.waiting import until_async

pytestmark = pytest.mark.integration  # loopback servers or child processes: not a unit test

MODEL = "m"
FAST = PoolSettings(resolve_interval_s=0.05, probe_interval_s=0.05, failure_probe_delay_s=0.05)


async def _endpoint(host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, str]:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/v1/models", models), web.get("/metrics", metrics)])
    runner = web.AppRunner(app, shutdown_timeout=0.1)  # a test server stops at once
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - aiohttp exposes no public accessor
    return runner, f"{host}:{port}"




@pytest.fixture
async def router() -> AsyncIterator[PoolRouter]:
    runners, eps = [], []
    for _ in range(3):
        r, ep = await _endpoint()
        runners.append(r)
        eps.append(ep)
    settings = RoutingSettings(num_fallbacks=2)
    pool = EndpointPool(PoolSettings(endpoints=tuple(eps)))  # probes 1 s apart, 2 failures: >= 1 s to go down
    await pool.start()
    try:
        assert await pool.wait_ready(5.0)
        router = PoolRouter(RouterCore(settings), pool)
        router.test_runners = dict(zip(eps, runners))  # type: ignore[attr-defined] - tests stop endpoints
        yield router
    finally:
        await pool.close()
        for r in runners:
            await r.cleanup()


def _chat(text: str, model: str = MODEL) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": text}]})


POST = ("POST", "/v1/chat/completions")


async def test_pick_counts_in_flight_until_released_once(router: PoolRouter) -> None:
    pick = router.route(*POST, {}, _chat("hello " * 100))
    assert len(pick.endpoints) == 3 and len(set(pick.endpoints)) == 3
    primary = pick.endpoint_ids[0]
    assert router.pool.in_flight[primary] == 1
    router.served(pick, pick.endpoints[0])  # served where picked: nothing to report
    assert router.num_failovers == 0
    router.release(pick)
    router.release(pick)  # a second release must not count twice
    assert router.pool.in_flight[primary] == 0
    assert all(s.healthy for s in router.pool.snapshot())


async def _stop(router: PoolRouter, endpoint: str) -> None:
    await router.test_runners[endpoint].cleanup()  # type: ignore[attr-defined]


def _health(router: PoolRouter) -> dict[str, bool]:
    return {s.endpoint: s.healthy for s in router.pool.snapshot()}


async def test_served_elsewhere_marks_a_dead_primary_down_at_once_and_moves_in_flight(router: PoolRouter) -> None:
    pick = router.route(*POST, {}, _chat("failover " * 100))
    primary, fallback = pick.endpoint_ids[0], pick.endpoint_ids[1]
    await _stop(router, primary)
    t0 = time.monotonic()
    router.served(pick, pick.endpoints[1])
    assert router.num_failovers == 1
    assert router.pool.in_flight[primary] == 0 and router.pool.in_flight[fallback] == 1
    # The report's confirming probe finds it dead: down well before two regular probes (1 s apart) could.
    await until_async(lambda: not _health(router)[primary], timeout_s=0.8)
    assert time.monotonic() - t0 < 0.8 and _health(router)[fallback]
    router.release(pick)
    assert router.pool.in_flight[fallback] == 0
    # The next request of that prefix avoids the endpoint now known down.
    again = router.route(*POST, {}, _chat("failover " * 100))
    assert again.endpoint_ids[0] != primary
    router.release(again)


async def test_a_report_against_a_live_endpoint_is_not_confirmed_and_marks_nothing_down(router: PoolRouter) -> None:
    pick = router.route(*POST, {}, _chat("forged failover " * 100))
    primary = pick.endpoint_ids[0]
    router.served(pick, pick.endpoints[1])  # what a forged stream (or a one-off reset) reports
    await until_async(lambda: router.pool.num_unconfirmed_failures == 1, 5.0)
    assert _health(router)[primary]
    # Within the quiet period further reports cost no probe.
    again = router.route(*POST, {}, _chat("forged failover " * 100))
    router.served(again, again.endpoints[1])
    assert router.pool.num_ignored_failure_reports >= 1
    await asyncio.sleep(0.1)
    assert all(_health(router).values()) and router.pool.num_unconfirmed_failures == 1
    router.release(pick)
    router.release(again)


async def test_every_endpoint_tried_before_the_one_that_served_is_marked_down(router: PoolRouter) -> None:
    pick = router.route(*POST, {}, _chat("double failover " * 100))
    await _stop(router, pick.endpoint_ids[0])
    await _stop(router, pick.endpoint_ids[1])
    router.served(pick, pick.endpoints[2])
    await until_async(lambda: [_health(router)[ep] for ep in pick.endpoint_ids] == [False, False, True], timeout_s=0.8)
    assert router.pool.in_flight[pick.endpoint_ids[2]] == 1
    router.release(pick)


async def test_unknown_served_address_changes_nothing(router: PoolRouter) -> None:
    pick = router.route(*POST, {}, _chat("unknown served " * 100))
    router.served(pick, "-")  # what Envoy reports on its own local replies
    router.served(pick, "192.0.2.1:9")  # not a pool endpoint
    assert router.num_failovers == 0 and all(s.healthy for s in router.pool.snapshot())
    assert router.num_ignored_reports == 2
    router.release(pick)


async def test_only_a_fallback_of_the_pick_and_only_the_first_report_count() -> None:
    runners, eps = [], []
    for _ in range(3):
        r, ep = await _endpoint()
        runners.append(r)
        eps.append(ep)
    pool = EndpointPool(PoolSettings(endpoints=tuple(eps)))
    await pool.start()
    try:
        assert await pool.wait_ready(5.0)
        router = PoolRouter(RouterCore(RoutingSettings(num_fallbacks=1)), pool)
        pick = router.route(*POST, {}, _chat("outsider " * 100))
        outsider = next(ep for ep in eps if ep not in pick.endpoints)  # a pool endpoint, not a candidate
        await runners[eps.index(pick.endpoint_ids[0])].cleanup()  # even a dead primary: the report is not Envoy's
        router.served(pick, outsider)
        assert router.num_failovers == 0 and router.num_ignored_reports == 1
        assert pool.in_flight[pick.endpoint_ids[0]] == 1 and pool.in_flight[outsider] == 0
        await asyncio.sleep(0.3)
        assert all(s.healthy for s in pool.snapshot())  # no probe was asked for: the regular ones are 1 s apart
        router.served(pick, pick.endpoints[1])
        router.served(pick, pick.endpoints[1])  # a second report of the same pick is ignored
        assert router.num_failovers == 1 and router.num_ignored_reports == 2
        assert pool.in_flight[pick.endpoint_ids[1]] == 1
        router.release(pick)
    finally:
        await pool.close()
        for r in runners:
            await r.cleanup()


@pytest.mark.parametrize(("method", "path", "body", "status"), [
    ("POST", "/v1/chat/completions", b"{bad", 400),
    ("POST", "/v1/chat/completions", _chat("x", model="other-model"), 404),
    ("GET", "/v1/chat/completions", b"", 405),
    ("POST", "/v1/completions", orjson.dumps({"model": MODEL, "prompt": 3}), 400),
])
async def test_refusals_raise_openai_errors_and_count_nothing(router: PoolRouter, method: str, path: str,
                                                              body: bytes, status: int) -> None:
    with pytest.raises(OpenAIError) as info:
        router.route(method, path, {}, body)
    assert info.value.status == status
    assert sum(router.pool.in_flight.values()) == 0


async def test_non_inference_path_routes_without_a_body(router: PoolRouter) -> None:
    pick = router.route("GET", "/v1/models", {}, b"")
    assert pick.endpoint_ids[0] in router.pool.endpoints
    router.release(pick)


async def test_a_name_is_routed_as_the_address_it_resolves_to() -> None:
    # localhost's first address (what getaddrinfo, and so the pool, prefers): the endpoint listens there.
    info = await asyncio.get_running_loop().getaddrinfo("localhost", None, type=socket.SOCK_STREAM)
    ip = info[0][4][0]
    runner, literal = await _endpoint(ip)
    port = literal.rpartition(":")[2]
    pool = EndpointPool(FAST, [f"localhost:{port}"])
    await pool.start()
    try:
        assert await pool.wait_ready(5.0)
        router = PoolRouter(RouterCore(RoutingSettings()), pool)
        pick = router.route(*POST, {}, _chat("named " * 100))
        address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        assert pick.endpoint_ids == (f"localhost:{port}",) and pick.endpoints == (address,)
        assert router.endpoint_of(address) == f"localhost:{port}"
        router.release(pick)
    finally:
        await pool.close()
        await runner.cleanup()


async def test_an_unresolved_name_is_never_routed_and_joins_once_it_resolves() -> None:
    up_runner, up = await _endpoint()
    late_runner, late_literal = await _endpoint()
    late = f"model-late:{late_literal.rpartition(':')[2]}"
    resolvable = asyncio.Event()

    async def resolver(host: str, port: int) -> list[str]:
        if host == "model-late" and resolvable.is_set():
            return ["127.0.0.1"]
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    pool = EndpointPool(FAST, [up, late], resolver=resolver)
    await pool.start()
    try:
        assert await pool.wait_ready(5.0, num_healthy=1)
        router = PoolRouter(RouterCore(RoutingSettings(policy="round-robin")), pool)
        await asyncio.sleep(0.3)  # several failed lookups and probe intervals
        picks = [router.route(*POST, {}, _chat(f"spread {i} " * 50)) for i in range(6)]
        assert {p.endpoint_ids[0] for p in picks} == {up}  # round-robin would alternate over two healthy ones
        assert next(s for s in pool.snapshot() if s.endpoint == late).address is None
        resolvable.set()
        assert await pool.wait_ready(5.0)
        picks += [router.route(*POST, {}, _chat(f"spread {i} " * 50)) for i in range(6)]
        assert {p.endpoints[0] for p in picks[6:]} == {up, late_literal}
        assert router.endpoint_of(late_literal) == late
        for p in picks:
            router.release(p)
    finally:
        await pool.close()
        await up_runner.cleanup()
        await late_runner.cleanup()


async def test_after_a_move_the_old_address_still_maps_for_requests_in_flight() -> None:
    old_runner, old = await _endpoint("127.0.0.1")
    port = int(old.rpartition(":")[2])
    new_runner, new = await _endpoint("127.0.0.2", port)  # the restarted container: same port, new address
    current = ["127.0.0.1"]

    async def resolver(host: str, p: int) -> list[str]:
        return list(current)

    name = f"model-a:{port}"
    pool = EndpointPool(FAST, [name], resolver=resolver)
    await pool.start()
    try:
        assert await pool.wait_ready(5.0)
        router = PoolRouter(RouterCore(RoutingSettings(), track_prefill=True), pool)
        before = router.route(*POST, {}, _chat("moving " * 100))
        assert before.endpoints == (old,)
        current[:] = ["127.0.0.2"]
        await until_async(lambda: pool.snapshot()[0].address == new and pool.snapshot()[0].healthy, 5.0)
        after = router.route(*POST, {}, _chat("moving " * 100))
        assert after.endpoints == (new,)
        assert router.endpoint_of(old) == name and router.endpoint_of(new) == name
        router.served(before, old)  # the request sent before the move reports its address: no failover
        assert router.num_failovers == 0 and pool.in_flight[name] == 2
        router.release(before)
        router.release(after)
        assert pool.in_flight[name] == 0
    finally:
        await pool.close()
        await old_runner.cleanup()
        await new_runner.cleanup()


async def test_release_returns_outstanding_prefill_to_zero(router: PoolRouter) -> None:
    tracked = PoolRouter(RouterCore(router.settings, track_prefill=True), router.pool)
    policy = tracked.core.learner
    picks = [tracked.route(*POST, {}, _chat(f"cold prompt {i} " * 200)) for i in range(3)]
    assert sum(policy.outstanding_prefill_tokens().values()) > 0
    for pick in picks:
        tracked.release(pick)
        tracked.release(pick)  # idempotent: the second release must not subtract again
    assert sum(policy.outstanding_prefill_tokens().values()) == 0


async def test_a_subset_hint_picks_only_inside_it_and_503s_when_none_is_eligible(router: PoolRouter) -> None:
    eps = list(router.pool.endpoints)
    for k in range(12):  # whatever the prefix and load, only the hinted endpoints are ever named
        pick = router.route(*POST, {}, _chat(f"subset {k} " * 50), subset=[eps[1], eps[2]])
        assert set(pick.endpoints) <= {eps[1], eps[2]} and pick.endpoints
        router.release(pick)
    host = eps[0].rpartition(":")[0]
    pick = router.route(*POST, {}, _chat("bare ip"), subset=[host])  # a bare IP: every port of it
    assert pick.endpoints[0] in eps
    router.release(pick)
    for subset in ([], ["10.9.9.9:1"]):  # empty, or naming no endpoint of the pool: none eligible
        with pytest.raises(OpenAIError) as exc:
            router.route(*POST, {}, _chat("nothing eligible"), subset=subset)
        assert exc.value.status == 503 and exc.value.retry_after_s is not None
    assert all(n == 0 for n in router.pool.in_flight.values())
