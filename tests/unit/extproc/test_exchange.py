"""The per-request `Exchange` (extproc/exchange.py) against a scripted router: each outcome, each kind of wait and
how it resumes, and that a refusal is recorded once. No sockets, no transport."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from helpers.picks import make_pick
from prefixroute.extproc.exchange import WAIT_HOLD, WAIT_LOOKUP, WAIT_PARSE, Exchange, Refused, Routed, route_kw
from prefixroute.extproc.flow.control import NeedsHold
from prefixroute.extproc.response_directory import NeedsLookup
from prefixroute.extproc.tracking import NullTracker
from prefixroute.openai_errors import OpenAIError

EPS = ("10.0.0.1:8000", "10.0.0.2:8000")


class ScriptedRouter:
    """`route` raises or returns what `script` says, one entry per call; records what it was asked."""

    def __init__(self, *script: Any) -> None:
        self.script = list(script)
        self.calls: list[tuple[Any, dict]] = []
        self.resolved: list[str] = []
        self.parsed: list[bytes] = []
        self.held: list[Any] = []
        self.hold_raises: OpenAIError | None = None
        self.resolve_raises: OpenAIError | None = None

    def route(self, method: str, path: str, headers: Any, body: Any, **kw: Any) -> Any:
        self.calls.append((body, kw))
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    async def resolve(self, response_id: str, headers: Any) -> None:
        self.resolved.append(response_id)
        if self.resolve_raises is not None:
            raise self.resolve_raises

    async def parse_off_loop(self, method: str, path: str, headers: Any, body: bytes) -> Any:
        self.parsed.append(body)
        return ("parsed", body)

    async def hold(self, request: Any, headers: Any) -> Any:
        self.held.append(request)
        if self.hold_raises is not None:
            raise self.hold_raises
        return "ticket"


class CountingTracker(NullTracker):
    def __init__(self) -> None:
        self.refusals: list[tuple[int, str, tuple]] = []
        self.decisions: list[Any] = []

    def refused(self, st: Any, status: int, message: str, *rest: Any) -> None:  # type: ignore[override]
        self.refusals.append((status, message, rest))

    def decided(self, st: Any, pick: Any) -> None:
        self.decisions.append(pick)


def exchange(router: ScriptedRouter, *, can_hold: bool = False) -> tuple[Exchange, CountingTracker]:
    tracker = CountingTracker()
    ex = Exchange(router, tracker, can_hold=can_hold)  # type: ignore[arg-type]
    ex.begin({":path": "/v1/chat/completions"}, tuple)
    return ex, tracker


def test_a_routed_decision_is_picked_and_tracked_once() -> None:
    pick = make_pick(EPS)
    ex, tracker = exchange(ScriptedRouter(pick))
    out = ex.decide("POST", "/v1/chat/completions", b"{}")
    assert isinstance(out, Routed) and out.pick is pick and ex.pick is pick
    assert tracker.decisions == [pick] and tracker.refusals == []


def test_a_refusal_is_an_outcome_recorded_once_and_holds_no_pick() -> None:
    ex, tracker = exchange(ScriptedRouter(OpenAIError(400, "bad", param="messages")))
    out = ex.decide("POST", "/v1/chat/completions", b"{")
    assert isinstance(out, Refused) and out.error.status == 400 and ex.pick is None
    assert [r[0] for r in tracker.refusals] == [400]


def test_a_lookup_waits_then_routes() -> None:
    pick = make_pick(EPS)
    router = ScriptedRouter(NeedsLookup("resp_1"), pick)
    ex, _ = exchange(router)
    assert ex.decide("POST", "/v1/responses", b"{}") is WAIT_LOOKUP
    out = asyncio.run(ex.resume(WAIT_LOOKUP))
    assert isinstance(out, Routed) and router.resolved == ["resp_1"]


def test_a_lookup_found_then_forgotten_is_refused_without_a_second_round() -> None:
    router = ScriptedRouter(NeedsLookup("resp_1"), NeedsLookup("resp_1"))
    ex, tracker = exchange(router)
    out = asyncio.run(ex.resume(ex.decide("POST", "/v1/responses", b"{}")))  # type: ignore[arg-type]
    assert isinstance(out, Refused) and out.error.status == 503 and router.resolved == ["resp_1"]
    assert len(tracker.refusals) == 1


def test_a_lookup_that_fails_is_refused() -> None:
    router = ScriptedRouter(NeedsLookup("resp_1"))
    router.resolve_raises = OpenAIError(404, "no such response")
    ex, tracker = exchange(router)
    out = asyncio.run(ex.resume(ex.decide("POST", "/v1/responses", b"{}")))  # type: ignore[arg-type]
    assert isinstance(out, Refused) and out.error.status == 404 and [r[0] for r in tracker.refusals] == [404]


def test_a_parse_then_a_lookup_are_two_waits_and_the_parsed_request_is_routed() -> None:
    pick = make_pick(EPS)
    router = ScriptedRouter(NeedsLookup(None), NeedsLookup("resp_1"), pick)  # type: ignore[arg-type]
    ex, _ = exchange(router)
    assert ex.decide("POST", "/v1/responses", b"big") is WAIT_PARSE
    assert asyncio.run(ex.resume(WAIT_PARSE)) is WAIT_LOOKUP  # the transport may answer its gateway in between
    out = asyncio.run(ex.resume(WAIT_LOOKUP))
    assert isinstance(out, Routed) and router.parsed == [b"big"]
    assert [body for body, _ in router.calls] == [b"big", ("parsed", b"big"), ("parsed", b"big")]


@pytest.mark.parametrize("shed", [False, True])
def test_a_hold_waits_then_routes_with_its_ticket_or_is_shed(shed: bool) -> None:
    pick = make_pick(EPS)
    router = ScriptedRouter(NeedsHold("request"), pick)
    if shed:
        router.hold_raises = OpenAIError(429, "shed", retry_after_s=1)
    ex, tracker = exchange(router, can_hold=True)
    assert ex.decide("POST", "/v1/chat/completions", b"{}") is WAIT_HOLD
    out = asyncio.run(ex.resume(WAIT_HOLD))
    assert router.held == ["request"]
    if shed:
        assert isinstance(out, Refused) and out.error.status == 429 and len(tracker.refusals) == 1
    else:
        assert isinstance(out, Routed) and router.calls[-1][1]["ticket"] == "ticket"
        assert router.calls[-1][1]["can_hold"] is False  # a released request is not held again


def test_an_abandoned_wait_cannot_be_resumed() -> None:
    ex, _ = exchange(ScriptedRouter(NeedsHold("request")), can_hold=True)
    assert ex.decide("POST", "/v1/chat/completions", b"{}") is WAIT_HOLD
    ex.abandon()
    with pytest.raises(AssertionError):
        asyncio.run(ex.resume(WAIT_HOLD))


def test_the_subset_hint_reaches_the_router_only_when_given() -> None:
    router = ScriptedRouter(make_pick(EPS), make_pick(EPS))
    ex, _ = exchange(router)
    ex.decide("POST", "/v1/chat/completions", b"{}", **route_kw(None))
    ex.decide("POST", "/v1/chat/completions", b"{}", **route_kw(["10.0.0.1"]))
    assert [kw for _, kw in router.calls] == [{}, {"subset": ["10.0.0.1"]}]
