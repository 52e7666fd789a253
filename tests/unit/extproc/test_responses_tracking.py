"""The observing stream on Responses API responses: the response id is learned (stream and body), TTFT is the
first token event (not response.created), and usage of Responses (input_tokens, cached tokens) is read,
also from a response.completed event longer than the kept tail."""

from __future__ import annotations

import orjson
import pytest

from prefixroute.extproc import wire
from prefixroute.extproc.headers import SERVED_HEADER
from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.types import Decision
from prefixroute.extproc.tracking import RequestTracker
from prefixroute.telemetry.usage import StreamUsageTail, usage_from_body
from helpers.picks import make_pick
from prefixroute.extproc.lifecycle import Pick as Pick_

ADDR = {"10.0.0.1:80": "a:80", "10.0.0.2:80": "b:80"}
RID = "resp_0123456789abcdef0123456789abcdef"
USAGE = {"input_tokens": 900, "input_tokens_details": {"cached_tokens": 640}, "output_tokens": 8,
         "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 908}


def Pick() -> Pick_:  # noqa: N802 - reads as the record it makes
    """A real router pick (`lifecycle.Pick`) of a streamed Responses API request routed to a:80."""
    return make_pick(("a:80",), Decision(endpoints=("a:80",), reason="affinity", policy="prefix"),
                     InferenceRequest(kind="responses", path="/v1/responses", model="m", stream=True), decision_us=1.0)


def _hv(pairs: dict[str, str]) -> list:
    return [wire.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]


def _event(kind: str, **data) -> bytes:
    return f"event: {kind}\n".encode() + b"data: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def _tracker(calls: list) -> RequestTracker:
    return RequestTracker(lambda d, us: None, lambda rec: None, ADDR.get, obs_grace_s=0.05,
                          on_first_token=lambda pick, ttft: calls.append(("first",)),
                          on_usage=lambda pick, p, c: calls.append(("usage", p, c)),
                          on_response_id=lambda pick, rid, served: calls.append(("id", rid, served)))


def _start(t: RequestTracker):  # noqa: ANN202
    st, tp = t.begin({":path": "/v1/responses"})
    t.decided(st, Pick())
    return st, t.attach(_hv({"traceparent": tp}))


async def test_stream_learns_the_id_at_created_and_ttft_at_the_first_delta() -> None:
    calls: list = []
    t = _tracker(calls)
    st, obs = _start(t)
    t.obs_response_headers(obs, _hv({":status": "200", "content-type": "text/event-stream",
                                     SERVED_HEADER: "10.0.0.1:80"}), False, SERVED_HEADER)
    created = {"id": RID, "object": "response", "instructions": "say .delta\"\nevent: x.delta", "usage": None}
    t.obs_body(obs, _event("response.created", sequence_number=0, response=created), False)
    t.obs_body(obs, _event("response.in_progress", sequence_number=1, response=created), False)
    t.obs_body(obs, _event("response.output_item.added", sequence_number=2,
                           item={"id": "msg_1", "type": "message"}), False)
    assert calls == [("id", RID, "10.0.0.1:80")]  # no first token before a token event
    assert obs.rec.ttft_ms is None
    t.obs_body(obs, _event("response.output_text.delta", sequence_number=3, delta="Hi"), False)
    assert calls[-1] == ("first",) and obs.rec.ttft_ms is not None
    t.obs_body(obs, _event("response.completed", sequence_number=9, response={**created, "usage": USAGE}), True)
    assert calls[-1] == ("usage", 900, 640) and len(calls) == 3
    assert (obs.rec.prompt_tokens, obs.rec.cached_tokens) == (900, 640)
    t.routing_closed(st)


async def test_function_call_delta_is_a_first_token_and_split_id_is_found() -> None:
    calls: list = []
    t = _tracker(calls)
    st, obs = _start(t)
    t.obs_response_headers(obs, _hv({":status": "200", "content-type": "text/event-stream"}), False, SERVED_HEADER)
    first = _event("response.created", sequence_number=0, response={"id": RID})
    cut = first.index(b"resp_") + 4
    t.obs_body(obs, first[:cut], False)
    t.obs_body(obs, first[cut:], False)
    t.obs_body(obs, _event("response.function_call_arguments.delta", sequence_number=3, delta="{"), False)
    assert calls[0] == ("id", RID, None) and calls[1] == ("first",)
    t.obs_body(obs, b"", True)
    t.routing_closed(st)


@pytest.mark.parametrize("status", ["200", "404"])
async def test_non_stream_body_id_is_learned_only_from_a_200(status: str) -> None:
    calls: list = []
    t = _tracker(calls)
    st, obs = _start(t)
    t.obs_response_headers(obs, _hv({":status": status, "content-type": "application/json"}), False, SERVED_HEADER)
    t.obs_body(obs, orjson.dumps({"id": RID, "object": "response", "usage": USAGE}), True)
    t.routing_closed(st)
    assert [c for c in calls if c[0] == "id"] == ([("id", RID, None)] if status == "200" else [])
    assert obs.rec.prompt_tokens == 900 and obs.rec.cached_tokens == 640


def test_usage_from_a_completed_event_longer_than_the_tail() -> None:
    tail = StreamUsageTail(max_bytes=1024)
    big = {"id": RID, "instructions": "x" * 5000, "output": [{"type": "message", "content": [
        {"type": "output_text", "text": "y" * 5000}]}], "usage": USAGE, "user": None}
    tail.feed(_event("response.completed", sequence_number=9, response=big))
    u = tail.usage()
    assert u is not None and (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (900, 8, 640)


def test_usage_from_a_responses_body_and_chat_body_unchanged() -> None:
    u = usage_from_body(orjson.dumps({"id": RID, "usage": USAGE}))
    assert (u.prompt_tokens, u.cached_tokens) == (900, 640)
    c = usage_from_body(orjson.dumps({"usage": {"prompt_tokens": 5, "completion_tokens": 1}}))
    assert (c.prompt_tokens, c.completion_tokens, c.cached_tokens) == (5, 1, None)


async def test_non_stream_usage_reaches_the_router_and_a_follow_ups_completed_prediction_is_recorded() -> None:
    # A non-streamed Responses response reports its usage too (its prompt size is the next follow-up's known
    # prefix); and when the router completes a pinned follow-up's prediction at usage time, the record shows it.
    calls: list = []

    def on_usage(pick, p, c) -> None:  # noqa: ANN001 - what PoolRouter.usage does for a follow-up
        calls.append(("usage", p, c))
        pick.request.known_prefix_tokens = 720

    t = RequestTracker(lambda d, us: None, lambda rec: None, ADDR.get, obs_grace_s=0.05, on_usage=on_usage)
    st, obs = _start(t)
    t.obs_response_headers(obs, _hv({":status": "200", "content-type": "application/json"}), False, SERVED_HEADER)
    t.obs_body(obs, orjson.dumps({"id": RID, "object": "response", "usage": USAGE}), True)
    t.routing_closed(st)
    assert calls == [("usage", 900, 640)]
    assert obs.rec.predicted_hit_ratio == pytest.approx(720 / 900)
