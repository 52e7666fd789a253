"""helpers.waiting: the one polling helper of the tests returns the condition's first truthy value, fails with its
message (evaluated only on failure) when the time is up, and lets a broken condition's exception through."""

from __future__ import annotations

import pytest

from helpers.waiting import until, until_async


def _sequence(*values: object):  # noqa: ANN202
    it = iter(values)
    calls: list[object] = []

    def cond() -> object:
        calls.append(v := next(it))
        return v

    return cond, calls


def test_returns_the_first_truthy_value_and_stops_calling() -> None:
    cond, calls = _sequence(0, None, {}, {"a": 1}, "never reached")
    assert until(cond, 5, interval_s=0) == {"a": 1}
    assert len(calls) == 4


def test_fails_naming_the_message_and_the_last_value_once_the_time_is_up() -> None:
    asked: list[int] = []

    def message() -> str:
        asked.append(1)
        return "the thing"

    with pytest.raises(AssertionError, match=r"the thing not met within 0.05 s \(last value: \[\]\)"):
        until(list, 0.05, interval_s=0.01, message=message)
    assert asked == [1]  # evaluated once, at the failure only


def test_the_condition_is_checked_once_more_after_the_deadline() -> None:
    # The sleep overshoots the deadline: the call after it still counts (no failure for a condition met in time).
    cond, calls = _sequence(False, "late")
    assert until(cond, 0.01, interval_s=0.05) == "late"
    assert calls == [False, "late"]


def test_an_exception_in_the_condition_is_not_a_condition_not_yet_met() -> None:
    def broken() -> bool:
        raise KeyError("probe")

    with pytest.raises(KeyError):
        until(broken, 5)


async def test_the_async_form_yields_to_the_loop_between_calls() -> None:
    import asyncio

    done = asyncio.Event()
    asyncio.get_running_loop().call_later(0.02, done.set)
    assert await until_async(done.is_set, 5) is True
    with pytest.raises(AssertionError, match="never"):
        await until_async(lambda: False, 0.03, message="never")


async def test_the_async_form_awaits_a_coroutine_condition() -> None:
    cond, calls = _sequence(0, 0, "ok")

    async def scrape() -> object:
        return cond()

    assert await until_async(scrape, 5, interval_s=0) == "ok"
    assert calls == [0, 0, "ok"]
