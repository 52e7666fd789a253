"""Parse budgets for every body shape (extproc/parse_offload.py): token-id prompts counted before they are parsed,
bodies of many JSON values (a list of token-id lists holds no '{') kept off the event loop, and the parse workers
shared fairly between clients (their flows), so one client's flood of large bodies cannot make the others' wait
into 503s. The workers are a thread here (the worker processes are tested in
tests/integration/routing/test_parse_workers.py and tests/integration/reliability/test_trust_hardening.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import time

import orjson
import pytest

from prefixroute.extproc import parse_offload
from prefixroute.extproc.parse_offload import ParseOffload, precheck_lists
from prefixroute.extproc.routing.request import InferenceRequest, parse_request
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.openai_errors import OpenAIError

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
S = RoutingSettings(max_messages=50, max_input_chars=10_000)


def _comp(prompt) -> bytes:  # noqa: ANN001
    return orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 1})


@pytest.mark.parametrize("prompt", [
    [7] * 10_001,  # one prompt of token ids, one over max_input_chars
    [[1, 2, 3, 4]] * 2_501,  # 2,501 lists (under max_messages' 50? no: refused for the count first)
    [[5] * 400] * 26,  # 26 lists, 10,400 ids
])
def test_token_ids_are_counted_before_the_parse_with_its_own_words(prompt) -> None:
    body = _comp(prompt)
    with pytest.raises(OpenAIError) as pre:
        precheck_lists(COMP, {}, body, S)
    with pytest.raises(OpenAIError) as full:
        parse_request("POST", COMP, {}, body, S)
    assert (pre.value.status, pre.value.param, pre.value.message) == \
        (full.value.status, full.value.param, full.value.message)


def test_token_ids_within_the_budgets_pass_and_are_not_skimmed_item_by_item() -> None:
    precheck_lists(COMP, {}, _comp([7] * 10_000), S)
    precheck_lists(COMP, {}, _comp([[1, 2]] * 50), S)
    # The 1.9M ids (5.7 MB): counted by their commas, not skimmed as 1.9M raw items (~285 ms).
    big = _comp([random.randrange(100) for _ in range(1_900_000)])
    t0 = time.perf_counter()
    precheck_lists(COMP, {}, big, RoutingSettings())
    assert time.perf_counter() - t0 < 0.15  # ~35 ms here; main skimmed every item (~83-285 ms)


def test_a_body_of_many_values_without_braces_is_parsed_off_the_loop() -> None:
    off = ParseOffload(RoutingSettings())  # text mode: bodies up to 1 MiB stay on the loop unless costly
    lists = _comp([[random.randrange(100) for _ in range(45)] for _ in range(4096)])  # the 0.75 MB
    assert lists.count(b"{") == 1 and len(lists) < 1 << 20
    assert off.heavy(COMP, lists)  # main parsed it on the loop (25-38 ms each)
    assert off.heavy(COMP, _comp([3] * 300_000))  # a flat list: ~50-90 ms on the loop
    prose = orjson.dumps({"model": "m", "messages": [
        {"role": "user", "content": "Well, the text goes on as prose does with a comma now and then. " * 15_000}]})
    assert len(prose) < 1 << 20 and not off.heavy(CHAT, prose)  # 15k commas in 0.96 MB: cheap to parse, stays
    assert not off.heavy(COMP, _comp([3] * 16_000))  # under 64 KiB: a few ms whatever its shape


class _Result:
    def __init__(self) -> None:
        self.key = 0


def _fake_parse(method, path, headers, body, adapters, submitted_s):  # noqa: ANN001, ANN202
    """A worker's parse: a second per MB (the issue's bodies on a busy worker), nothing parsed."""
    time.sleep(len(body) / 1e6)
    return ("ok", _Result())


def _offload(monkeypatch, **kw) -> ParseOffload:  # noqa: ANN001, ANN003
    monkeypatch.setattr(parse_offload, "_parse_in_worker", _fake_parse)
    off = ParseOffload(RoutingSettings(parse_workers=1, **kw))
    pool = concurrent.futures.ThreadPoolExecutor(1)
    monkeypatch.setattr(off, "_executor", lambda: pool)
    return off


def test_a_client_flooding_the_worker_delays_another_by_one_parse_not_its_backlog(monkeypatch) -> None:
    async def run() -> tuple[float, list]:
        off = _offload(monkeypatch)
        attack = [asyncio.ensure_future(off.parse("POST", COMP, {}, b"a" * 300_000, None, client="address:6.6.6.6"))
                  for _ in range(6)]  # 6 x 0.3 s queued
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        victim = await off.parse("POST", COMP, {}, b"v" * 10_000, None, client="address:10.0.0.1")
        waited = time.monotonic() - t0
        assert isinstance(victim, _Result)
        return waited, await asyncio.gather(*attack, return_exceptions=True)

    waited, attack = asyncio.run(run())
    # FIFO (main): the victim waited for all 6 attacker parses (1.8 s; past main's MAX_WAIT_S, 0.4 s: a 503).
    # Fair: for the one running (0.3 s) and its own (0.01 s).
    assert waited < 0.6, waited
    assert all(isinstance(r, _Result) for r in attack)  # the attacker's own are served too, later


def test_a_full_queue_gives_up_the_flooding_clients_newest_body_not_the_newcomer(monkeypatch) -> None:
    async def run() -> tuple[list, object]:
        off = _offload(monkeypatch, max_parse_queue=4)
        attack = [asyncio.ensure_future(off.parse("POST", COMP, {}, b"a" * 100_000, None, client="attacker"))
                  for _ in range(4)]
        await asyncio.sleep(0.02)
        assert off.in_queue == 4
        victim = await off.parse("POST", COMP, {}, b"v" * 1_000, None, client="victim")  # main: 503 at once
        return await asyncio.gather(*attack, return_exceptions=True), victim

    attack, victim = asyncio.run(run())
    assert isinstance(victim, _Result)
    refused = [r for r in attack if isinstance(r, OpenAIError)]
    assert len(refused) == 1 and refused[0].status == 503 and refused[0].retry_after_s == 1
    assert attack[-1] is refused[0]  # its newest


def test_a_body_that_waited_too_long_is_refused_unparsed(monkeypatch) -> None:
    monkeypatch.setattr(parse_offload, "MAX_WAIT_S", 0.1)

    async def run() -> list:
        off = _offload(monkeypatch)
        first = asyncio.ensure_future(off.parse("POST", COMP, {}, b"a" * 300_000, None, client="a"))
        await asyncio.sleep(0.01)
        late = asyncio.ensure_future(off.parse("POST", COMP, {}, b"a" * 1_000, None, client="a"))
        out = await asyncio.gather(first, late, return_exceptions=True)
        assert off.in_queue == 0 and off.num_refused == 1 and not off._flows  # noqa: SLF001 - nothing left
        return out

    first, late = asyncio.run(run())
    assert isinstance(first, _Result) and isinstance(late, OpenAIError) and late.status == 503


def test_a_waiting_body_whose_client_left_leaves_the_queue(monkeypatch) -> None:
    async def run() -> None:
        off = _offload(monkeypatch)
        first = asyncio.ensure_future(off.parse("POST", COMP, {}, b"a" * 200_000, None, client="a"))
        gone = asyncio.ensure_future(off.parse("POST", COMP, {}, b"b" * 1_000, None, client="b"))
        await asyncio.sleep(0.02)
        gone.cancel()
        await asyncio.sleep(0)
        assert off.in_queue == 1
        assert isinstance(await first, _Result) and off.in_queue == 0

    asyncio.run(run())


def test_the_result_is_a_request_key_of_this_process(monkeypatch) -> None:
    def parse_ok(method, path, headers, body, adapters, submitted_s):  # noqa: ANN001, ANN202
        return ("ok", parse_request(method, path, headers, body, RoutingSettings()))

    async def run() -> InferenceRequest:
        off = _offload(monkeypatch)
        monkeypatch.setattr(parse_offload, "_parse_in_worker", parse_ok)
        return await off.parse("POST", COMP, {}, _comp("hello"), None, client="x")

    assert asyncio.run(run()).kind == "completion"
