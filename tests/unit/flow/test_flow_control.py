"""Flow control's decisions (extproc/flow/saturation.py, control.py, settings.py; issue 24): the detector's table,
admission below and past saturation, shedding (deadline, predicted deadline, full queue, eviction of lower
classes, 429 vs 503, Retry-After from the drain rate), and the header classification."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from prefixroute.extproc.flow.control import (
    MAX_RETRY_AFTER_S, MIN_PREDICT_RELEASES, MIN_PREDICTIONS, DrainRate, FlowControl, ReleaseReason, ShedReason, Verdict,
)
from prefixroute.extproc.flow.queue import QueuedRequest
from prefixroute.extproc.flow.saturation import EndpointLoad, Saturation, SaturationDetector
from prefixroute.extproc.flow.settings import DEFAULT_FAIRNESS_ID, Classifier, FlowSettings
from prefixroute.extproc.tenants import Tenants, TenantSettings
from prefixroute.types import EndpointId

E1, E2 = EndpointId("a:1"), EndpointId("b:1")
SATURATED = Saturation(signal=2.0, num_healthy=2, num_with_room=0)
ROOM = Saturation(signal=0.5, num_healthy=2, num_with_room=1)
NONE_HEALTHY = Saturation(signal=math.inf, num_healthy=0, num_with_room=0)


@pytest.mark.parametrize(("loads", "saturated", "signal"), [
    ([EndpointLoad(E1, 0.1), EndpointLoad(E2, 1.0)], False, 0.4),  # one endpoint has room
    ([EndpointLoad(E1, 0.5), EndpointLoad(E2, 1.0)], True, 2.0),  # both past 0.25 s of queueing
    ([EndpointLoad(E1, 0.0, num_waiting=5)], True, 1.0),  # GIE: queue depth 5 is saturated
    ([EndpointLoad(E1, 0.0, num_waiting=4, kv_usage_ratio=0.4)], False, 0.8),
    ([EndpointLoad(E1, 0.0, kv_usage_ratio=0.9)], True, 1.125),  # past 0.8 KV usage
    ([EndpointLoad(E1, 0.0, num_waiting=None, kv_usage_ratio=None)], False, 0.0),  # unknown scrape: left out
    ([EndpointLoad(E1, 0.0, healthy=False), EndpointLoad(E2, 1.0)], True, 4.0),  # unhealthy is not room
    ([EndpointLoad(E1, 0.0, healthy=False)], True, math.inf),
    ([EndpointLoad(E1, 9.0, 50, 0.99, num_in_flight=0)], False, 0.0),  # idle: room, whatever the figures say
    ([EndpointLoad(E1, 9.0, num_in_flight=3)], True, 36.0),
    ([], True, math.inf),
])
def test_detector(loads, saturated, signal) -> None:
    s = SaturationDetector(max_queued_s=0.25, max_waiting=5, max_kv_usage_ratio=0.8).detect(loads)
    assert s.saturated is saturated
    assert s.signal == pytest.approx(signal)


def _entry(key, at=0.0, priority=0, cost=1.0, nbytes=10, deadline=30.0, tenant="t") -> QueuedRequest:
    return QueuedRequest(key, priority, tenant, cost, nbytes, at, at + deadline)


def test_below_saturation_nothing_is_held() -> None:
    fc = FlowControl(FlowSettings())
    for i in range(100):
        assert fc.offer(_entry(i), ROOM, float(i)).verdict is Verdict.ADMIT
    assert len(fc.queue) == 0 and fc.stats.num_admitted == 100


def test_past_saturation_requests_are_held_and_released_when_room_appears() -> None:
    fc = FlowControl(FlowSettings())
    for i in range(3):
        assert fc.offer(_entry(i, cost=3 - i), SATURATED, 0.0).verdict is Verdict.HOLD
    assert fc.release(SATURATED, 1.0, ReleaseReason.FIRST_TOKEN) is None  # still no room
    e = fc.release(ROOM, 1.0, ReleaseReason.FIRST_TOKEN)
    assert e.key == 2  # the cheapest
    assert fc.stats.released == {"first_token": 1} and fc.stats.wait_count == 1 and fc.stats.wait_sum_s == 1.0


def test_no_healthy_endpoint_is_503() -> None:
    fc = FlowControl(FlowSettings())
    o = fc.offer(_entry(1), NONE_HEALTHY, 0.0)
    assert o.verdict is Verdict.SHED and o.error.status == 503 and o.reason is ShedReason.NO_ENDPOINT
    assert b'"code":503' in o.error.body() and b"ServiceUnavailableError" in o.error.body()


def test_full_queue_sheds_with_429_or_evicts_a_lower_class() -> None:
    fc = FlowControl(FlowSettings(max_queued_requests=2))
    assert fc.offer(_entry("low", priority=-1), SATURATED, 0.0).verdict is Verdict.HOLD
    assert fc.offer(_entry("std"), SATURATED, 0.0).verdict is Verdict.HOLD
    o = fc.offer(_entry("std2"), SATURATED, 0.0)  # evicts the sheddable one
    assert o.verdict is Verdict.HOLD and [e.key for e in o.evicted] == ["low"]
    o = fc.offer(_entry("std3"), SATURATED, 0.0)  # nothing lower left: shed itself
    assert o.verdict is Verdict.SHED and o.error.status == 429 and o.reason is ShedReason.QUEUE_FULL
    assert b"RateLimitError" in o.error.body() and o.error.retry_after_s >= 1
    assert fc.stats.shed[("queue_full", 429)] == 1


def test_a_full_queue_sheds_from_the_tenant_holding_the_most_not_the_newcomer() -> None:
    # The case at bound 12: an attacker fills the queue; each victim arriving takes the place of the
    # attacker's newest request (main shed the victim: 21 of 50 victim requests 429 "queue full").
    fc = FlowControl(FlowSettings(max_queued_requests=12))
    for i in range(12):
        assert fc.offer(_entry(f"a{i}", tenant="attacker"), SATURATED, 0.0).verdict is Verdict.HOLD
    for i in range(6):
        o = fc.offer(_entry(f"v{i}", tenant="victim"), SATURATED, 0.1)
        assert o.verdict is Verdict.HOLD and [e.key for e in o.evicted] == [f"a{11 - i}"]
    # Now each holds 6: the attacker's next request and the victim's next are both shed (neither holds less).
    assert fc.offer(_entry("a-next", tenant="attacker"), SATURATED, 0.2).reason is ShedReason.QUEUE_FULL
    assert fc.offer(_entry("v-next", tenant="victim"), SATURATED, 0.2).reason is ShedReason.QUEUE_FULL
    # A third tenant still gets in, at the expense of one of the two largest (the same count: the last in
    # name order, deterministic).
    o = fc.offer(_entry("c0", tenant="carol"), SATURATED, 0.3)
    assert o.verdict is Verdict.HOLD and [e.key for e in o.evicted] == ["v5"]
    assert fc.queue.num_queued_of(0, "attacker") == 6 and fc.queue.num_queued_of(0, "victim") == 5


def test_a_full_queue_never_gives_a_higher_class_for_a_lower_one() -> None:
    fc = FlowControl(FlowSettings(max_queued_requests=2))
    assert fc.offer(_entry("h1", tenant="x", priority=5), SATURATED, 0.0).verdict is Verdict.HOLD
    assert fc.offer(_entry("h2", tenant="x", priority=5), SATURATED, 0.0).verdict is Verdict.HOLD
    o = fc.offer(_entry("low", tenant="y", priority=0), SATURATED, 0.0)  # y holds less, but of a lower class
    assert o.verdict is Verdict.SHED and o.evicted == []


def test_full_queue_in_bytes() -> None:
    fc = FlowControl(FlowSettings(max_queued_mb=1.0))
    assert fc.offer(_entry("a", nbytes=700_000), SATURATED, 0.0).verdict is Verdict.HOLD
    assert fc.offer(_entry("b", nbytes=400_000), SATURATED, 0.0).verdict is Verdict.SHED
    assert fc.offer(_entry("c", nbytes=300_000), SATURATED, 0.0).verdict is Verdict.HOLD


def test_deadline_passes_while_held() -> None:
    fc = FlowControl(FlowSettings())
    fc.offer(_entry("short", deadline=1.0), SATURATED, 0.0)
    fc.offer(_entry("long", deadline=10.0), SATURATED, 0.0)
    assert fc.expire(SATURATED, 0.5) == []
    assert fc.next_deadline_s() == 1.0
    out = fc.expire(SATURATED, 1.0)
    assert [(e.key, err.status, err.reason) for e, err in out] == [("short", 429, ShedReason.DEADLINE)]
    assert [e.key for e in fc.queue] == ["long"]


def _draining(num_releases: int) -> FlowControl:
    """10 held, then `num_releases` seconds of one arrival and one release a second: 10 still held."""
    fc = FlowControl(FlowSettings())
    for i in range(10):
        fc.offer(_entry(i, cost=1.0), SATURATED, 0.0)
    for t in range(num_releases):
        fc.offer(_entry(100 + t, cost=1.0), SATURATED, float(t))
        fc.release(ROOM, float(t), ReleaseReason.RELEASE)
    return fc


def test_predicted_deadline_sheds_at_arrival_only_when_the_drain_says_so() -> None:
    n = MIN_PREDICT_RELEASES
    fc = _draining(n)
    assert fc.drain.per_s(n - 1.0) == pytest.approx(1.0)
    # not before the predicted waits have been checked right (test_flow_slow_router.py): held, counted
    assert fc.offer(_entry("early", at=n - 1.0, cost=1.0, deadline=2.0), SATURATED, n - 1.0).verdict is \
        Verdict.HOLD
    assert fc.stats.predicted_late["held"] == 1
    for i in range(MIN_PREDICTIONS):
        checked = _entry(("checked", i))
        fc.predictions.predict(checked, 4.0)
        fc.predictions.check(checked, 4.0)
    # 10 of equal cost ahead at 1/s: 2 s is too short, but a cheap one goes first and makes it
    assert fc.offer(_entry("late", at=n - 1.0, cost=1.0, deadline=2.0), SATURATED, n - 1.0).reason is \
        ShedReason.PREDICTED_DEADLINE
    assert fc.offer(_entry("cheap", at=n - 1.0, cost=0.1, deadline=2.0), SATURATED, n - 1.0).verdict is \
        Verdict.HOLD


@pytest.mark.parametrize("num_releases", [0, 2, 5, 15])
def test_a_young_drain_rate_never_sheds_at_arrival(num_releases: int) -> None:
    """A busy period's first releases understate its drain (the engines still hold what was admitted before
    saturation): a request is held on such a rate, and shed only if its deadline really passes."""
    assert num_releases < MIN_PREDICT_RELEASES
    fc = _draining(num_releases)
    now = max(0.0, num_releases - 1.0)
    offer = fc.offer(_entry("late", at=now, cost=1.0, deadline=2.0), SATURATED, now)
    assert offer.verdict is Verdict.HOLD
    assert [(e.key, err.reason) for e, err in fc.expire(SATURATED, now + 2.0)] == [("late", ShedReason.DEADLINE)]


def test_retry_after_follows_the_drain_rate() -> None:
    fc = FlowControl(FlowSettings())
    assert fc.retry_after_s(0.0) == 1  # unknown drain
    for i in range(20):
        fc.offer(_entry(i), SATURATED, 0.0)
    for t in range(6):  # 2 releases a second
        fc.release(ROOM, t / 2, ReleaseReason.RELEASE)
    assert fc.retry_after_s(2.5) == math.ceil((14 + 1) / 2.0)


@hsettings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 100), min_size=2, max_size=80), st.integers(0, 10_000))
def test_retry_after_is_bounded(times, held) -> None:
    fc = FlowControl(FlowSettings())
    for t in sorted(times):
        fc.drain.record(t)
    for i in range(held % 50):
        fc.queue.push(_entry(i))
    assert 1 <= fc.retry_after_s(max(times)) <= MAX_RETRY_AFTER_S


def test_drain_rate() -> None:
    d = DrainRate(window=4)
    assert d.per_s(0.0) is None
    for t in (0.0, 1.0, 2.0, 3.0, 4.0):
        d.record(t)
    assert d.per_s(4.0) == pytest.approx(3 / 3.0)
    assert d.per_s(7.0) == pytest.approx(3 / 6.0)  # no release since: slowing down


def test_drop_leaves_the_queue() -> None:
    fc = FlowControl(FlowSettings())
    e = _entry("gone")
    fc.offer(e, SATURATED, 0.0)
    assert fc.drop(e) and not fc.drop(e)
    assert len(fc.queue) == 0 and fc.stats.num_dropped == 1 and fc.expire(SATURATED, 100.0) == []


FORGED = {"x-prefixroute-priority": "1000", "x-gateway-inference-objective": "critical",
          "x-prefixroute-tenant": "b"}


@pytest.mark.parametrize(("headers", "priority", "fairness", "deadline"), [
    ({}, 0, DEFAULT_FAIRNESS_ID, 30.0),
    # By default a client's own priority, objective and tenant headers set nothing (its gateway strips them
    # anyway): the fairness header alone is believed, which prefixroute's Envoy sets to the client's address.
    (FORGED, 0, DEFAULT_FAIRNESS_ID, 30.0),
    ({**FORGED, "x-gateway-inference-fairness-id": "address:10.0.0.7"}, 0, "address:10.0.0.7", 30.0),
    ({"x-prefixroute-deadline-ms": "2500"}, 0, DEFAULT_FAIRNESS_ID, 2.5),
    ({"x-prefixroute-deadline-ms": "-5"}, 0, DEFAULT_FAIRNESS_ID, 30.0),
    ({"x-prefixroute-deadline-ms": "3600000"}, 0, DEFAULT_FAIRNESS_ID, 60.0),  # capped: Envoy waits no longer
    ({"x-prefixroute-deadline-ms": "inf"}, 0, DEFAULT_FAIRNESS_ID, 30.0),
])
def test_classifier_believes_no_client_header(headers, priority, fairness, deadline) -> None:
    c = Classifier(FlowSettings(objective_priorities=("critical=100", "batch=-1"))).classify(headers)
    assert (c.priority, c.fairness_id, c.deadline_s) == (priority, fairness, deadline)


@pytest.mark.parametrize(("headers", "priority", "fairness"), [
    ({}, 0, DEFAULT_FAIRNESS_ID),
    ({"x-prefixroute-priority": "7"}, 7, DEFAULT_FAIRNESS_ID),
    ({"x-prefixroute-priority": "nope"}, 0, DEFAULT_FAIRNESS_ID),  # malformed: default, no 400
    ({"x-gateway-inference-objective": "batch"}, -1, DEFAULT_FAIRNESS_ID),
    ({"x-gateway-inference-objective": "unknown"}, 0, DEFAULT_FAIRNESS_ID),  # only the operator's table maps
    ({"x-gateway-inference-objective": "batch", "x-prefixroute-priority": "3"}, 3, DEFAULT_FAIRNESS_ID),
    ({"x-gateway-inference-fairness-id": "team-a"}, 0, "team-a"),
    ({"x-gateway-inference-fairness-id": "team-a", "x-prefixroute-tenant": "b"}, 0, "tenant:b"),  # tenant's flow
])
def test_classifier_behind_a_trusted_ingress(headers, priority, fairness) -> None:
    tenants = Tenants(TenantSettings(trusted_headers=("tenant", "priority", "objective", "fairness")))
    c = Classifier(FlowSettings(objective_priorities=("critical=100", "batch=-1")), tenants).classify(headers)
    assert (c.priority, c.fairness_id) == (priority, fairness)


@pytest.mark.parametrize("kw", [
    {"objective_priorities": ("nope",)}, {"objective_priorities": ("a=x",)}, {"saturation_queued_s": 0.0},
    {"max_queued_requests": 0}, {"deadline_s": 0.0}, {"max_wait_ratio": 0.5},
])
def test_settings_reject_nonsense(kw) -> None:
    with pytest.raises(ValueError):
        FlowSettings(**kw)


def test_metrics_show_queue_per_class_and_tenant_wait_released_shed_and_saturation() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from prefixroute.extproc.flow.metrics import FlowCollector

    fc = FlowControl(FlowSettings(max_queued_requests=3))
    fc.offer(_entry("a", tenant="x", priority=1), SATURATED, 0.0)
    fc.offer(_entry("b", tenant="y"), SATURATED, 0.0)
    fc.offer(_entry("c", tenant="y"), SATURATED, 0.0)
    fc.offer(_entry("d", tenant="y"), SATURATED, 0.0)  # full: shed
    fc.release(ROOM, 0.3, ReleaseReason.FIRST_TOKEN)
    registry = CollectorRegistry()
    registry.register(FlowCollector(fc))
    text = generate_latest(registry).decode()
    assert 'prefixroute_flow_queue_length{priority="0"} 2.0' in text
    assert 'prefixroute_flow_queue_flows{priority="0"} 1.0' in text
    assert 'prefixroute_flow_queue_length{priority="1"}' not in text  # released: its row is gone
    assert "fairness_id" not in text and '"y"' not in text  # no flow's name: another tenant's is not shown
    assert 'prefixroute_flow_released_total{reason="first_token"} 1.0' in text
    assert 'prefixroute_flow_shed_total{code="429",reason="queue_full"} 1.0' in text
    assert 'prefixroute_flow_wait_seconds_bucket{le="0.25"} 0.0' in text
    assert 'prefixroute_flow_wait_seconds_bucket{le="0.5"} 1.0' in text
    assert "prefixroute_flow_wait_seconds_sum 0.3" in text
    assert "prefixroute_flow_saturation 0.5" in text
    assert "prefixroute_flow_held_total 3.0" in text


@pytest.mark.parametrize(("loads", "bound"), [
    ([EndpointLoad(E1, 0.5), EndpointLoad(E2, 1.0)], "queued_s"),
    ([EndpointLoad(E1, 0.1, num_waiting=9)], "num_waiting"),
    ([EndpointLoad(E1, 0.1, num_waiting=1, kv_usage_ratio=0.95)], "kv_usage"),
    # the least loaded endpoint names the bound: b's queueing is worse, a's KV usage holds it
    ([EndpointLoad(E1, 0.1, kv_usage_ratio=0.9), EndpointLoad(E2, 2.0)], "kv_usage"),
    ([EndpointLoad(E1, 0.0, healthy=False)], None),
])
def test_detector_names_the_bound_that_holds(loads, bound) -> None:
    assert SaturationDetector(0.25, 5, 0.8).detect(loads).bound == bound


def test_held_requests_are_counted_by_bound_and_exported() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from prefixroute.extproc.flow.metrics import FlowCollector

    fc = FlowControl(FlowSettings())
    det = SaturationDetector(0.25, 5, 0.8)
    fc.offer(_entry(1), det.detect([EndpointLoad(E1, 1.0)]), 0.0)
    fc.offer(_entry(2), det.detect([EndpointLoad(E1, 0.1, num_waiting=7)]), 0.0)
    fc.offer(_entry(3), det.detect([EndpointLoad(E1, 0.1, num_waiting=7)]), 0.0)
    fc.offer(_entry(4), ROOM, 0.0)  # admitted: not counted
    registry = CollectorRegistry()
    registry.register(FlowCollector(fc))
    text = generate_latest(registry).decode()
    assert 'prefixroute_flow_held_by_bound_total{bound="queued_s"} 1.0' in text
    assert 'prefixroute_flow_held_by_bound_total{bound="num_waiting"} 2.0' in text


def test_the_drain_rate_restarts_when_the_queue_empties() -> None:
    """A burst after an idle spell is judged by its own drain, not by the last busy period's rate read over the
    idle spell (that rate reads as a crawl and would shed the burst as predicted_deadline at once)."""
    fc = FlowControl(FlowSettings())
    for i in range(64):  # a busy period: 64 held at once, released one a second until the queue empties
        assert fc.offer(_entry(("a", i), deadline=100.0), SATURATED, 0.0).verdict is Verdict.HOLD
    for i in range(64):
        assert fc.release(ROOM, 1.0 + i, ReleaseReason.FIRST_TOKEN) is not None
    assert len(fc.queue) == 0 and fc.drain.per_s(1000.0) == pytest.approx(63 / 999)
    verdicts = [fc.offer(_entry(("b", i), at=1000.0), SATURATED, 1000.0).verdict for i in range(40)]
    assert verdicts == [Verdict.HOLD] * 40  # nothing shed on the stale rate
    assert fc.drain.per_s(1000.0) is None and fc.retry_after_s(1000.0) == 1
    for t in (1000.5, 1001.0, 1001.5):
        fc.release(ROOM, t, ReleaseReason.FIRST_TOKEN)
    assert fc.drain.per_s(1001.5) == pytest.approx(2.0)  # the new burst's own rate


def test_release_bounds_aging_by_the_drain_rate() -> None:
    """Past `MIN_PREDICT_RELEASES` releases, under deadline pressure, the oldest held request goes first once it
    waited longer than first come, first served would take to release what is held (held / drain rate), whatever
    the average; without deadline pressure the average alone ages it."""
    assert _aged_release(deadline_s=8.0) == "dear"  # ~5 s to release in arrival order >= half of 8 s
    assert _aged_release(deadline_s=30.0) == ("cheap", 0)  # no deadline pressure: shortest first, the average


def _aged_release(deadline_s: float):
    fc = FlowControl(FlowSettings(max_wait_ratio=4.0, aging_min_s=1.0, deadline_s=deadline_s))
    n = MIN_PREDICT_RELEASES
    for k in range(n + 1):
        fc.offer(_entry(("d", k), cost=0.1, at=0.0), SATURATED, 0.0)
    for t in range(1, n + 1):  # one release a second: waits of 1..16 s make a large average
        fc.release(ROOM, float(t), ReleaseReason.RELEASE)
    now = float(n)
    fc.offer(_entry("dear", cost=5.0, at=now), SATURATED, now)
    for i in range(3):
        fc.offer(_entry(("cheap", i), cost=0.1, at=now), SATURATED, now)
    assert fc.release(ROOM, now + 6.0, ReleaseReason.RELEASE).key == ("d", n)  # the oldest, aged either way
    # 4 held at ~0.8/s: arrival order would release them within ~5 s; "dear" has waited 6 s (4 x the average
    # would let it wait ~20 s)
    return fc.release(ROOM, now + 6.0, ReleaseReason.RELEASE).key
