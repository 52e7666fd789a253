"""The facts path's Lua-free parts: decoding Envoy's facts records (`facts_of`) and correlating them with the
tracker's picks (`FactsReceiver`): matched, unmatched, missing; the router calls the observing stream makes."""

from __future__ import annotations

import asyncio

import grpc
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers.facts_records import CHAT_USAGE, export, record
from helpers.picks import make_pick
from prefixroute.extproc.envoy_config.facts import RESPONSE_FACTS_LUA
from prefixroute.extproc.envoy_facts import (MAX_EARLY_REPORT_BYTES, EarlyReport, FactsCollector, FactsReceiver,
                                             add_to_server, decode_early_report, decode_first_token, facts_of)
from prefixroute.extproc.facts_fields import (FACTS_ATTRIBUTES, FIRST_TOKEN_METHOD, OBSERVED_FACTS, RESPONSE_ID_METHOD,
                                             TRACEPARENT_KEY)
from prefixroute.extproc.headers import OBSERVED_METADATA
from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.extproc.tracking import RequestTracker
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.tracecontext import parse_traceparent
from prefixroute.types import Decision

ADDR = {"10.0.0.1:80": "a:80", "10.0.0.2:80": "b:80"}


def pick(kind: str = "chat", stream: bool = True):  # noqa: ANN201
    path = "/v1/responses" if kind == "responses" else "/v1/chat/completions"
    return make_pick(("a:80", "b:80"), Decision(endpoints=("a:80", "b:80"), reason="affinity", policy="prefix"),
                     InferenceRequest(kind=kind, path=path, model="m", stream=stream))


