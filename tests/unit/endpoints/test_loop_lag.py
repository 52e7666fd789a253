"""`LoopLag`'s bookkeeping on a fake clock: what stalls it records and how much of a window they cover."""

from __future__ import annotations

import asyncio
import time

import pytest

from prefixroute.extproc.endpoints.loop_lag import MIN_STALL_S, LoopLag


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lateness_under_the_timer_granularity_is_no_stall():
    lag = LoopLag(clock=Clock())
    lag.record(10.0, 10.0 + MIN_STALL_S / 2)
    assert lag.num_stalls == 0 and lag.stall_s(0.0, 20.0) == 0.0


def test_stalls_overlapping_a_window_are_clipped_to_it():
    lag = LoopLag(clock=Clock())
    lag.record(10.0, 10.4)  # before the window
    lag.record(11.0, 11.5)  # straddles its start
    lag.record(12.0, 12.2)  # inside
    lag.record(13.0, 13.6)  # straddles its end
    assert lag.stall_s(11.25, 13.25) == pytest.approx(0.25 + 0.2 + 0.25)
    assert lag.stall_s(14.0, 15.0) == 0.0
    assert lag.total_stall_s == pytest.approx(0.4 + 0.5 + 0.2 + 0.6) and lag.num_stalls == 4


def test_an_overdue_sampler_counts_as_a_stall_under_way():
    clock = Clock()
    lag = LoopLag(clock=clock, interval_s=0.05)
    lag._due = 100.05  # the sampler's sleep ends then (what `run` sets)
    clock.now = 100.75  # the caller runs first in the iteration that ended the stall
    assert lag.stall_s(100.5) == pytest.approx(0.25)  # only the part since `since`
    assert lag.stall_s(100.0) == pytest.approx(0.7)
    assert lag.max_lag_s() == pytest.approx(0.7)


def test_old_stalls_are_dropped_and_max_lag_looks_at_the_recent_ones():
    lag = LoopLag(clock=Clock(), window_s=60.0)
    lag.record(0.0, 2.0)
    lag.record(61.0, 61.3)
    assert len(lag._stalls) == 2  # the first ended 59.3 s before: kept
    lag.record(70.0, 70.1)
    assert [s for s, _ in lag._stalls] == [61.0, 70.0]
    assert lag.max_lag_s(70.5) == pytest.approx(0.3)  # the 2 s stall ended over 10 s ago
    assert lag.max_lag_s(80.0) == pytest.approx(0.1)
    assert lag.total_stall_s == pytest.approx(2.4)  # a counter: dropped stalls still counted


async def test_the_sampler_sees_a_blocked_loop():
    lag = LoopLag(interval_s=0.01)
    task = asyncio.create_task(lag.run())
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    time.sleep(0.3)  # blocks the loop on purpose
    assert lag.stall_s(t0) >= 0.25  # seen before the sampler itself ran (it is overdue)
    await asyncio.sleep(0.03)
    assert lag.num_stalls >= 1 and lag.max_lag_s() >= 0.25
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
