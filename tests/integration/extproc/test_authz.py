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