class Router:
    """The router calls the tracker and receiver make (PoolRouter's names), recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def first_token(self, p, ttft_s: float) -> None:  # noqa: ANN001
        self.calls.append(("first_token", ttft_s))

    def usage(self, p, prompt: int | None, cached: int | None) -> None:  # noqa: ANN001
        self.calls.append(("usage", prompt, cached))

    def learn_response(self, p, rid: str, served: str | None) -> None:  # noqa: ANN001
        self.calls.append(("learn_response", rid, served))
        p.response_id = rid  # as PoolRouter's does (Lifecycle.response_id)

    def served(self, p, served: str | None, status: int | None) -> None:  # noqa: ANN001
        self.calls.append(("served", served, status))


@pytest.fixture
def rig() -> tuple[RequestTracker, FactsReceiver, Router, list[RequestRecord]]:
    out: list[RequestRecord] = []
    router = Router()
    t = RequestTracker(lambda d, us: None, out.append, ADDR.get, obs_grace_s=0.05, on_first_token=router.first_token,
                       on_usage=router.usage, on_response_id=router.learn_response, propagate=False)
    return t, FactsReceiver(t, router.served), router, out


def begin(t: RequestTracker, p=None):  # noqa: ANN001, ANN202
    st, tp = t.begin({":path": "/v1/chat/completions"}, lambda: [(OBSERVED_METADATA, OBSERVED_FACTS)])
    t.decided(st, p or pick())
    return st, tp


def test_the_attribute_names_are_the_receivers() -> None:
    # One place for the names: the Envoy side's attributes are what `facts_of` reads.
    assert {k for k in FACTS_ATTRIBUTES} == {"prefixroute.facts", "tp", "status", "upstream", "ctype", "ttft_us",
                                             "duration_us", "start", "first_token_us", "usage", "response_id",
                                             "routing_us", "flags", "complete"}


def test_facts_of_decodes_envoys_record() -> None:
    tp = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    f = facts_of(record(tp))
    assert f is not None and f.span_id == "cd" * 8
    assert (f.status, f.upstream, f.streamed, f.ttft_ms, f.latency_ms) == (200, "10.0.0.1:80", True, 12.5, 80.0)
    assert (f.usage.prompt_tokens, f.usage.completion_tokens, f.usage.cached_tokens) == (100, 7, 64)
    assert f.first_token_ms is None and f.response_id is None
    # A Responses stream: its stamped first token event, from the start; its usage names.
    g = facts_of(record(tp, first_token_us="1700000000030000", response_id="resp_1",
                        usage='"usage":{"input_tokens":50,"output_tokens":3,"input_tokens_details":{"cached_tokens":32}}'))
    assert g.first_token_ms == 30.0 and g.response_id == "resp_1" and g.usage.cached_tokens == 32
    # A stamp outside the request is ignored; "-" figures are absent; other records and bad keys are not facts.
    assert facts_of(record(tp, first_token_us="1600000000000000")).first_token_ms is None
    h = facts_of(record(tp, ttft_us="-", duration_us="-", usage="-", status="0", upstream="-"))
    assert (h.ttft_ms, h.latency_ms, h.usage, h.status, h.upstream) == (None, None, None, 0, None)
    assert facts_of(record(tp, **{"prefixroute.facts": "0"})) is None
    assert facts_of(record("-")) is None and facts_of(record("garbage")) is None
    assert facts_of(record(tp, usage='"usage":{"prompt_tokens":1')).usage is None  # cut off: unknown, no error


async def test_a_record_completes_its_pick_with_the_observing_streams_calls(rig) -> None:
    t, rx, router, out = rig
    st, tp = begin(t)
    t.routing_closed(st)
    assert out == []  # waits for the facts
    rx.export(export(record(tp)))
    assert router.calls == [("served", "10.0.0.1:80", 200), ("first_token", 0.0125), ("usage", 100, 64)]
    assert len(out) == 1 and t.pending == {}
    rec = out[0]
    assert (rec.status, rec.endpoint, rec.ttft_ms, rec.latency_ms, rec.error) == (200, "a:80", 12.5, 80.0, None)
    assert (rec.prompt_tokens, rec.cached_tokens) == (100, 64)
    assert rx.counts() == {"matched": 1, "unmatched": 0, "missing": 0}
    await asyncio.sleep(0.1)
    assert len(out) == 1  # no second emission from the timer


def test_a_record_before_the_routing_stream_closes_waits_for_it(rig) -> None:
    t, rx, _, out = rig
    st, tp = begin(t)
    assert rx.apply(facts_of(record(tp)))
    assert out == []
    t.routing_closed(st)
    assert len(out) == 1 and out[0].endpoint == "a:80"


async def test_a_failover_is_reported_from_the_record(rig) -> None:
    t, rx, router, out = rig
    st, tp = begin(t)
    t.routing_closed(st)
    rx.export(export(record(tp, upstream="10.0.0.2:80", ctype="application/json", usage="-")))
    assert router.calls[0] == ("served", "10.0.0.2:80", 200)
    assert ("first_token", 0.0125) not in router.calls  # a JSON body: no first token for the time model
    assert out[0].endpoint == "b:80" and out[0].reason == "failover"


async def test_a_responses_stream_learns_its_id_and_its_first_token_event(rig) -> None:
    t, rx, router, out = rig
    st, tp = begin(t, pick("responses"))
    t.routing_closed(st)
    rx.export(export(record(tp, first_token_us="1700000000030000", response_id="resp_9")))
    assert ("learn_response", "resp_9", "10.0.0.1:80") in router.calls
    assert ("first_token", 0.03) in router.calls and out[0].ttft_ms == 30.0
    # Without a stamp a Responses stream has no TTFT (its first bytes precede any token).
    st2, tp2 = begin(t, pick("responses"))
    t.routing_closed(st2)
    rx.export(export(record(tp2, response_id="resp_10")))
    assert out[1].ttft_ms is None and ("learn_response", "resp_10", "10.0.0.1:80") in router.calls


async def test_a_chat_response_id_is_not_learned(rig) -> None:
    t, rx, router, _ = rig
    st, tp = begin(t)
    t.routing_closed(st)
    rx.export(export(record(tp, response_id="resp_x")))
    assert not [c for c in router.calls if c[0] == "learn_response"]


def test_records_without_a_pending_pick_are_counted_unmatched(rig) -> None:
    t, rx, router, out = rig
    stranger = "00-" + "ab" * 16 + "-" + "ef" * 8 + "-01"
    st, tp = begin(t)
    rx.export(export(record(stranger), record(tp), record(tp)))  # unknown key, then a duplicate
    assert rx.counts() == {"matched": 1, "unmatched": 2, "missing": 0}
    assert [c for c in router.calls if c[0] == "served"] == [("served", "10.0.0.1:80", 200)]


async def test_a_pick_whose_facts_never_come_is_emitted_after_the_timeout_and_counted(rig) -> None:
    t, rx, router, out = rig
    st, tp = begin(t)
    t.routing_closed(st)
    await asyncio.sleep(0.1)
    assert len(out) == 1 and out[0].error == "response facts missing" and t.pending == {}
    assert rx.counts()["missing"] == 1 and router.calls == []
    rx.export(export(record(tp)))  # late: counted, not applied
    assert rx.counts() == {"matched": 0, "unmatched": 1, "missing": 1} and len(out) == 1
    samples = {s.labels["outcome"]: s.value for fam in FactsCollector(rx).collect() for s in fam.samples
               if fam.name == "prefixroute_response_facts"}
    assert samples == {"matched": 0, "unmatched": 1, "missing": 1}


async def test_picks_closed_at_different_times_each_wait_their_own_grace() -> None:
    """One sweeper serves every pick's grace: each is emitted obs_grace_s (0.4 s here) after its own close, in
    order; one whose record comes meanwhile is emitted once, with its facts. (Margins of 0.1 s each side.)"""
    out: list[RequestRecord] = []
    router = Router()
    t = RequestTracker(lambda d, us: None, out.append, ADDR.get, obs_grace_s=0.4, on_first_token=router.first_token,
                       on_usage=router.usage, on_response_id=router.learn_response, propagate=False)
    rx = FactsReceiver(t, router.served)
    first, _ = begin(t)
    t.routing_closed(first)
    await asyncio.sleep(0.2)
    second, tp2 = begin(t)
    third, _ = begin(t)
    t.routing_closed(second)
    t.routing_closed(third)
    rx.export(export(record(tp2)))  # the second one's facts came
    assert [r.span_id for r in out] == [second.key]
    await asyncio.sleep(0.3)  # 0.5 s: the first one's grace is over (0.4), not the third's (0.6)
    assert [r.span_id for r in out] == [second.key, first.key]
    await asyncio.sleep(0.2)
    assert [r.span_id for r in out] == [second.key, first.key, third.key]
    assert [r.error for r in out] == [None, "response facts missing", "response facts missing"]
    assert rx.counts() == {"matched": 1, "unmatched": 0, "missing": 2} and t.pending == {}


def test_a_request_envoy_answered_itself_is_recorded_by_the_routing_stream(rig) -> None:
    # The facts logger sends only picked routes' records: an undecided request must not wait for one.
    t, _, _, out = rig
    st, _ = t.begin({":path": "/v1/chat/completions"}, lambda: [(OBSERVED_METADATA, OBSERVED_FACTS)])
    t.routing_closed(st)
    assert len(out) == 1 and out[0].error == "request ended before the routing decision"


def test_the_traceparent_is_given_on_the_facts_path_with_traces_off(rig) -> None:
    t, *_ = rig
    st, tp = begin(t)
    assert parse_traceparent(tp).span_id == st.key
    assert st.facts and orjson.dumps(sorted(FACTS_ATTRIBUTES))  # the key travels in the record's "tp"


# The early first token report (envoy_facts.py module docstring).

def early_rig(early: bool = True) -> tuple[RequestTracker, FactsReceiver, Router, list[RequestRecord]]:
    out: list[RequestRecord] = []
    router = Router()
    t = RequestTracker(lambda d, us: None, out.append, ADDR.get, obs_grace_s=0.05, on_first_token=router.first_token,
                       on_usage=router.usage, on_response_id=router.learn_response, propagate=False)
    return t, FactsReceiver(t, router.served, early_first_token=early), router, out


def begin_early(t: RequestTracker, stream: bool = True):  # noqa: ANN202
    st, tp = t.begin({":path": "/v1/chat/completions"}, lambda: [(OBSERVED_METADATA, OBSERVED_FACTS)])
    t.decided(st, pick(stream=stream))
    return st, tp


def frame(message: bytes) -> bytes:
    """The Lua filter's gRPC frame, as it builds it (one flag byte, 4-byte big-endian length)."""
    return bytes([0, 0, 0, len(message) // 256, len(message) % 256]) + message


TP = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"


@pytest.mark.parametrize(("message", "expected"), [
    (TP, EarlyReport("cd" * 8)),
    (f"{TP}\nresp_123\n10.0.0.2:80", EarlyReport("cd" * 8, "resp_123", "10.0.0.2:80")),
    (f"{TP}\nresp_123\n", EarlyReport("cd" * 8, "resp_123", None)),  # Envoy had no served header
    (f"{TP}\nchatcmpl-1\n10.0.0.2:80", EarlyReport("cd" * 8, None, "10.0.0.2:80")),  # not a Responses id
    (f"{TP}\nresp_1\na\nb", EarlyReport("cd" * 8, None, "a\nb")),  # a fourth line: the id is not trusted
    ("garbage\nresp_1\na", None), ("", None),
    (f"{TP}\nresp_{'x' * 300}\na", None),  # over MAX_EARLY_REPORT_BYTES
])
def test_decode_early_report(message: str, expected: EarlyReport | None) -> None:
    assert decode_early_report(message.encode()) == expected


@given(st.binary(max_size=MAX_EARLY_REPORT_BYTES + 8))
def test_decode_early_report_never_raises_and_keys_only_a_traceparent(message: bytes) -> None:
    r = decode_early_report(message)
    if r is not None:
        assert parse_traceparent(message.split(b"\n", 1)[0].decode("ascii")).span_id == r.span_id
        assert r.response_id is None or r.response_id.startswith("resp")


def test_decode_first_token_takes_a_traceparent_only() -> None:
    tp = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    assert decode_first_token(tp.encode()) == "cd" * 8
    assert decode_first_token(b"") is None and decode_first_token(b"garbage") is None
    assert decode_first_token(b"\xff" * 10) is None and decode_first_token(tp.encode() * 3) is None


def test_the_lua_filter_frames_the_traceparent_it_kept_and_calls_the_routing_replica() -> None:
    # The request side keeps the routing filter's traceparent; the response side calls the replica's cluster
    # with a gRPC frame built by hand (LuaJIT has no string.pack); Envoy is not waited for (asynchronous).
    assert f'"{TRACEPARENT_KEY}", tp' in RESPONSE_FACTS_LUA and "function envoy_on_request(h)" in RESPONSE_FACTS_LUA
    assert f'report("{FIRST_TOKEN_METHOD}", found)' in RESPONSE_FACTS_LUA  # a Responses stream's, with its id
    assert f'report("{FIRST_TOKEN_METHOD}", nil)' in RESPONSE_FACTS_LUA  # a chat stream's
    assert f'reporter("{RESPONSE_ID_METHOD}", found)' in RESPONSE_FACTS_LUA  # a JSON Responses answer's id
    assert "string.char(0, 0, 0, math.floor(n / 256), n % 256) .. msg" in RESPONSE_FACTS_LUA
    assert ", true)" in RESPONSE_FACTS_LUA and '" replica (%d+)$"' in RESPONSE_FACTS_LUA
    # The id is searched before the first token event of the same chunk is looked for.
    assert RESPONSE_FACTS_LUA.index("local id = string.match") < RESPONSE_FACTS_LUA.index('".delta')


async def test_an_early_report_reports_the_first_token_once_and_the_record_does_not_repeat_it() -> None:
    t, rx, router, out = early_rig()
    st, tp = begin_early(t)
    span = decode_first_token(tp.encode())
    assert rx.first_token(span, now=st.t0 + 0.02)
    assert router.calls == [("first_token", pytest.approx(0.02))]
    assert not rx.first_token(span)  # a repeat
    t.routing_closed(st)
    rx.export(export(record(tp)))  # the record: Envoy's TTFT for the stored record, no second first token
    assert [c for c in router.calls if c[0] == "first_token"] == [("first_token", pytest.approx(0.02))]
    assert ("usage", 100, 64) in router.calls
    assert len(out) == 1 and out[0].ttft_ms == 12.5
    assert rx.first_token_counts == {"early": 1, "unmatched": 1, "ignored": 0}
    samples = {s.labels["outcome"]: s.value for fam in FactsCollector(rx).collect() for s in fam.samples
               if fam.name == "prefixroute_facts_first_token"}
    assert samples == {"early": 1, "unmatched": 1, "ignored": 0}


async def test_reports_that_match_no_streamed_pick_change_nothing() -> None:
    t, rx, router, out = early_rig()
    stranger = decode_first_token(("00-" + "ab" * 16 + "-" + "ef" * 8 + "-01").encode())
    assert not rx.first_token(stranger) and not rx.first_token(None)
    st, tp = begin_early(t, stream=False)  # a JSON body has no first token to report
    assert not rx.first_token(decode_first_token(tp.encode()))
    assert router.calls == [] and rx.first_token_counts["unmatched"] == 3
    t.routing_closed(st)
    rx.export(export(record(tp, ctype="application/json")))
    assert out[0].ttft_ms == 12.5


async def test_a_lost_early_report_leaves_the_first_token_to_the_record() -> None:
    t, rx, router, out = early_rig()
    st, tp = begin_early(t)
    t.routing_closed(st)
    rx.export(export(record(tp)))
    assert ("first_token", 0.0125) in router.calls and out[0].ttft_ms == 12.5
    assert not rx.first_token(decode_first_token(tp.encode()))  # after the record: too late, counted


async def test_with_early_reports_off_they_are_ignored() -> None:
    t, rx, router, out = early_rig(early=False)
    st, tp = begin_early(t)
    assert not rx.first_token(decode_first_token(tp.encode()))
    assert router.calls == [] and rx.first_token_counts == {"early": 0, "unmatched": 0, "ignored": 1}
    t.routing_closed(st)
    rx.export(export(record(tp)))
    assert ("first_token", 0.0125) in router.calls






class _Routed(Exception):
    pass


class _CapturingRouter:
    """`route`'s first_token_live, then stops the stream (what follows a pick is not under test here)."""

    def __init__(self) -> None:
        self.live: list[bool] = []

    def route(self, method, path, headers, body, **kw):  # noqa: ANN001, ANN003, ANN201
        self.live.append(kw["first_token_live"])
        raise _Routed


@pytest.mark.parametrize("early", [True, False])
def test_facts_path_picks_are_first_token_live_with_the_early_report(early: bool) -> None:
    from prefixroute.extproc.servicer import ExtProcServicer, RoutingStream
    from prefixroute.extproc.tracking import UNTRACKED

    t, *_ = early_rig()
    router = _CapturingRouter()
    servicer = ExtProcServicer(router, t, can_hold=True, facts_first_token_live=early)  # type: ignore[arg-type]
    for facts in (True, False):
        ex = RoutingStream(servicer, lambda: []).ex
        if facts:
            ex.st, _ = begin_early(t)
        assert ex.st.facts == facts and (facts or ex.st is UNTRACKED)
        with pytest.raises(_Routed):
            ex.decide("POST", "/v1/chat/completions", b"{}")
    # On the facts path a pick's first token is live only with the early report; off it, always.
    assert router.live == [early, True]


# Responses ids, early (envoy_facts.py module docstring): pinned before the record comes.

def begin_responses(t: RequestTracker, stream: bool = True):  # noqa: ANN202
    st_, tp = t.begin({":path": "/v1/responses"}, lambda: [(OBSERVED_METADATA, OBSERVED_FACTS)])
    t.decided(st_, pick("responses", stream=stream))
    return st_, tp


async def test_a_responses_streams_first_token_report_carries_its_id_learned_once() -> None:
    t, rx, router, out = early_rig()
    st_, tp = begin_responses(t)
    r = decode_early_report(f"{tp}\nresp_abc\n10.0.0.2:80".encode())
    assert rx.first_token(r.span_id, st_.t0 + 0.03, r.response_id, r.served)
    # Learned at once, at the address Envoy served it from (a failover's id is the fallback's).
    assert router.calls == [("learn_response", "resp_abc", "10.0.0.2:80"), ("first_token", pytest.approx(0.03))]
    t.routing_closed(st_)
    rx.export(export(record(tp, response_id="resp_abc", upstream="10.0.0.2:80", first_token_us="30000")))
    assert [c for c in router.calls if c[0] == "learn_response"] == [("learn_response", "resp_abc", "10.0.0.2:80")]
    assert rx.early_id_counts == {"learned": 1, "unmatched": 0} and out[0].ttft_ms == pytest.approx(30.0)
    samples = {s.labels["outcome"]: s.value for fam in FactsCollector(rx).collect() for s in fam.samples
               if fam.name == "prefixroute_facts_early_response_id"}
    assert samples == {"learned": 1, "unmatched": 0}


async def test_a_json_responses_answer_s_id_comes_alone_and_a_chat_pick_takes_none() -> None:
    t, rx, router, out = early_rig()
    st_, tp = begin_responses(t, stream=False)
    r = decode_early_report(f"{tp}\nresp_json\n".encode())
    assert rx.response_id(r.span_id, r.response_id, r.served)
    assert router.calls == [("learn_response", "resp_json", None)]  # no first token: a JSON answer has none
    assert not rx.response_id(r.span_id, "resp_other")  # one id per pick
    chat, ctp = begin_early(t, stream=False)
    assert not rx.response_id(decode_early_report(ctp.encode()).span_id, "resp_x")  # not a Responses pick
    assert not rx.response_id("ef" * 8, "resp_y") and not rx.response_id(None, "resp_z")
    assert rx.early_id_counts == {"learned": 1, "unmatched": 4}
    t.routing_closed(st_)
    rx.export(export(record(tp, response_id="resp_json", ctype="application/json")))
    assert [c[1] for c in router.calls if c[0] == "learn_response"] == ["resp_json"]  # not again


async def test_without_an_early_id_the_record_teaches_it() -> None:
    t, rx, router, out = early_rig()
    st_, tp = begin_responses(t)
    assert rx.first_token(decode_first_token(tp.encode()))  # an old filter's report: the traceparent only
    t.routing_closed(st_)
    rx.export(export(record(tp, response_id="resp_late", first_token_us="20000")))
    assert ("learn_response", "resp_late", "10.0.0.1:80") in router.calls and rx.early_id_counts["learned"] == 0


