"""`ResponseDirectory` (bounds, expiry, endpoint removal and restart) and `ResponseLookup` against real HTTP
endpoints in-process (one has the id / none / one hangs / over the in-flight bound), and `PoolRouter`'s
pinning of a request with a response id (one endpoint, never another; unhealthy 503; gone 404)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from prefixroute.extproc.response_directory import NEGATIVE_TTL_S, NeedsLookup, ResponseDirectory, ResponseLookup
from prefixroute.types import EndpointId, EndpointState
from prefixroute.openai_errors import OpenAIError


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


A, B, C = EndpointId("a:1"), EndpointId("b:1"), EndpointId("c:1")


def test_learn_and_find() -> None:
    d = ResponseDirectory(10, 60.0, clock=Clock())
    d.learn("resp_1", A)
    d.learn("resp_2", B)
    assert (d.endpoint_of("resp_1"), d.endpoint_of("resp_2"), d.endpoint_of("resp_3")) == (A, B, None)


def test_lru_bound_evicts_least_recently_used() -> None:
    d = ResponseDirectory(3, 60.0, clock=Clock())
    for i in range(3):
        d.learn(f"resp_{i}", A)
    assert d.endpoint_of("resp_0") == A  # used: now the most recent
    d.learn("resp_3", B)
    assert len(d) == 3 and d.num_evicted == 1
    assert d.endpoint_of("resp_1") is None  # the least recently used went
    assert [d.endpoint_of(f"resp_{i}") for i in (0, 2, 3)] == [A, A, B]


@pytest.mark.parametrize("elapsed_s, known", [(59.9, True), (60.0, False), (500.0, False)])
def test_expiry_after_ttl(elapsed_s: float, known: bool) -> None:
    clock = Clock()
    d = ResponseDirectory(10, 60.0, clock=clock)
    d.learn("resp_1", A)
    clock.t += elapsed_s
    assert (d.endpoint_of("resp_1") == A) is known


def test_use_refreshes_expiry_and_sweep_drops_expired() -> None:
    clock = Clock()
    d = ResponseDirectory(10, 60.0, clock=clock)
    d.learn("resp_old", A)
    d.learn("resp_used", A)
    clock.t += 50
    assert d.endpoint_of("resp_used") == A
    clock.t += 50  # resp_old is 100 s old, resp_used was used 50 s ago
    d.learn("resp_new", B)  # a learn sweeps the expired end
    assert len(d) == 2 and d.num_expired == 1
    assert d.endpoint_of("resp_used") == A


def test_endpoint_removed_or_restarted_forgets_its_ids() -> None:
    d = ResponseDirectory(10, 60.0, clock=Clock())
    d.sync([EndpointState(A), EndpointState(B), EndpointState(C)])
    d.learn("resp_a", A)
    d.learn("resp_b", B)
    d.learn("resp_c", C)
    d.sync([EndpointState(A), EndpointState(B, restart_epoch=1), EndpointState(C)])  # B restarted
    assert d.endpoint_of("resp_b") is None and d.endpoint_of("resp_a") == A
    d.sync([EndpointState(A), EndpointState(B, restart_epoch=1)])  # C left the pool
    assert d.endpoint_of("resp_c") is None and d.endpoint_of("resp_a") == A
    assert d.num_forgotten == 2
    d.sync([EndpointState(A, healthy=False), EndpointState(B, restart_epoch=1)])  # down is not gone
    assert d.endpoint_of("resp_a") == A


def test_relearn_moves_an_id() -> None:
    d = ResponseDirectory(10, 60.0, clock=Clock())
    d.learn("resp_1", A)
    d.learn("resp_1", B)
    assert d.forget_endpoint(A) == 0 and d.endpoint_of("resp_1") == B


def test_negative_cache_expires_and_learning_clears_it() -> None:
    clock = Clock()
    d = ResponseDirectory(10, 60.0, clock=clock)
    d.note_missing("resp_x")
    assert d.is_missing("resp_x")
    clock.t += NEGATIVE_TTL_S
    assert not d.is_missing("resp_x")
    d.note_missing("resp_y")
    d.learn("resp_y", A)
    assert not d.is_missing("resp_y")


# --- lookup against real HTTP endpoints ------------------------------------------------------------------

_RELEASE: list[asyncio.Event] = []


async def _store_endpoint(ids: set[str], *, hang: bool = False, status: int | None = None
                          ) -> tuple[web.AppRunner, str, list[str]]:
    seen: list[str] = []
    release = asyncio.Event()
    _RELEASE.append(release)

    async def get(request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        seen.append(request.headers.get("authorization", ""))
        if hang:  # until the test ends (then answered, not cancelled)
            await release.wait()
        if status is not None:
            return web.Response(status=status)
        if rid in ids:
            return web.json_response({"id": rid, "object": "response"})
        return web.json_response({"error": {"message": "not found"}}, status=404)

    app = web.Application()
    app.add_routes([web.get("/v1/responses/{rid}", get)])
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"127.0.0.1:{port}", seen


@pytest.fixture
async def fleet():
    runners = []

    async def make(*specs):
        out = []
        for ids, kw in specs:
            runner, addr, seen = await _store_endpoint(ids, **kw)
            runners.append(runner)
            out.append((addr, seen))
        return out

    yield make
    for ev in _RELEASE:
        ev.set()
    _RELEASE.clear()
    await asyncio.sleep(0.05)
    for r in runners:
        await r.cleanup()


async def test_lookup_finds_the_endpoint_holding_the_id(fleet) -> None:
    eps = await fleet((set(), {}), ({"resp_1"}, {}), (set(), {}))
    d = ResponseDirectory(10, 60.0)
    lk = ResponseLookup(d, timeout_s=2.0, max_in_flight=4)
    cands = [(EndpointId(f"ep{i}"), addr) for i, (addr, _) in enumerate(eps)]
    try:
        assert await lk.resolve("resp_1", cands, {"authorization": "Bearer k"}) == "ep1"
    finally:
        await lk.close()
    assert d.endpoint_of("resp_1") == "ep1" and lk.num_found == 1
    assert eps[1][1] == ["Bearer k"]  # the client's key went with the lookup


async def test_lookup_none_has_it_is_vllms_404_naming_the_id(fleet) -> None:
    eps = await fleet((set(), {}), (set(), {}))
    d = ResponseDirectory(10, 60.0)
    lk = ResponseLookup(d, timeout_s=2.0, max_in_flight=4)
    try:
        with pytest.raises(OpenAIError) as ei:
            await lk.resolve("resp_gone", [(EndpointId(f"ep{i}"), a) for i, (a, _) in enumerate(eps)])
    finally:
        await lk.close()
    assert ei.value.status == 404 and "resp_gone" in ei.value.message and ei.value.param == "response_id"
    assert d.is_missing("resp_gone") and lk.num_not_found == 1


async def test_lookup_one_hangs_is_503_with_retry_after(fleet) -> None:
    eps = await fleet((set(), {}), (set(), {"hang": True}))
    lk = ResponseLookup(ResponseDirectory(10, 60.0), timeout_s=0.3, max_in_flight=4, retry_after_s=2)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        with pytest.raises(OpenAIError) as ei:
            await lk.resolve("resp_1", [(EndpointId(f"ep{i}"), a) for i, (a, _) in enumerate(eps)])
    finally:
        await lk.close()
    assert loop.time() - t0 < 1.5
    assert ei.value.status == 503 and ei.value.retry_after_s == 2 and "resp_1" in ei.value.message
    assert not lk._in_flight


async def test_lookup_found_while_another_hangs(fleet) -> None:
    eps = await fleet(({"resp_1"}, {}), (set(), {"hang": True}), (set(), {"status": 500}))
    lk = ResponseLookup(ResponseDirectory(10, 60.0), timeout_s=5.0, max_in_flight=4)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        ep = await lk.resolve("resp_1", [(EndpointId(f"ep{i}"), a) for i, (a, _) in enumerate(eps)])
    finally:
        await lk.close()
    assert ep == "ep0" and loop.time() - t0 < 2.0  # the first 200 wins; the hung one is not waited for


async def test_lookup_refused_over_the_in_flight_bound_and_same_id_shares(fleet) -> None:
    eps = await fleet((set(), {"hang": True}))
    lk = ResponseLookup(ResponseDirectory(10, 60.0), timeout_s=0.5, max_in_flight=1)
    cands = [(EndpointId("ep0"), eps[0][0])]
    try:
        first = asyncio.ensure_future(lk.resolve("resp_1", cands))
        same = asyncio.ensure_future(lk.resolve("resp_1", cands))
        await asyncio.sleep(0.05)
        with pytest.raises(OpenAIError) as ei:
            await lk.resolve("resp_2", cands)
        assert ei.value.status == 503 and ei.value.retry_after_s is not None and lk.num_refused == 1
        for f in (first, same):
            with pytest.raises(OpenAIError):
                await f
    finally:
        await lk.close()
    assert lk.num_lookups == 1 and len(eps[0][1]) == 1  # one fan-out served both requests for resp_1


async def test_lookup_without_candidates_is_503() -> None:
    lk = ResponseLookup(ResponseDirectory(10, 60.0), timeout_s=0.5, max_in_flight=1)
    with pytest.raises(OpenAIError) as ei:
        await lk.resolve("resp_1", [])
    assert ei.value.status == 503


def test_needs_lookup_names_the_id() -> None:
    assert NeedsLookup("resp_9").response_id == "resp_9"
