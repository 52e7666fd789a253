"""Bodies parsed off the event loop, in real worker processes (extproc/parse_offload.py: `spawn`), give exactly what
the loop would, refuse the same, and the router routes what they parsed."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from prefixroute.extproc.parse_offload import ParseOffload
from prefixroute.extproc.routing.request import parse_request
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.openai_errors import OpenAIError

pytestmark = pytest.mark.integration

CHAT, RESP = "/v1/chat/completions", "/v1/responses"
BIG = RoutingSettings(tokenizer="sim", inline_tokenize_bytes=1024, inline_parse_objects=8)


def test_a_worker_parses_exactly_as_the_loop_does_and_refuses_the_same():
    async def run():
        off = ParseOffload(BIG)
        off.start()
        await off.wait_ready()
        try:
            body = orjson.dumps({"model": "m", "prompt_cache_key": "k" * 5000, "messages": [
                {"role": "system", "content": "sys " * 3000}, {"role": "user", "content": "question"}]})
            headers = {"x-session-id": "s" * 900, "x-request-id": "r1", "authorization": "Bearer secret"}
            got = await off.parse("POST", CHAT, headers, body, None)
            want = parse_request("POST", CHAT, headers, body, BIG, None)
            assert got.block_hashes and got.num_prompt_tokens  # token mode in the worker too
            assert (got.tenant, got.session_key, got.request_id) == (want.tenant, want.session_key, want.request_id)
            assert got.key != want.key  # a key of this process, never the worker's
            flood = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "a"}] * 200_000})
            t0 = time.monotonic()
            with pytest.raises(OpenAIError) as info:
                await off.parse("POST", CHAT, {}, flood, None)
            assert info.value.status == 400 and "max_messages" in info.value.message
            assert time.monotonic() - t0 < 5.0
            assert off.num_parsed == 1
        finally:
            off.close()

    asyncio.run(run())


def test_the_router_hands_large_bodies_to_the_worker_and_routes_what_it_parsed():
    """PoolRouter + ParseOffload as the servicer drives them: a heavy body raises NeedsParse; the parsed request
    comes back in place of the body (so only it is kept while a lookup runs); a follow-up with an unknown
    response id then needs its lookup, and routes once the id is known."""
    from helpers.peers import replica
    from prefixroute.extproc.response_directory import NeedsLookup
    from prefixroute.extproc.service import NeedsParse

    async def run():
        r = replica(BIG, offload=ParseOffload(BIG))
        r.offload.start()
        await r.offload.wait_ready()
        try:
            body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x " * 3000}]})
            with pytest.raises(NeedsParse):
                r.route("POST", CHAT, {}, body)
            parsed = await r.parse_off_loop("POST", CHAT, {}, body)
            pick = r.route("POST", CHAT, {}, parsed)
            assert pick.request is parsed and parsed.block_hashes
            follow = orjson.dumps({"model": "m", "input": "y " * 3000, "previous_response_id": "resp_abc"})
            with pytest.raises(NeedsParse):
                r.route("POST", RESP, {}, follow)
            parsed = await r.parse_off_loop("POST", RESP, {}, follow)
            with pytest.raises(NeedsLookup) as info:
                r.route("POST", RESP, {}, parsed)
            assert info.value.response_id == "resp_abc"
            r.responses.learn("resp_abc", pick.endpoint_ids[0])
            assert r.route("POST", RESP, {}, parsed).endpoint_ids == (pick.endpoint_ids[0],)
        finally:
            r.offload.close()

    asyncio.run(run())
