"""Waiting on a condition: the one way tests wait for something to happen.

`until(cond, timeout_s)` calls `cond()` every `interval_s` until it returns something truthy and returns that
value; when `timeout_s` has passed it calls `cond()` once more and, if still falsy, fails the test with an
AssertionError naming `message` (a string, or a callable evaluated only then, so it may scrape or read logs)
and the last value. `until_async` is the same for coroutines: it yields to the event loop between calls, so
the code under test runs meanwhile, and its condition may be a coroutine function (one that scrapes over HTTP). Neither ever returns a falsy value: a caller that only wants to know
whether something happened within a time writes `with pytest.raises(AssertionError)` or checks the state.

Why one helper: a fixed `time.sleep(0.5)` before an assertion is either too short on a loaded CI machine (a
flaky test) or longer than needed (a slow one); a condition polled every few tens of milliseconds is neither.
A fixed sleep remains right only where a test lets time pass on purpose (to show that something does *not*
happen, or to pace load); such sleeps say so in a comment.

`cond` runs on the caller's thread (or event loop) and should be cheap and free of side effects other than
reading state; an exception it raises propagates at once (a broken probe is not a condition not yet met).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_INTERVAL_S = 0.05
"""Between two calls of the condition: short beside any timeout a test uses (seconds), long enough that a
condition which scrapes a process's /metrics does not load a 2-core machine."""


def _failure(message: str | Callable[[], object], timeout_s: float, last: object) -> AssertionError:
    text = message() if callable(message) else message
    return AssertionError(f"{text or 'condition'} not met within {timeout_s} s (last value: {last!r})")


def until(cond: Callable[[], T], timeout_s: float, *, interval_s: float = DEFAULT_INTERVAL_S,
          message: str | Callable[[], object] = "") -> T:
    """`cond()`'s first truthy value within `timeout_s` seconds; AssertionError (with `message`) otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise _failure(message, timeout_s, got)
        time.sleep(interval_s)


async def until_async(cond: Callable[[], T | Awaitable[T]], timeout_s: float, *, interval_s: float = 0.01,
                      message: str | Callable[[], object] = "") -> T:
    """`until` for coroutines: awaits `asyncio.sleep(interval_s)` between calls (default 10 ms: the conditions
    awaited in-process are cheap attribute reads, and event-loop work is what they wait for). A condition that
    returns an awaitable is awaited for its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        if time.monotonic() >= deadline:
            raise _failure(message, timeout_s, got)
        await asyncio.sleep(interval_s)
