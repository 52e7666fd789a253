"""The ext_authz decision's pick table (extproc/exchange.py `FactsWaits`): each pick a check made is released once,
by its facts record or after `release_after_s`. The checks themselves, over HTTP, are in test_authz_http.py."""

from __future__ import annotations

import asyncio

import pytest

from helpers.waiting import until_async
from prefixroute.extproc.exchange import FactsWaits

pytestmark = pytest.mark.integration  # runs on an event loop's timers: not a unit test


async def test_unary_picks_are_released_once_by_their_record_or_their_timeout() -> None:
    released, closed = [], []
    picks = FactsWaits(released.append, closed.append, release_after_s=0.2)
    picks.add("s1", "st1", "p1")  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    picks.add("s2", "st2", "p2")  # type: ignore[arg-type]
    assert picks.close("s1") and not picks.close("s1") and not picks.close(None) and not picks.close("other")
    assert (released, closed, len(picks)) == (["p1"], ["st1"], 1)
    await until_async(lambda: len(picks) == 0, 2.0)
    assert (released, closed, picks.num_expired) == (["p1", "p2"], ["st1", "st2"], 1)
    assert not picks.close("s2")  # expired: its late record releases nothing again


async def test_ended_streams_picks_are_released_at_their_end_while_records_go_missing() -> None:
    """A stream's pick waits for its facts record, unless one recently waited in vain (the facts logger down):
    then it is released at its stream's end, not `release_after_s` later; after the backoff it waits again. A
    check's table (no backoff) always takes its picks."""
    from helpers.picks import make_pick
    from prefixroute.extproc.exchange import Exchange
    from prefixroute.extproc.tracking import NullTracker, Tracked
    from prefixroute.telemetry.records import RequestRecord
    from prefixroute.types import Decision

    released, closed = [], []

    class Router:
        def release(self, pick) -> None:  # noqa: ANN001
            released.append(pick)

    class Tracker(NullTracker):
        def routing_closed(self, st) -> None:  # noqa: ANN001
            closed.append(st)

    ended = FactsWaits(released.append, closed.append, release_after_s=0.1, missing_backoff_s=0.4)
    checks = FactsWaits(released.append, closed.append, release_after_s=0.1)

    def end_one(span_id: str) -> object:
        ex = Exchange(Router(), Tracker())  # type: ignore[arg-type]
        st = Tracked(RequestRecord(trace_id="ab" * 16, start_time=0.0, span_id=span_id), 0.0)
        st.facts = True
        ex.st, ex.pick = st, make_pick(("a:1",), Decision(endpoints=("a:1",), reason="affinity", policy="prefix"))
        ex.end(ended)
        return ex.pick

    first = end_one("s1")
    assert released == [] and len(ended) == 1  # waits for its record
    await until_async(lambda: ended.num_expired == 1, 2.0)  # its record never came
    assert released == [first] and not ended.accepts() and checks.accepts()
    second = end_one("s2")
    assert released == [first, second] and len(ended) == 0  # released at its end, at once
    await asyncio.sleep(0.45)
    assert ended.accepts()
    end_one("s3")
    assert len(ended) == 1 and len(released) == 2  # waits for its record again
