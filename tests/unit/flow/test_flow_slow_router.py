"""Shedding at arrival only where the prediction is right, and never for the router's own lag
(extproc/flow/control.py `WaitPredictions`, `DrainRate` with the pool's `LoopLag`; view.py `is_fresh`).

The scenarios drive `FlowControl` on a virtual clock as the gate does: arrivals are offered, and the engines
finish one request every ``1 / drain_per_s`` seconds, each finish releasing the next held request. A *starved
router*: its event loop stalls 3 s at a time (as tests/integration/reliability/test_starved_router.py stalls the
real process); what comes due during a stall (finishes, arrivals) is handled when the loop runs again, and the
stall is recorded in a `LoopLag` as its sampler records it. The fleet drains as fast as ever meanwhile.
"""

from __future__ import annotations

import heapq

import pytest

from prefixroute.extproc.endpoints.loop_lag import LoopLag
from prefixroute.extproc.flow.control import (
    MIN_PREDICTIONS, DrainRate, FlowControl, ReleaseReason, Verdict, WaitPredictions,
)
from prefixroute.extproc.flow.queue import QueuedRequest
from prefixroute.extproc.flow.saturation import Saturation
from prefixroute.extproc.flow.settings import FlowSettings
from prefixroute.extproc.flow.view import endpoint_loads, is_fresh
from prefixroute.types import EndpointId, EndpointState

SATURATED = Saturation(signal=2.0, num_healthy=2, num_with_room=0)
ROOM = Saturation(signal=0.5, num_healthy=2, num_with_room=1)


def drive(control: FlowControl, *, arrival_per_s: float, drain_per_s: float, duration_s: float,
          deadline_s: float, stalls: list[tuple[float, float]] = (), lag: LoopLag | None = None,
          num_slots: int = 2) -> dict:
    """Offer arrivals at a steady rate; the engines run `num_slots` requests at a time, each for
    ``num_slots / drain_per_s`` seconds; a finish releases the next held request (module docstring). Returns the
    verdicts at arrival, with the deadline sheds of held requests under "shed"."""
    events: list[tuple[float, int, str]] = []
    for i in range(int(duration_s * arrival_per_s)):
        heapq.heappush(events, (i / arrival_per_s, 1, "arrive"))
    service_s = num_slots / drain_per_s
    busy = 0
    verdicts = {"admit": 0, "hold": 0, "shed": 0}
    seq = 0
    while events:
        t, _, what = heapq.heappop(events)
        for start, end in stalls:  # the loop handles what came due during a stall when it runs again
            if start <= t < end:
                if lag is not None and not any(s == start for s, _ in lag._stalls):  # noqa: SLF001
                    lag.record(start, end)
                t = end
        for _entry, _err in control.expire(SATURATED, t):
            verdicts["shed"] += 1
        if what == "arrive":
            seq += 1
            entry = QueuedRequest(seq, 0, "t", 1.0, 10, t, t + deadline_s)
            room = busy < num_slots and not len(control.queue)
            offer = control.offer(entry, ROOM if room else SATURATED, t)
            verdicts[offer.verdict.value] += 1
            if offer.verdict is Verdict.ADMIT:
                busy += 1
                heapq.heappush(events, (t + service_s, 0, "finish"))
        else:
            busy -= 1
            if control.release(ROOM, t, ReleaseReason.FIRST_TOKEN) is not None:
                busy += 1
                heapq.heappush(events, (t + service_s, 0, "finish"))
    return verdicts


def _control(deadline_s: float, lag: LoopLag | None) -> FlowControl:
    return FlowControl(FlowSettings(deadline_s=deadline_s),
                       stall_s=lag.stall_s if lag is not None else None)


def _starved_stalls() -> list[tuple[float, float]]:
    """As test_starved_router.py starves the real process: the loop blocked 1.2 s at a time, iteration after
    iteration, for 3 s, then free for 1.5 s, four times (from 10 s)."""
    out, t = [], 10.0
    for _ in range(4):
        s, end = t, t + 3.0
        while s < end - 1e-9:
            out.append((s, min(s + 1.2, end)))
            s = min(s + 1.2, end) + 0.001  # one loop iteration between two blocked ones
        t = end + 1.5
    return out


def _starved_run(lag: LoopLag | None) -> tuple[FlowControl, dict]:
    """Arrivals at 6/s, engines draining 10/s, deadline 6 s, the router starved (`_starved_stalls`)."""
    control = _control(6.0, lag)
    v = drive(control, arrival_per_s=6.0, drain_per_s=10.0, duration_s=30.0, deadline_s=6.0,
              stalls=_starved_stalls(), lag=lag)
    return control, v


def test_a_starved_router_sheds_nothing_where_the_fleet_keeps_up() -> None:
    """Every held request is released within its deadline (none expires), so no shed was needed; a drain rate
    whose span counts the stalls (nothing released while the loop is blocked) reads the drain as slow and sheds
    at arrival (`test_the_same_stalls_unmeasured_shed`); with the stalls left out of its span it does not."""
    control, v = _starved_run(LoopLag(clock=lambda: 0.0))
    assert v["hold"] > 100 and control.stats.released
    assert v["shed"] == 0 and sum(control.stats.shed.values()) == 0, (v, dict(control.stats.shed))


