"""What flow control reads of the router (extproc/flow/view.py, issue 24), on a real TimeModel."""

from __future__ import annotations

import pytest

from prefixroute.extproc.flow.saturation import SaturationDetector
from prefixroute.extproc.flow.view import cheapest_prefill_s, endpoint_loads, first_room_ratio
from prefixroute.extproc.routing.timemodel import TimeModel
from prefixroute.types import EndpointId, EndpointState

A, B = EndpointId("a:1"), EndpointId("b:1")


def _state(ep, waiting=0, kv=0.1, at=0.0, healthy=True) -> EndpointState:
    return EndpointState(ep, healthy=healthy, num_requests_waiting=waiting, kv_cache_usage_ratio=kv,
                         scraped_at_s=at)


def test_queued_seconds_come_from_the_time_model_and_stay_until_the_first_token() -> None:
    model = TimeModel(10_000.0, 0.0, decode_cost_tokens=0.0)
    model.add_pending("r1", A, 5_000.0, now_s=0.0)
    loads = endpoint_loads([_state(A), _state(B)], {A: 1}, model, 0.0, stale_after_s=2.0)
    assert [round(x.queued_s, 3) for x in loads] == [0.5, 0.0]
    # Default: the prefill sent there counts until its first token is reported, however late the server is.
    later = endpoint_loads([_state(A)], {A: 1}, model, 30.0, stale_after_s=2.0)
    assert later[0].queued_s == pytest.approx(0.5)
    assert first_room_ratio([_state(A)], {A: 1}, model, 30.0, SaturationDetector(0.25), stale_after_s=2.0) is None
    # saturation_drain: the old estimate, the backlog drains at the predicted 10k tokens/s.
    drained = endpoint_loads([_state(A)], {A: 1}, model, 0.3, stale_after_s=2.0, drain=True)
    assert drained[0].queued_s == pytest.approx(0.2)
    assert first_room_ratio([_state(A)], {A: 1}, model, 30.0, SaturationDetector(0.25), stale_after_s=2.0,
                            drain=True) == 0.0
    model.remove_pending("r1")  # its first token: the queue is empty
    assert endpoint_loads([_state(A)], {A: 1}, model, 30.0, stale_after_s=2.0)[0].queued_s == 0.0
    det = SaturationDetector(max_queued_s=0.25)
    assert det.detect(loads).saturated is False  # b has room
    assert det.detect(loads[:1]).saturated is True


def test_stale_scrapes_are_left_out_and_in_flight_is_carried() -> None:
    loads = endpoint_loads([_state(A, waiting=9, kv=0.95, at=0.0)], {A: 4}, None, 5.0, stale_after_s=2.0)
    assert (loads[0].num_waiting, loads[0].kv_usage_ratio, loads[0].num_in_flight) == (None, None, 4)
    fresh = endpoint_loads([_state(A, waiting=9, kv=0.95, at=4.5)], {A: 4}, None, 5.0, stale_after_s=2.0)
    assert (fresh[0].num_waiting, fresh[0].kv_usage_ratio) == (9, 0.95)
    assert SaturationDetector().detect(fresh).saturated


def test_cheapest_prefill_prefers_the_best_hit() -> None:
    model = TimeModel(10_000.0, 0.0)
    assert cheapest_prefill_s(model, 8_000.0, 16.0, [A, B], {}) == pytest.approx(0.8)
    assert cheapest_prefill_s(model, 8_000.0, 16.0, [A, B], {B: 480}) == pytest.approx(0.032)
    assert cheapest_prefill_s(model, 8_000.0, 16.0, [], {}) == pytest.approx(0.8)


def test_first_room_ratio_agrees_with_the_detector_and_stops_early() -> None:
    from prefixroute.extproc.flow.view import first_room_ratio

    model = TimeModel(10_000.0, 0.0, decode_cost_tokens=0.0)
    det = SaturationDetector(max_queued_s=0.25)
    model.add_pending("r1", A, 5_000.0, now_s=0.0)
    model.add_pending("r2", B, 5_000.0, now_s=0.0)
    states = [_state(A), _state(B)]
    busy = {A: 1, B: 1}
    assert first_room_ratio(states, busy, model, 0.0, det, stale_after_s=2.0) is None
    assert det.detect(endpoint_loads(states, busy, model, 0.0, stale_after_s=2.0)).saturated
    assert first_room_ratio(states, busy, model, 0.4, det, stale_after_s=2.0) is None  # no first token yet
    assert first_room_ratio(states, busy, model, 0.4, det, stale_after_s=2.0,
                            drain=True) == pytest.approx(0.4)  # saturation_drain: drained at the predicted rate
    for drain in (False, True):
        assert first_room_ratio(states, busy, model, 0.4, det, stale_after_s=2.0, drain=drain) is None or \
            not det.detect(endpoint_loads(states, busy, model, 0.4, stale_after_s=2.0, drain=drain)).saturated
    states.append(_state(EndpointId("c:1")))
    assert first_room_ratio(states, busy, model, 0.0, det, stale_after_s=2.0) == 0.0  # idle c has room
    assert first_room_ratio([_state(A, healthy=False)], {}, model, 0.0, det, stale_after_s=2.0) is None
