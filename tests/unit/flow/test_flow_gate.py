"""The live gate (extproc/flow/gate.py, issue 24) on a real asyncio loop: admission below saturation, holding
on a future and release by capacity events one placement at a time (late binding), disconnects, deadline
timers, re-costing a group, and that a held request costs no CPU while it waits."""

from __future__ import annotations

import asyncio
import time

import pytest

from prefixroute.extproc.flow.control import FlowControl, ReleaseReason, Shed
from prefixroute.extproc.flow.gate import FlowGate
from prefixroute.extproc.flow.saturation import EndpointLoad, SaturationDetector
from prefixroute.extproc.flow.settings import FlowClass, FlowSettings
from prefixroute.types import EndpointId

EP = EndpointId("a:1")


class Fleet:
    """One endpoint whose predicted queueing the test sets; `place` adds a request's work to it (what the time
    model's add_pending does)."""

    def __init__(self, queued_s: float = 0.0) -> None:
        self.queued_s = queued_s
        self.placed: list = []

    def loads(self):
        return [EndpointLoad(EP, self.queued_s)]

    def place(self, key, cost_s: float = 0.2) -> None:
        self.placed.append(key)
        self.queued_s += cost_s


def _gate(fleet: Fleet, **kw) -> FlowGate:
    return FlowGate(FlowControl(FlowSettings(**kw)), SaturationDetector(max_queued_s=0.25), fleet.loads)


async def _client(gate: FlowGate, fleet: Fleet, key, cost_s=1.0, flow=FlowClass(), group=None):
    ticket = await gate.admit(key, flow, cost_s=cost_s, num_bytes=100, group=group)
    fleet.place(key)
    gate.placed(ticket)
    return ticket


async def test_below_saturation_admits_at_once() -> None:
    fleet = Fleet(0.0)
    gate = _gate(fleet)
    t = await _client(gate, fleet, "a")
    assert not t.held and t.wait_s == 0.0 and gate.num_held == 0


async def test_held_until_capacity_frees_then_released_shortest_first_one_at_a_time() -> None:
    fleet = Fleet(1.0)  # saturated
    gate = _gate(fleet)
    tasks = [asyncio.create_task(_client(gate, fleet, k, cost_s=c)) for k, c in (("cold", 2.0), ("hit", 0.1),
                                                                                  ("mid", 1.0))]
    await asyncio.sleep(0.01)
    assert gate.num_held == 3 and fleet.placed == []
    fleet.queued_s = 0.0  # a first token: room for ~one request (each placement adds 0.2 s)
    gate.pump(ReleaseReason.FIRST_TOKEN)
    await asyncio.sleep(0.01)
    # late binding: each release saw the load of the previous placement; the second fills the endpoint
    assert fleet.placed == ["hit", "mid"] and gate.num_held == 1
    fleet.queued_s = 0.0
    gate.pump(ReleaseReason.SCRAPE)
    tickets = await asyncio.gather(*tasks)
    assert fleet.placed == ["hit", "mid", "cold"]
    assert [t.released_by for t in tickets] == [ReleaseReason.SCRAPE, ReleaseReason.FIRST_TOKEN,
                                                ReleaseReason.FIRST_TOKEN]
    assert all(t.held and t.wait_s > 0 for t in tickets)


async def test_a_client_that_leaves_leaves_the_queue() -> None:
    fleet = Fleet(1.0)
    gate = _gate(fleet)
    task = asyncio.create_task(_client(gate, fleet, "gone"))
    await asyncio.sleep(0.01)
    assert gate.num_held == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.num_held == 0 and gate.control.stats.num_dropped == 1
    fleet.queued_s = 0.0
    gate.pump(ReleaseReason.RELEASE)
    assert fleet.placed == []


async def test_deadline_sheds_with_429_from_a_timer() -> None:
    fleet = Fleet(1.0)
    gate = _gate(fleet)
    started = time.monotonic()
    with pytest.raises(Shed) as info:
        await _client(gate, fleet, "late", flow=FlowClass(deadline_s=0.05))
    assert info.value.status == 429 and info.value.retry_after_s >= 1
    assert 0.04 <= time.monotonic() - started < 1.0
    assert gate.num_held == 0


async def test_eviction_fails_the_held_request() -> None:
    fleet = Fleet(1.0)
    gate = _gate(fleet, max_queued_requests=1)
    low = asyncio.create_task(_client(gate, fleet, "low", flow=FlowClass(priority=-1)))
    await asyncio.sleep(0.01)
    high = asyncio.create_task(_client(gate, fleet, "high", flow=FlowClass(priority=1)))
    with pytest.raises(Shed) as info:
        await low
    assert info.value.status == 429
    fleet.queued_s = 0.0
    gate.pump(ReleaseReason.RELEASE)
    assert (await high).held


async def test_a_holder_that_never_places_does_not_block_the_queue() -> None:
    fleet = Fleet(1.0)
    gate = FlowGate(FlowControl(FlowSettings()), SaturationDetector(), fleet.loads, placement_timeout_s=0.05)
    first = asyncio.create_task(gate.admit("forgetful", FlowClass(), cost_s=1.0, num_bytes=1))
    second = asyncio.create_task(_client(gate, fleet, "second"))
    await asyncio.sleep(0.01)
    fleet.queued_s = 0.0
    gate.pump(ReleaseReason.RELEASE)
    await first  # released, never placed
    await asyncio.wait_for(second, 1.0)


async def test_placing_a_request_recosts_its_held_group() -> None:
    """A sibling of a placed request (same prefix) becomes a hit: it goes before a cheaper-looking cold one."""
    fleet = Fleet(1.0)
    gate = FlowGate(FlowControl(FlowSettings()), SaturationDetector(), fleet.loads, recost=lambda key: 0.05)
    tasks = [asyncio.create_task(_client(gate, fleet, k, cost_s=c, group=g))
             for k, c, g in (("leader", 0.01, "g"), ("sibling", 2.0, "g"), ("other", 1.0, None))]
    await asyncio.sleep(0.01)
    fleet.queued_s = 0.0  # room for two placements
    gate.pump(ReleaseReason.FIRST_TOKEN)
    await asyncio.sleep(0.01)
    assert fleet.placed == ["leader", "sibling"]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_held_request_costs_no_cpu_while_it_waits() -> None:
    fleet = Fleet(1.0)
    gate = _gate(fleet)
    tasks = [asyncio.create_task(_client(gate, fleet, i)) for i in range(200)]
    await asyncio.sleep(0.01)
    cpu = time.process_time()
    await asyncio.sleep(0.5)
    assert time.process_time() - cpu < 0.05  # 200 held for half a second: no polling
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert gate.num_held == 0