def test_the_same_stalls_unmeasured_shed() -> None:
    """The control: the same run with the router's stalls unknown to the drain rate (what the router did before
    it read its own loop lag) sheds at arrival requests that would have made their deadline."""
    control, v = _starved_run(None)
    assert control.stats.shed[("predicted_deadline", 429)] > 0
    assert control.stats.shed[("deadline", 429)] == 0  # none held really waited past its deadline


def test_a_real_overload_is_still_shed_at_arrival() -> None:
    """Arrivals at 2x what the engines drain, no stall: waits grow past the deadline, the predictions are checked
    right as held requests are released, and arrivals predicted late are shed at once."""
    control = _control(5.0, LoopLag(clock=lambda: 0.0))
    v = drive(control, arrival_per_s=20.0, drain_per_s=10.0, duration_s=30.0, deadline_s=5.0)
    assert control.predictions.trusted()
    assert control.stats.predicted_late["shed"] > 100
    assert control.stats.shed[("predicted_deadline", 429)] == control.stats.predicted_late["shed"]
    assert v["shed"] >= 250  # about half the 600 arrivals cannot be served within the deadline


def test_predictions_not_shown_right_hold_instead_of_shedding() -> None:
    """A predictor whose waits have been twice the actual ones does not shed: the late arrival is held and
    counted as held."""
    control = _control(5.0, None)
    for i in range(20):  # releases measured: the drain rate reads 1/s
        control.drain.record(float(i))
    for i in range(MIN_PREDICTIONS):
        e = QueuedRequest(("old", i), 0, "t", 1.0, 1, 0.0)
        control.predictions.predict(e, 10.0)
        control.predictions.check(e, 5.0)  # actual half the predicted
    assert not control.predictions.trusted()
    for i in range(8):
        control.queue.push(QueuedRequest(("held", i), 0, "t", 1.0, 1, 19.0, 60.0))
    offer = control.offer(QueuedRequest("late", 0, "t", 2.0, 1, 19.0, 21.0), SATURATED, 19.0)
    assert offer.verdict is Verdict.HOLD and control.stats.predicted_late["held"] == 1
    # once the predictions are right again, the same arrival is shed
    for i in range(2 * MIN_PREDICTIONS):
        e = QueuedRequest(("new", i), 0, "t", 1.0, 1, 0.0)
        control.predictions.predict(e, 10.0)
        control.predictions.check(e, 9.5)
    offer = control.offer(QueuedRequest("late2", 0, "t", 2.0, 1, 19.0, 21.0), SATURATED, 19.0)
    assert offer.verdict is Verdict.SHED and control.stats.predicted_late["shed"] == 1


@pytest.mark.parametrize(("ratios", "trusted"), [
    ([1.0] * (MIN_PREDICTIONS - 1), False),  # too few checked
    ([1.0] * MIN_PREDICTIONS, True),
    ([0.8] * MIN_PREDICTIONS, True),  # within the tolerance
    ([0.5] * MIN_PREDICTIONS, False),  # waits half what was predicted: would shed falsely
    ([3.0] * MIN_PREDICTIONS, True),  # underestimates shed later, never falsely
])
def test_wait_predictions_trust(ratios, trusted) -> None:
    w = WaitPredictions()
    for i, r in enumerate(ratios):
        e = QueuedRequest(i, 0, "t", 1.0, 1, 0.0)
        w.predict(e, 10.0)
        w.check(e, 10.0 * r)
    assert w.trusted() is trusted


def test_the_drain_rate_leaves_out_the_routers_stalls() -> None:
    lag = LoopLag(clock=lambda: 0.0)
    plain, measured = DrainRate(), DrainRate(stall_s=lag.stall_s)
    for i in range(11):  # 10 releases a second for 1 s
        plain.record(i / 10)
        measured.record(i / 10)
    lag.record(1.0, 4.0)  # then the loop stalls 3 s
    assert plain.per_s(4.0) == pytest.approx(10 / 4.0)
    assert measured.per_s(4.0) == pytest.approx(10.0)


def test_scrapes_are_not_stale_for_the_time_the_router_stalled() -> None:
    lag = LoopLag(clock=lambda: 0.0)
    lag.record(10.0, 12.5)  # the loop stalled 2.5 s after the scrape at 9.9 s
    assert not is_fresh(9.9, 13.0, 1.0, None)
    assert is_fresh(9.9, 13.0, 1.0, lag.stall_s)  # 3.1 s old, 2.5 of them stalled
    assert not is_fresh(9.9, 15.0, 1.0, lag.stall_s)  # 5.1 s old: stale all the same
    state = EndpointState(EndpointId("a:1"), True, num_requests_waiting=9, kv_cache_usage_ratio=0.5,
                          scraped_at_s=9.9)
    load, = endpoint_loads([state], {}, None, 13.0, stale_after_s=1.0, stall_s=lag.stall_s)
    assert load.num_waiting == 9
    load, = endpoint_loads([state], {}, None, 13.0, stale_after_s=1.0)
    assert load.num_waiting is None
