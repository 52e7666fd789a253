"""`ResponseLookup` against real HTTP endpoints in-process (aiohttp on loopback): one has the id, none has it,
one hangs, over the in-flight bound."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from helpers.waiting import until_async
from prefixroute.extproc.response_directory import ResponseDirectory, ResponseLookup
from prefixroute.openai_errors import OpenAIError
from prefixroute.types import EndpointId

pytestmark = pytest.mark.integration


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
    await asyncio.sleep(0.05)  # on purpose: the released handlers answer before their servers are cleaned up
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
    assert ei.value.status == 503 and ei.value.retry_after_s == 2 and "resp_1" not in ei.value.message
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
        await until_async(lambda: len(eps[0][1]) == 1, 5, message="the first lookup at the endpoint")
        with pytest.raises(OpenAIError) as ei:
            await lk.resolve("resp_2", cands)
        assert ei.value.status == 503 and ei.value.retry_after_s is not None and lk.num_refused == 1
        for f in (first, same):
            with pytest.raises(OpenAIError):
                await f
    finally:
        await lk.close()
    assert lk.num_lookups == 1 and len(eps[0][1]) == 1  # one fan-out served both requests for resp_1
