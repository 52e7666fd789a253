"""`ResponseDirectory` (bounds, expiry, endpoint removal and restart) and `ResponseLookup` without candidates
(against real HTTP endpoints: tests/integration/extproc/test_response_directory_lookups.py)."""

from __future__ import annotations

import pytest

from prefixroute.extproc.response_directory import NEGATIVE_TTL_S, NeedsLookup, ResponseDirectory, ResponseLookup
from prefixroute.types import EndpointId, EndpointState
from prefixroute.openai_errors import OpenAIError


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


A, B, C = EndpointId("a:1"), EndpointId("b:1"), EndpointId("c:1")


def test_learn_and_find() -> None:
    d = ResponseDirectory(10, 60.0, clock=Clock())
    d.learn("resp_1", A)
    d.learn("resp_2", B)
    assert (d.endpoint_of("resp_1"), d.endpoint_of("resp_2"), d.endpoint_of("resp_3")) == (A, B, None)


def test_lru_bound_evicts_least_recently_used() -> None:
    d = ResponseDirectory(3, 60.0, clock=Clock())
    for i in range(3):
        d.learn(f"resp_{i}", A)
    assert d.endpoint_of("resp_0") == A  # used: now the most recent
    d.learn("resp_3", B)
    assert len(d) == 3 and d.num_evicted == 1
    assert d.endpoint_of("resp_1") is None  # the least recently used went
    assert [d.endpoint_of(f"resp_{i}") for i in (0, 2, 3)] == [A, A, B]


@pytest.mark.parametrize("elapsed_s, known", [(59.9, True), (60.0, False), (500.0, False)])
def test_expiry_after_ttl(elapsed_s: float, known: bool) -> None:
    clock = Clock()
    d = ResponseDirectory(10, 60.0, clock=clock)
    d.learn("resp_1", A)
    clock.t += elapsed_s
    assert (d.endpoint_of("resp_1") == A) is known


def test_use_refreshes_expiry_and_sweep_drops_expired() -> None:
    clock = Clock()
    d = ResponseDirectory(10, 60.0, clock=clock)
    d.learn("resp_old", A)
    d.learn("resp_used", A)
    clock.t += 50
    assert d.endpoint_of("resp_used") == A
    clock.t += 50  # resp_old is 100 s old, resp_used was used 50 s ago
    d.learn("resp_new", B)  # a learn sweeps the expired end
    assert len(d) == 2 and d.num_expired == 1
    assert d.endpoint_of("resp_used") == A


def test_endpoint_removed_or_restarted_forgets_its_ids() -> None:
    d = ResponseDirectory(10, 60.0, clock=Clock())
    d.sync([EndpointState(A), EndpointState(B), EndpointState(C)])
    d.learn("resp_a", A)
    d.learn("resp_b", B)
    d.learn("resp_c", C)
    d.sync([EndpointState(A), EndpointState(B, restart_epoch=1), EndpointState(C)])  # B restarted
    assert d.endpoint_of("resp_b") is None and d.endpoint_of("resp_a") == A
    d.sync([EndpointState(A), EndpointState(B, restart_epoch=1)])  # C left the pool
    assert d.endpoint_of("resp_c") is None and d.endpoint_of("resp_a") == A
    assert d.num_forgotten == 2
    d.sync([EndpointState(A, healthy=False), EndpointState(B, restart_epoch=1)])  # down is not gone
    assert d.endpoint_of("resp_a") == A


def test_a_report_never_rebinds_a_known_id_a_lookup_may() -> None:
    # A response id names one response, produced once: a second report naming it at another endpoint (a forged
    # facts record, a replay) is refused and counted; the endpoint that holds it keeps it. (main: the second
    # report moved the id, and the conversation's next turn went to an endpoint without it: 404 for an hour.)
    clock = Clock()
    d = ResponseDirectory(10, 60.0, clock=clock)
    assert d.learn("resp_1", A) and d.learn("resp_1", A)  # the same claim again: fine
    assert not d.learn("resp_1", B)
    assert d.endpoint_of("resp_1") == A and d.num_refused == 1 and d.holder("resp_1") == A
    assert d.learn("resp_1", B, by_lookup=True)  # a lookup asked the endpoints: the holder answered 200
    assert d.forget_endpoint(A) == 0 and d.endpoint_of("resp_1") == B
    clock.t += 61.0  # expired: a new claim is a new id's
    assert d.holder("resp_1") is None and d.learn("resp_1", A) and d.endpoint_of("resp_1") == A


def test_negative_cache_expires_and_learning_clears_it() -> None:
    clock = Clock()
    d = ResponseDirectory(10, 60.0, clock=clock)
    d.note_missing("resp_x")
    assert d.is_missing("resp_x")
    clock.t += NEGATIVE_TTL_S
    assert not d.is_missing("resp_x")
    d.note_missing("resp_y")
    d.learn("resp_y", A)
    assert not d.is_missing("resp_y")


# --- lookup against real HTTP endpoints ------------------------------------------------------------------


async def test_lookup_without_candidates_is_503() -> None:
    lk = ResponseLookup(ResponseDirectory(10, 60.0), timeout_s=0.5, max_in_flight=1)
    with pytest.raises(OpenAIError) as ei:
        await lk.resolve("resp_1", [])
    assert ei.value.status == 503


def test_needs_lookup_names_the_id() -> None:
    assert NeedsLookup("resp_9").response_id == "resp_9"
