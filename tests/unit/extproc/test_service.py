"""`PoolRouter` (RouterCore + a real EndpointPool probing real HTTP endpoints in-process): in-flight accounting,
passive failure from the served header, errors, address resolution."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from prefixroute.extproc.endpoints.pool import EndpointPool
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.service import PoolRouter, resolve_address
from prefixroute.openai_errors import OpenAIError
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.settings import RoutingSettings

MODEL = "m"


async def _endpoint() -> tuple[web.AppRunner, str]:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/v1/models", models), web.get("/metrics", metrics)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - aiohttp exposes no public accessor
    return runner, f"127.0.0.1:{port}"


@pytest.fixture
async def router() -> AsyncIterator[PoolRouter]:
    runners, eps = [], []
    for _ in range(3):
        r, ep = await _endpoint()
        runners.append(r)
        eps.append(ep)
    settings = RoutingSettings(num_fallbacks=2)
    pool = EndpointPool(PoolSettings(endpoints=tuple(eps)))
    await pool.start()
    try:
        assert await pool.wait_ready(5.0)
        yield PoolRouter(RouterCore(settings), pool, settings)
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


async def test_served_elsewhere_marks_primary_down_and_moves_in_flight(router: PoolRouter) -> None:
    pick = router.route(*POST, {}, _chat("failover " * 100))
    primary, fallback = pick.endpoint_ids[0], pick.endpoint_ids[1]
    router.served(pick, pick.endpoints[1])
    assert router.num_failovers == 1
    health = {s.endpoint: s.healthy for s in router.pool.snapshot()}
    assert health[primary] is False and health[fallback] is True
    assert router.pool.in_flight[primary] == 0 and router.pool.in_flight[fallback] == 1
    router.release(pick)
    assert router.pool.in_flight[fallback] == 0
    # The next request of that prefix avoids the endpoint now known down.
    again = router.route(*POST, {}, _chat("failover " * 100))
    assert again.endpoint_ids[0] != primary
    router.release(again)


async def test_every_endpoint_tried_before_the_one_that_served_is_marked_down(router: PoolRouter) -> None:
    pick = router.route(*POST, {}, _chat("double failover " * 100))
    router.served(pick, pick.endpoints[2])
    health = {s.endpoint: s.healthy for s in router.pool.snapshot()}
    assert [health[ep] for ep in pick.endpoint_ids] == [False, False, True]
    assert router.pool.in_flight[pick.endpoint_ids[2]] == 1
    router.release(pick)


async def test_unknown_served_address_changes_nothing(router: PoolRouter) -> None:
    pick = router.route(*POST, {}, _chat("unknown served " * 100))
    router.served(pick, "-")  # what Envoy reports on its own local replies
    router.served(pick, "192.0.2.1:9")  # not a pool endpoint
    assert router.num_failovers == 0 and all(s.healthy for s in router.pool.snapshot())
    router.release(pick)


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


@pytest.mark.parametrize(("endpoint", "address"), [
    ("127.0.0.1:8000", "127.0.0.1:8000"),
    ("localhost:8001", "127.0.0.1:8001"),
    ("[::1]:8002", "[::1]:8002"),
])
def test_endpoint_ids_resolve_to_addresses_for_original_dst(endpoint: str, address: str) -> None:
    assert resolve_address(endpoint) in (address, "[::1]:8001" if endpoint.startswith("localhost") else address)


async def test_release_returns_outstanding_prefill_to_zero(router: PoolRouter) -> None:
    tracked = PoolRouter(RouterCore(router.settings, track_prefill=True), router.pool, router.settings)
    policy = tracked.core.scheduler.policy
    picks = [tracked.route(*POST, {}, _chat(f"cold prompt {i} " * 200)) for i in range(3)]
    assert sum(policy.outstanding_prefill_tokens().values()) > 0
    for pick in picks:
        tracked.release(pick)
        tracked.release(pick)  # idempotent: the second release must not subtract again
    assert sum(policy.outstanding_prefill_tokens().values()) == 0
