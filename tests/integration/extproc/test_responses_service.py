"""Responses API pinning in `PoolRouter` (healthy / unhealthy / gone / restarted / unknown -> NeedsLookup) and the
servicer's lookup round trip over real gRPC (the real PoolRouter behind it, over a scripted pool; the lookup's
GETs answered by a fake fetch).

What must hold (service.py, responses.py): a request naming a response id is routed to the endpoint holding it
alone (no fallback), a 503 with Retry-After naming the id while that endpoint is unhealthy, a lookup when the
router does not know the id, and the lookup's 404 when nobody has it; never another endpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import grpc
import orjson
import pytest

from prefixroute.extproc import wire as pb
from prefixroute.extproc.headers import DESTINATION_HEADER, MAX_FALLBACKS, fallback_header
from prefixroute.extproc.response_directory import NeedsLookup, ResponseLookup
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.types import EndpointId, EndpointState
from prefixroute.extproc.server import ExtprocSettings, start_server
from prefixroute.extproc.service import PoolRouter
from prefixroute.openai_errors import OpenAIError
from helpers.extproc_calls import exchange as _exchange
from helpers.peers import StaticPool

pytestmark = pytest.mark.integration  # loopback servers or child processes: not a unit test

MODEL = "m"
EPS = tuple(EndpointId(f"10.0.0.{i}:8000") for i in range(1, 4))
RID = "resp_" + "a" * 32


class ScriptedPool(StaticPool):
    """A `Pool` whose snapshot the test sets (`set`); listeners are called on each `set` unless told not to;
    failure reports are kept (`failures`)."""

    def __init__(self, states: tuple[EndpointState, ...]) -> None:
        super().__init__(())
        self._snapshot = states
        self.failures: list[EndpointId] = []

    @staticmethod
    def state(ep: EndpointId, *, healthy: bool = True, epoch: int = 0) -> EndpointState:
        return EndpointState(endpoint=ep, healthy=healthy, address=ep, restart_epoch=epoch)

    def set(self, states: tuple[EndpointState, ...], *, notify: bool = True) -> None:
        self._snapshot = states
        if notify:
            for fn in self._listeners:
                fn(states)

    def report_failure(self, endpoint: EndpointId) -> None:
        self.failures.append(endpoint)


class FakeFetch:
    """`Fetch`: endpoints in `holders` answer 200 for every id, others 404; records (address, id, headers)."""

    def __init__(self, holders: set[str]) -> None:
        self.holders = holders
        self.calls: list[tuple[str, str, dict[str, str]]] = []

    async def __call__(self, address: str, response_id: str, headers: Mapping[str, str]) -> int:
        self.calls.append((address, response_id, dict(headers)))
        await asyncio.sleep(0)
        return 200 if address in self.holders else 404


def make_router(fetch: FakeFetch | None = None) -> tuple[PoolRouter, ScriptedPool]:
    pool = ScriptedPool(tuple(ScriptedPool.state(ep) for ep in EPS))
    router = PoolRouter(RouterCore(RoutingSettings(num_fallbacks=2)), pool)
    if fetch is not None:
        router.lookup = ResponseLookup(router.responses, timeout_s=1.0, max_in_flight=4, fetch=fetch)
    return router, pool


def follow_up(rid: str = RID, **extra: object) -> bytes:
    return orjson.dumps({"model": MODEL, "input": "next", "previous_response_id": rid, **extra})


POST = ("POST", "/v1/responses")


def test_a_known_id_pins_to_its_healthy_endpoint_without_fallbacks() -> None:
    router, pool = make_router()
    first = router.route(*POST, {}, orjson.dumps({"model": MODEL, "input": "hi"}))
    assert len(first.endpoints) == 3  # an unpinned request gets its fallbacks
    router.release(first)
    router.responses.learn(RID, EPS[1])
    for method, path, body in (("POST", "/v1/responses", follow_up()), ("GET", f"/v1/responses/{RID}", b""),
                               ("POST", f"/v1/responses/{RID}/cancel", b""),
                               ("DELETE", f"/v1/responses/{RID}", b"")):
        pick = router.route(method, path, {}, body)
        assert pick.endpoint_ids == (EPS[1],), (method, path)
        assert pick.endpoints == (EPS[1],)
        router.release(pick)
    assert router.responses.num_hits == 4
    assert sum(pool.in_flight.values()) == 0


def test_an_unhealthy_holder_is_a_503_with_retry_after_naming_no_id() -> None:
    router, pool = make_router()
    router.responses.learn(RID, EPS[0])
    pool.set((ScriptedPool.state(EPS[0], healthy=False), *(ScriptedPool.state(ep) for ep in EPS[1:])))
    with pytest.raises(OpenAIError) as info:
        router.route(*POST, {}, follow_up())
    # No id in the text: it reaches records and the dashboard (main named it: anyone reading the dashboard
    # could read the conversation back through the gateway).
    assert info.value.status == 503 and RID not in info.value.message and info.value.retry_after_s
    assert RID not in info.value.record_message and info.value.param == "previous_response_id"
    assert sum(pool.in_flight.values()) == 0  # nothing was picked
    # It comes back healthy with the same process (same restart epoch): its store is intact, pin again.
    pool.set(tuple(ScriptedPool.state(ep) for ep in EPS))
    assert router.route(*POST, {}, follow_up()).endpoint_ids == (EPS[0],)


@pytest.mark.parametrize("how", ["left the pool", "restarted"])
def test_a_holder_gone_or_restarted_forgets_its_ids_and_the_lookup_is_asked(how: str) -> None:
    router, pool = make_router()
    router.responses.learn(RID, EPS[0])
    if how == "left the pool":
        pool.set(tuple(ScriptedPool.state(ep) for ep in EPS[1:]))
    else:
        pool.set((ScriptedPool.state(EPS[0], epoch=1), *(ScriptedPool.state(ep) for ep in EPS[1:])))
    with pytest.raises(NeedsLookup) as info:
        router.route(*POST, {}, follow_up())
    assert info.value.response_id == RID


def test_a_holder_missing_from_a_snapshot_not_yet_followed_is_a_404() -> None:
    router, pool = make_router()
    router.responses.learn(RID, EPS[0])
    pool.set(tuple(ScriptedPool.state(ep) for ep in EPS[1:]), notify=False)
    with pytest.raises(OpenAIError) as info:
        router.route(*POST, {}, follow_up())
    assert info.value.status == 404 and RID in info.value.message
    assert router.responses.endpoint_of(RID) is None  # forgotten: never pinned to it again


async def test_unknown_id_is_looked_up_then_pinned_and_the_route_after_the_lookup_is_no_hit() -> None:
    fetch = FakeFetch({EPS[2]})
    router, pool = make_router(fetch)
    with pytest.raises(NeedsLookup):
        router.route(*POST, {}, follow_up())
    assert await router.resolve(RID, {"authorization": "Bearer k", "x-other": "no"}) == EPS[2]
    assert sorted(a for a, _, _ in fetch.calls) == sorted(EPS)
    assert all(h == {"authorization": "Bearer k"} for _, _, h in fetch.calls)  # only the client's key goes along
    pick = router.route(*POST, {}, follow_up())
    assert pick.endpoint_ids == (EPS[2],)
    # The route the lookup was made for is not a directory hit (prefixroute_response_id_hits_total counts
    # requests pinned *without* a lookup: with telemetry off it must stay 0, not equal the lookups).
    assert router.responses.num_hits == 0 and router.lookup.num_found == 1
    assert router.route(*POST, {}, follow_up()).endpoint_ids == (EPS[2],)
    assert router.responses.num_hits == 1 and len(fetch.calls) == 3


async def test_unknown_everywhere_is_a_404_remembered_briefly() -> None:
    fetch = FakeFetch(set())
    router, _ = make_router(fetch)
    with pytest.raises(NeedsLookup):
        router.route(*POST, {}, follow_up())
    with pytest.raises(OpenAIError) as info:
        await router.resolve(RID, {})
    assert info.value.status == 404 and RID in info.value.message and info.value.param == "response_id"
    with pytest.raises(OpenAIError) as info:  # the negative cache answers: no second fan-out
        router.route("GET", f"/v1/responses/{RID}", {}, b"")
    assert info.value.status == 404 and len(fetch.calls) == 3


async def test_lookup_asks_only_healthy_endpoints() -> None:
    fetch = FakeFetch({EPS[0]})
    router, pool = make_router(fetch)
    pool.set((ScriptedPool.state(EPS[0], healthy=False), *(ScriptedPool.state(ep) for ep in EPS[1:])))
    with pytest.raises(OpenAIError) as info:
        await router.resolve(RID, {})
    assert info.value.status == 404
    assert sorted(a for a, _, _ in fetch.calls) == sorted(EPS[1:])


# --- the servicer's lookup round trip, over real gRPC ---------------------------------------------------------

def _headers(pairs: dict[str, str], end_of_stream: bool):  # noqa: ANN202 - wire classes are dynamic
    hm = pb.HeaderMap(headers=[pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=end_of_stream))


def _body(data: bytes):  # noqa: ANN202
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=True))


def _destinations(common) -> dict[str, str]:  # noqa: ANN001
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


@pytest.fixture
async def served() -> AsyncIterator[tuple[PoolRouter, ScriptedPool, FakeFetch, object]]:
    fetch = FakeFetch({EPS[1]})
    router, pool = make_router(fetch)
    server, port = await start_server(router, ExtprocSettings(port=0, listen_address="127.0.0.1"))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield router, pool, fetch, pb.process_call(channel)
    finally:
        await channel.close()
        await server.stop(None)


POST_H = {":method": "POST", ":path": "/v1/responses", "content-type": "application/json",
          "authorization": "Bearer sk-1"}


async def test_servicer_unknown_id_waits_for_its_lookup_then_routes_to_the_holder(served) -> None:  # noqa: ANN001
    router, pool, fetch, process = served
    _, r_body = await _exchange(process, [_headers(POST_H, end_of_stream=False), _body(follow_up())])
    assert r_body.WhichOneof("response") == "request_body"
    # The holder alone, in every fallback header too (Envoy's retries go nowhere else).
    assert _destinations(r_body.request_body.response) == {
        DESTINATION_HEADER: EPS[1], **{fallback_header(k): EPS[1] for k in range(1, MAX_FALLBACKS + 1)}}
    assert {h["authorization"] for _, _, h in fetch.calls} == {"Bearer sk-1"}
    # A GET of the same id, decided at the request headers: the directory now knows it, no second fan-out.
    (r_get,) = await _exchange(process, [_headers({":method": "GET", ":path": f"/v1/responses/{RID}"}, True)])
    assert _destinations(r_get.request_headers.response)[DESTINATION_HEADER] == EPS[1]
    assert len(fetch.calls) == 3
    await asyncio.sleep(0.05)
    assert sum(pool.in_flight.values()) == 0  # both picks released when their streams ended


async def test_servicer_get_of_an_id_nobody_holds_is_an_immediate_openai_404(served) -> None:  # noqa: ANN001
    router, pool, fetch, process = served
    fetch.holders.clear()
    rid = "resp_" + "b" * 32
    (r,) = await _exchange(process, [_headers({":method": "GET", ":path": f"/v1/responses/{rid}"}, True)])
    assert r.WhichOneof("response") == "immediate_response"
    assert r.immediate_response.status.code == 404
    err = orjson.loads(r.immediate_response.body)["error"]
    assert rid in err["message"] and err["param"] == "response_id" and err["code"] == 404
    assert len(fetch.calls) == 3 and sum(pool.in_flight.values()) == 0


async def test_servicer_holder_lost_during_the_lookup_is_refused_not_rerouted(served) -> None:  # noqa: ANN001
    router, pool, fetch, process = served

    async def found_then_gone(address: str, response_id: str, headers: Mapping[str, str]) -> int:
        fetch.calls.append((address, response_id, dict(headers)))
        if address != EPS[1]:
            await asyncio.sleep(0.2)  # the holder answers first
            return 404
        # The holder answers 200, and leaves the pool before the request is routed again.
        asyncio.get_running_loop().call_soon(pool.set, (ScriptedPool.state(EPS[0]), ScriptedPool.state(EPS[2])))
        return 200

    router.lookup._fetch = found_then_gone  # noqa: SLF001 - script the GETs of this one lookup
    _, r_body = await _exchange(process, [_headers(POST_H, end_of_stream=False), _body(follow_up())])
    assert r_body.WhichOneof("response") == "immediate_response"  # never another endpoint
    assert r_body.immediate_response.status.code in (404, 503)
    assert RID in orjson.loads(r_body.immediate_response.body)["error"]["message"]
    assert len(fetch.calls) == 3  # one fan-out only
    assert sum(pool.in_flight.values()) == 0


def test_a_found_id_dropped_before_its_route_leaves_no_mark() -> None:
    """The "just found" mark goes with the id (forgotten, expired): a later learn + use of the id is a hit."""
    now = [0.0]
    router, _ = make_router()
    d = router.responses
    d.clock = lambda: now[0]
    d.learn(RID, EPS[0], by_lookup=True)
    d.forget_endpoint(EPS[0])
    d.learn(RID, EPS[1])
    assert d.endpoint_of(RID) == EPS[1] and d.num_hits == 1
    d.learn("resp_x", EPS[1], by_lookup=True)
    now[0] += d.ttl_s + 1
    assert d.endpoint_of("resp_x") is None
    d.learn("resp_x", EPS[1])
    assert d.endpoint_of("resp_x") == EPS[1] and d.num_hits == 2
    assert not d._found  # noqa: SLF001 - bounded: nothing left behind


def test_a_follow_up_predicts_its_previous_prompt_cached_from_that_responses_usage() -> None:
    # The follow-up's own hashes show only its instructions; its holder has the whole previous prompt. The
    # previous response's usage (prompt tokens) tells the router how much: the prediction (hit statistics,
    # /metrics predicted vs actual) must say so, and feedback must not shrink the index on it.
    router, pool = make_router()
    first = router.route(*POST, {}, orjson.dumps({"model": MODEL, "instructions": "be brief", "input": "hi"}))
    router.learn_response(first, RID, first.endpoints[0])
    router.first_token(first, 0.05)
    router.usage(first, 3000, 0)
    router.release(first)
    assert router.responses.prompt_tokens(RID) == 3000
    pick = router.route(*POST, {}, follow_up(instructions="be brief"))
    assert pick.endpoint_ids == (first.endpoint_ids[0],)
    assert pick.request.known_prefix_tokens == 3000 - router.settings.kv_block_tokens
    assert router.core.predicted_cached_tokens(pick.request, pick.decision) == 3000 - 16
    router.usage(pick, 3400, 2990)
    stats = router.core.hit_stats[pick.endpoint_ids[0]]
    assert stats.predicted_tokens == pytest.approx(2984)
    assert stats.num_misses == 0
    # An id whose usage never came: the prediction is the hashes' alone (nothing invented).
    other = "resp_" + "b" * 32
    router.responses.learn(other, EPS[2])
    pick2 = router.route(*POST, {}, follow_up(other))
    assert pick2.request.known_prefix_tokens is None
    # The figure goes with its id.
    router.responses.forget_endpoint(first.endpoint_ids[0])
    assert router.responses.prompt_tokens(RID) is None


def test_a_previous_usage_that_arrives_after_the_follow_up_was_routed_still_sets_its_prediction() -> None:
    # The client sends the follow-up as soon as it sees the previous response end; the observing stream may
    # report that response's usage a moment later. The follow-up's own usage report comes later still.
    router, pool = make_router()
    first = router.route(*POST, {}, orjson.dumps({"model": MODEL, "instructions": "be brief", "input": "hi"}))
    router.learn_response(first, RID, first.endpoints[0])
    pick = router.route(*POST, {}, follow_up(instructions="be brief"))
    assert pick.request.known_prefix_tokens is None  # not known yet at the decision
    router.usage(first, 3000, 0)
    router.first_token(pick, 0.04)
    router.usage(pick, 3400, 2990)
    stats = router.core.hit_stats[pick.endpoint_ids[0]]
    assert stats.predicted_tokens == pytest.approx(3000 - 16)


def test_envoys_503_for_a_pinned_pick_asks_the_pool_to_probe_the_holder_once() -> None:
    # A pinned pick has no fallback: when its holder refuses the connection Envoy answers 503 itself, naming the
    # holder as the served host. That must trigger the pool's probe (so the next follow-up gets the router's
    # own 503 naming the id), once per pick; an unpinned pick's 503 from its primary is the server's answer.
    router, pool = make_router()
    router.responses.learn(RID, EPS[1])
    pick = router.route(*POST, {}, follow_up())
    router.served(pick, EPS[1], 200)
    assert pool.failures == []
    router.served(pick, EPS[1], 503)
    router.served(pick, EPS[1], 503)
    assert pool.failures == [EPS[1]]
    plain = router.route(*POST, {}, orjson.dumps({"model": MODEL, "input": "hi"}))
    router.served(plain, plain.endpoints[0], 503)
    assert pool.failures == [EPS[1]]
