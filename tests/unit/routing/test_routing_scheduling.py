"""Scorers, pickers and policies (routing/scheduling/)."""

from __future__ import annotations

import collections
import random

import pytest

from prefixroute.extproc.routing.prefix_index import PrefixIndex
from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.extproc.routing.scheduling import filters, pickers
from prefixroute.extproc.routing.scheduling import policies as policies_mod
from prefixroute.extproc.routing.scheduling.policies import POLICY_CLASSES, Policy, PolicyInput, PrefixPolicy, prefix_key
from prefixroute.extproc.routing.scheduling.scheduler import Scheduler
from prefixroute.extproc.routing.scheduling.scorers import (InFlightScorer, KvCacheScorer, PrefixScorer, QueueScorer,
                                                    ScoringContext, weighted_scores)
from prefixroute.extproc.routing.settings import POLICIES, RoutingSettings
from prefixroute.extproc.routing.types import BlockHash, EndpointId, EndpointState


def eps(n: int, **kw) -> list[EndpointState]:
    return [EndpointState(EndpointId(f"10.0.0.{i}:8000"), **kw) for i in range(n)]


def req(*blocks: int, model: str | None = None) -> InferenceRequest:
    return InferenceRequest(kind="chat", path="/v1/chat/completions", model=model,
                            block_hashes=[BlockHash(b) for b in blocks])


def chain(key: int, n: int = 8) -> InferenceRequest:
    """A request whose n blocks are unique to `key` (what distinct prompts hash to)."""
    return req(*[key * 1000 + i for i in range(n)])


E = eps(3)
A, B, C = (s.endpoint for s in E)


# --- filters ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("state,model,expected", [
    (EndpointState(A), "m", True),  # models unknown: eligible
    (EndpointState(A, models=frozenset({"m", "lora-x"})), "lora-x", True),
    (EndpointState(A, models=frozenset({"m"})), "other", False),
    (EndpointState(A, models=frozenset({"m"})), None, True),
])
def test_serves_model(state, model, expected):
    assert filters.serves_model(state, model) is expected
    assert (filters.eligible([state], model) == [state]) is expected


def test_eligible_drops_unhealthy_and_keeps_order():
    states = [EndpointState(A), EndpointState(B, healthy=False), EndpointState(C, models=frozenset({"x"}))]
    assert [s.endpoint for s in filters.eligible(states, "x")] == [A, C]
    assert [s.endpoint for s in filters.eligible(states, "y")] == [A]


# --- scorers ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scorer,states,in_flight,matches,total,expected", [
    (PrefixScorer(), E, {}, {A: 4, B: 2}, 8, [0.5, 0.25, 0.0]),
    (PrefixScorer(), E, {}, {A: 8}, 8, [1.0, 0.0, 0.0]),
    (PrefixScorer(), E, {}, {}, 0, [0.0, 0.0, 0.0]),
    (InFlightScorer(), E, {A: 0, B: 16, C: 40}, {}, 0, [1.0, 0.5, 0.0]),
    (InFlightScorer(), E, {}, {}, 0, [1.0, 1.0, 1.0]),
    (QueueScorer(), [EndpointState(A, num_requests_waiting=0), EndpointState(B, num_requests_waiting=4),
                     EndpointState(C)], {}, {}, 0, [1.0, 0.75, 0.5]),
    (QueueScorer(), [EndpointState(A, num_requests_waiting=100)], {}, {}, 0, [0.0]),
    (KvCacheScorer(), [EndpointState(A, kv_cache_usage_ratio=0.0), EndpointState(B, kv_cache_usage_ratio=0.9),
                       EndpointState(C)], {}, {}, 0, [1.0, 0.1, 0.5]),
    (KvCacheScorer(), [EndpointState(A, kv_cache_usage_ratio=1.5)], {}, {}, 0, [0.0]),
])
def test_scorer(scorer, states, in_flight, matches, total, expected):
    ctx = ScoringContext(in_flight=in_flight, matches=matches, total_blocks=total, concurrency_threshold=32,
                         queue_scale=16)
    got = scorer.score(ctx, states)
    assert got == pytest.approx(expected)
    assert all(0.0 <= v <= 1.0 for v in got)


def test_weighted_scores_sum_and_skip_zero_weights():
    ctx = ScoringContext(in_flight={A: 16}, matches={A: 8}, total_blocks=8)
    got = weighted_scores(ctx, E[:2], [(PrefixScorer(), 3.0), (InFlightScorer(), 2.0), (QueueScorer(), 0.0)])
    assert got == pytest.approx([3.0 + 1.0, 0.0 + 2.0])


# --- pickers ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scores,in_flight,expected_first", [
    ([1.0, 2.0, 0.5], {}, B),
    ([2.0, 2.0, 0.5], {A: 3, B: 1}, B),  # tie on score -> fewer in flight
    ([2.0, 2.0 + 1e-12, 0.5], {A: 0, B: 1}, A),  # float noise is a tie
    ([2.0, 2.0, 2.0], {A: 1, B: 1, C: 0}, C),
])
def test_max_score_order(scores, in_flight, expected_first):
    order = pickers.max_score_order(E, scores, in_flight, random.Random(0), 3)
    assert order[0] == expected_first
    assert sorted(order) == sorted([A, B, C])


def test_full_ties_are_broken_randomly_not_by_position():
    rng = random.Random(7)
    firsts = collections.Counter(pickers.max_score_order(E, [1.0, 1.0, 1.0], {}, rng, 1)[0] for _ in range(3000))
    assert set(firsts) == {A, B, C}
    assert min(firsts.values()) > 800


def test_rendezvous_moves_only_the_share_of_a_changed_endpoint():
    pool = eps(10)
    keys = list(range(5000))
    before = {k: pickers.rendezvous_order(k, pool, 1)[0] for k in keys}
    removed = pool[3].endpoint
    after_remove = {k: pickers.rendezvous_order(k, pool[:3] + pool[4:], 1)[0] for k in keys}
    moved = [k for k in keys if before[k] != after_remove[k]]
    assert all(before[k] == removed for k in moved)  # only the removed endpoint's keys move
    assert set(moved) == {k for k in keys if before[k] == removed}
    added = pool + eps(11)[10:]
    after_add = {k: pickers.rendezvous_order(k, added, 1)[0] for k in keys}
    moved_add = [k for k in keys if before[k] != after_add[k]]
    assert all(after_add[k] == added[10].endpoint for k in moved_add)
    assert 0.5 / 11 < len(moved_add) / len(keys) < 1.5 / 11  # about 1/N moves


def test_rendezvous_is_deterministic_and_top_k_is_a_prefix_of_the_order():
    pool = eps(20)
    full = pickers.rendezvous_order(12345, pool)
    assert pickers.rendezvous_order(12345, list(reversed(pool)), 3) == full[:3]


# --- policies --------------------------------------------------------------------------------------------------
def sched(policy: str = "prefix", *, track_prefill: bool = False, **kw) -> Scheduler:
    return Scheduler(RoutingSettings(policy=policy, rng_seed=1, **kw), track_prefill=track_prefill)


def test_cold_prefix_is_placed_by_rendezvous_and_then_has_affinity():
    s, idx = sched(), PrefixIndex(1000)
    r = chain(42, 40)
    d = s.schedule(r, E, {}, idx)
    key = prefix_key(r, s.settings.cold_key_blocks)
    assert d.reason == "cold"
    assert list(d.endpoints) == pickers.rendezvous_order(key, E)[:3]
    idx.record(r.block_hashes, d.endpoints[0])
    d2 = s.schedule(r, E, {d.endpoints[0]: 2}, idx)  # under the balance limit (1.5 x mean 0.67 + 4 slack)
    assert (d2.reason, d2.endpoints[0], d2.matched_blocks, d2.predicted_hit_ratio) == ("affinity", d.endpoints[0], 40,
                                                                                       1.0)


def test_requests_sharing_a_system_prompt_converge_cold():
    # same first cold_key_blocks blocks, different tails, each seen by a fresh router (replicas, or a restart):
    # every one is cold yet lands together
    firsts = {sched().schedule(req(1, 2, 3, 4, 100 + i, 200 + i), E, {}, PrefixIndex(10)).endpoints[0]
              for i in range(20)}
    assert len(firsts) == 1


def test_cold_placement_skips_endpoints_over_threshold():
    s, idx = sched(concurrency_threshold=4), PrefixIndex(1000)
    r = chain(5)
    first = s.schedule(r, E, {}, idx).endpoints[0]
    d = s.schedule(r, E, {first: 4}, idx)
    assert d.reason == "cold" and d.endpoints[0] != first and d.endpoints[-1] == first


def test_spill_over_threshold_then_spread_over_two():
    s, idx = sched(concurrency_threshold=4), PrefixIndex(1000)
    r = chain(9, 40)  # 640 tokens: worth more than a load difference of one request (64 tokens)
    idx.record(r.block_hashes, A)
    d = s.schedule(r, E, {A: 4}, idx)
    assert d.reason == "spill" and d.endpoints[0] != A and A in d.endpoints
    idx.record(r.block_hashes, d.endpoints[0])  # the router records the spill target
    second = d.endpoints[0]
    d2 = s.schedule(r, E, {A: 4, second: 1}, idx)
    assert (d2.reason, d2.endpoints[0]) == ("affinity", second)
    d3 = s.schedule(r, E, {A: 2, second: 3}, idx)
    assert (d3.reason, d3.endpoints[0]) == ("affinity", A)  # both hold it now: the less loaded wins


def test_all_over_threshold_still_prefers_affinity():
    s, idx = sched(concurrency_threshold=2), PrefixIndex(1000)
    r = chain(3)
    idx.record(r.block_hashes, B)
    d = s.schedule(r, E, {A: 2, B: 3, C: 2}, idx)
    assert (d.reason, d.endpoints[0]) == ("affinity", B)


# Cost model: an endpoint saves 16 tokens (64 chars / 4) per matched block and costs 64 tokens per in-flight
# request (defaults). Rows: blocks held by A, blocks in the prompt, in-flight on A, B, C -> expected primary.
@pytest.mark.parametrize("held,total,a,b,c,expected", [
    (40, 40, 3, 0, 0, A),  # 640 tokens saved > 3 x 64 of extra load
    (40, 40, 7, 0, 0, A),  # 7 <= 1.5 x 2.33 + 4 (balance_slack) = 7.5 and 640 > 7 x 64: stays on its cache
    (40, 40, 9, 0, 0, B),  # 9 > 1.5 x 3 + 4 = 8.5: over the adaptive limit (far under 32) though 640 > 9 x 64
    (40, 40, 9, 6, 6, A),  # loaded fleet: 9 <= 1.5 x 7 + 4, and 640 > 3 x 64
    (40, 40, 13, 2, 2, B),  # 13 > 1.5 x 5.67 + 4 = 12.5: over the adaptive limit
    (8, 40, 0, 0, 0, A),  # a short shared part still wins at equal load (tokens saved, nothing lost)
    (8, 40, 3, 0, 0, B),  # ... but not against 3 requests of load: 128 tokens saved < 192
    (2, 40, 1, 0, 0, B),  # 32 tokens saved < one request of load
])
def test_affinity_is_priced_against_load(held, total, a, b, c, expected):
    s, idx = sched(), PrefixIndex(1000)
    r = chain(1, total)
    idx.record(r.block_hashes[:held], A)
    d = s.schedule(r, E, {A: a, B: b, C: c}, idx)
    if expected == A:
        assert (d.endpoints[0], d.reason, d.matched_blocks) == (A, "affinity", held)
    else:  # B and C are equivalent: not A, and the cheaper of them (tie -> random)
        assert d.endpoints[0] != A and d.reason in ("spill", "load")


def test_prompt_without_blocks_goes_by_load():
    d = sched().schedule(req(), E, {A: 3, B: 0, C: 1}, PrefixIndex(10))
    assert (d.reason, d.endpoints) == ("load", (B, C, A))


def test_balance_of_many_cold_prefixes():
    """No endpoint gets much more than its share of distinct new prefixes (no hot spot at equal load)."""
    s, idx = sched(), PrefixIndex(100_000)
    pool = eps(8)
    counts = collections.Counter()
    for key in range(4000):
        r = chain(key, 4)
        d = s.schedule(r, pool, {}, idx)
        idx.record(r.block_hashes, d.endpoints[0])
        counts[d.endpoints[0]] += 1
    assert len(counts) == 8
    assert max(counts.values()) < 1.15 * 4000 / 8
    assert min(counts.values()) > 0.85 * 4000 / 8


def test_hot_prefix_spreads_under_concurrency():
    """One prefix at 3x one endpoint's threshold of concurrency ends up on >= 3 endpoints."""
    s, idx = sched(concurrency_threshold=8), PrefixIndex(1000)
    pool = eps(6)
    in_flight: collections.Counter = collections.Counter()
    r = chain(77)
    for _ in range(24):
        d = s.schedule(r, pool, in_flight, idx)
        idx.record(r.block_hashes, d.endpoints[0])
        in_flight[d.endpoints[0]] += 1
    assert max(in_flight.values()) <= 8
    assert len(in_flight) >= 3


def test_fallbacks_are_distinct_eligible_and_bounded():
    pool = eps(6)
    pool[2] = EndpointState(pool[2].endpoint, healthy=False)
    for policy in ("prefix", "consistent-hash", "least-load", "round-robin", "random"):
        for nf in (0, 2, 10):
            s = sched(policy, num_fallbacks=nf)
            d = s.schedule(chain(3), pool, {}, PrefixIndex(100))
            assert len(d.endpoints) == min(1 + nf, 5)
            assert len(set(d.endpoints)) == len(d.endpoints)
            assert pool[2].endpoint not in d.endpoints


def test_no_eligible_endpoint_gives_an_empty_decision():
    d = sched().schedule(req(1, 2, model="x"), [EndpointState(A, models=frozenset({"y"}))], {}, PrefixIndex(10))
    assert d.endpoints == ()


def test_round_robin_cycles_in_pool_order():
    s = sched("round-robin", num_fallbacks=1)
    got = [s.schedule(chain(1), E, {}, PrefixIndex(10)).endpoints for _ in range(4)]
    assert got == [(A, B), (B, C), (C, A), (A, B)]


def test_random_policy_uses_every_endpoint():
    s = sched("random", num_fallbacks=0)
    seen = collections.Counter(s.schedule(chain(1), E, {}, PrefixIndex(10)).endpoints[0] for _ in range(600))
    assert set(seen) == {A, B, C} and min(seen.values()) > 120


def test_least_load_policy():
    s = sched("least-load")
    states = [EndpointState(A, num_requests_waiting=5), EndpointState(B, num_requests_waiting=0), EndpointState(C)]
    d = s.schedule(chain(1), states, {A: 1, B: 1, C: 2}, PrefixIndex(10))
    assert (d.reason, d.endpoints) == ("load", (B, A, C))


def test_consistent_hash_ignores_load_and_threshold():
    s, idx = sched("consistent-hash", concurrency_threshold=1), PrefixIndex(10)
    r = chain(11)
    first = s.schedule(r, E, {}, idx).endpoints[0]
    assert s.schedule(r, E, {first: 100}, idx).endpoints[0] == first


def test_scheduler_ignores_index_entries_of_ineligible_endpoints():
    s, idx = sched(), PrefixIndex(100)
    r = chain(4)
    idx.record(r.block_hashes, A)
    states = [EndpointState(A, healthy=False), EndpointState(B), EndpointState(C)]
    d = s.schedule(r, states, {}, idx)
    assert d.reason == "cold" and A not in d.endpoints


# --- large pools: scoring a sample ------------------------------------------------------------------------------
def test_large_pool_keeps_affinity_and_spreads_new_load():
    s, idx = sched(max_scored_endpoints=8), PrefixIndex(1000)
    pool = eps(100)
    r = chain(21, 40)
    holder = pool[57].endpoint
    idx.record(r.block_hashes, holder)
    for _ in range(50):  # the holder is always among the scored endpoints
        assert s.schedule(r, pool, {holder: 2}, idx).endpoints[0] == holder
    # prompts without blocks go by load among a random window: over many picks every endpoint is used
    picks = collections.Counter(s.schedule(req(), pool, {}, idx).endpoints[0] for _ in range(3000))
    assert len(picks) == 100 and max(picks.values()) < 4 * 3000 / 100


def test_large_pool_avoids_loaded_endpoints():
    s, idx = sched(max_scored_endpoints=16), PrefixIndex(1000)
    pool = eps(200)
    busy = {e.endpoint: 20 for e in pool[:190]}  # only 10 idle endpoints
    firsts = [s.schedule(req(), pool, busy, idx).endpoints[0] for _ in range(300)]
    # a window of 16 contains an idle endpoint about half the time; with none, the least loaded of the window
    idle_ratio = sum(ep not in busy for ep in firsts) / len(firsts)
    assert idle_ratio > 0.3


def test_more_holders_than_the_sample_limit_are_all_scored():
    s, idx = sched(max_scored_endpoints=4), PrefixIndex(1000)
    pool = eps(40)
    r = chain(8, 10)
    for e in pool[:10]:
        idx.record(r.block_hashes[:5], e.endpoint)
    best = pool[33].endpoint
    idx.record(r.block_hashes, best)
    d = s.schedule(r, pool, {}, idx)
    assert (d.endpoints[0], d.reason, d.matched_blocks) == (best, "affinity", 10)


def test_spill_in_a_large_pool_skips_the_over_threshold_holder():
    s, idx = sched(max_scored_endpoints=4, concurrency_threshold=2), PrefixIndex(1000)
    pool = eps(30)
    r = chain(2)
    holder = pool[5].endpoint
    idx.record(r.block_hashes, holder)
    d = s.schedule(r, pool, {holder: 2}, idx)
    assert d.reason == "spill" and d.endpoints[0] != holder


def test_prefix_policy_breaks_ties_by_load_then_randomly():
    s, idx = sched(queue_cost_tokens=0.0, kv_cost_tokens=0.0, load_cost_tokens=0.0), PrefixIndex(1000)
    r = chain(6)
    idx.record(r.block_hashes, A)
    idx.record(r.block_hashes, B)  # A and B hold the whole prompt: equal prefix scores, load not weighted
    assert s.schedule(r, E, {A: 3, B: 1}, idx).endpoints[:2] == (B, A)
    firsts = collections.Counter(s.schedule(r, E, {A: 2, B: 2}, idx).endpoints[0] for _ in range(400))
    assert set(firsts) == {A, B} and min(firsts.values()) > 120


@pytest.mark.parametrize("change", ["remove", "add"])
def test_cold_placement_moves_only_the_changed_endpoints_share(change):
    # a fresh router per decision: no load and no share history, so placement is rendezvous alone
    pool = eps(10)
    after_pool = pool[:9] if change == "remove" else eps(11)
    changed = pool[9].endpoint if change == "remove" else after_pool[10].endpoint
    moved = 0
    for key in range(3000):
        r = chain(key, 5)
        before = sched().schedule(r, pool, {}, PrefixIndex(10)).endpoints[0]
        after = sched().schedule(r, after_pool, {}, PrefixIndex(10)).endpoints[0]
        if before != after:
            moved += 1
            assert changed in (before, after)  # only prefixes of the changed endpoint move
    share = 1 / (10 if change == "remove" else 11)
    assert 0.6 * share < moved / 3000 < 1.4 * share


# --- balance: adaptive limit, share limit, bounded-load cold placement ------------------------------------------
@pytest.mark.parametrize("in_flight,num_eligible,threshold,slack,expected", [
    ({}, 4, 32, None, 5),  # idle fleet, default slack 4: the slack alone (over = more than 4 in flight)
    ({A: 4}, 4, 32, None, 6),  # mean 1: 1.5 + 4 = 5.5 -> 6 or more is over
    ({A: 10, B: 10, C: 10}, 3, 32, None, 20),  # mean 10: 19 allowed
    ({}, 4, 32, 2.0, 3),  # slack 2: over = more than 2 in flight
    ({A: 4}, 4, 32, 2.0, 4),  # mean 1: 1.5 + 2 = 3.5 -> 4 or more is over
    ({A: 10, B: 10, C: 10}, 3, 32, 2.0, 18),  # mean 10: 17 allowed
    ({A: 40, B: 40, C: 40}, 3, 32, None, 32),  # the fixed threshold caps the adaptive limit
])
def test_balance_limit(in_flight, num_eligible, threshold, slack, expected):
    from prefixroute.extproc.routing.scheduling.policies import PolicyInput

    extra = {} if slack is None else {"balance_slack": slack}
    policy = sched(concurrency_threshold=threshold, **extra).policy
    inp = PolicyInput(request=chain(1), eligible=eps(num_eligible), in_flight=in_flight, matches={})
    assert policy.balance_limit(inp) == expected


def _drive(s: Scheduler, prompts, pool, lifetime: int) -> tuple[collections.Counter, float]:
    """Route `prompts` in order, recording each pick; a request stays in flight for `lifetime` later picks.
    Returns (picks per endpoint, share of prompt blocks the primary held)."""
    idx = PrefixIndex(100_000)
    in_flight: collections.Counter = collections.Counter()
    live: collections.deque = collections.deque()
    counts: collections.Counter = collections.Counter()
    held = total = 0
    for r in prompts:
        d = s.schedule(r, pool, in_flight, idx)
        idx.record(r.block_hashes, d.endpoints[0])
        counts[d.endpoints[0]] += 1
        held += d.matched_blocks
        total += d.total_blocks
        in_flight[d.endpoints[0]] += 1
        live.append(d.endpoints[0])
        while len(live) > lifetime:
            in_flight[live.popleft()] -= 1
    return counts, held / total


@pytest.mark.parametrize("lifetime", [6, 24])
def test_hot_prefix_spills_and_balance_stays_within_1_5x_fair(lifetime):
    """Half the traffic is one long prefix, the rest 15 others: the old fixed threshold (32 in flight) kept the
    hot one on one endpoint (2x fair on 4); the share and in-flight limits spread it, affinity stays high."""
    rng = random.Random(3)
    pool = eps(4)
    prompts = [chain(0 if rng.random() < 0.5 else rng.randrange(1, 16), 40) for _ in range(2000)]
    counts, held_ratio = _drive(sched(), prompts, pool, lifetime)
    assert max(counts.values()) <= 1.5 * 2000 / 4
    assert held_ratio > 0.9  # only spills recompute: a few per endpoint, not per request


@pytest.mark.parametrize("lifetime", [6])
def test_short_shared_prefix_does_not_pull_new_sessions_to_one_endpoint(lifetime):
    """Every session starts with the same 16-block system prompt, then 24 blocks of its own: the endpoint
    holding the system prompt saves 256 tokens per new session, which must not attract all of them."""
    system = [BlockHash(9_000_000 + i) for i in range(16)]
    prompts = [req(*system, *[key * 1000 + i for i in range(24)]) for key in range(1, 201)]
    counts, _ = _drive(sched(), prompts, eps(4), lifetime)
    # (at zero load an endpoint may stay unused: three holders of the system prompt at <= 1.5x fair each save
    # its 256 tokens, and nothing is queued anywhere)
    assert len(counts) >= 3 and max(counts.values()) <= 1.5 * 200 / 4


def test_sequential_requests_of_one_prefix_keep_affinity_at_zero_load():
    """Requests one at a time (nothing in flight): an idle endpoint cannot make a request wait, so its recent
    share does not move the prefix off its cache (the share limit acts only on busy endpoints)."""
    s, idx = sched(), PrefixIndex(1000)
    r = chain(5, 40)
    firsts = []
    for _ in range(40):
        d = s.schedule(r, E, {}, idx)
        idx.record(r.block_hashes, d.endpoints[0])
        firsts.append(d.endpoints[0])
    assert len(set(firsts)) == 1


def test_share_limit_moves_a_prefix_off_a_busy_endpoint():
    """The same sequence while every endpoint is busy (one request in flight each): the holder's recent
    share spills the prefix to a second endpoint, then more, within 1.5x fair."""
    s, idx = sched(), PrefixIndex(1000)
    r = chain(5, 40)
    firsts = []
    for _ in range(40):
        d = s.schedule(r, E, {A: 1, B: 1, C: 1}, idx)
        idx.record(r.block_hashes, d.endpoints[0])
        firsts.append(d.endpoints[0])
    assert len(set(firsts[:6])) == 1  # warm-up: affinity
    assert len(set(firsts)) > 1 and max(collections.Counter(firsts).values()) <= 1.5 * 40 / 3 + 1


def test_cold_placement_skips_a_loaded_rendezvous_winner_for_one_at_or_under_the_mean():
    s = sched()
    r = chain(77)
    order = pickers.rendezvous_order(prefix_key(r, s.settings.cold_key_blocks), E)
    # the HRW winner has 2 in flight, the mean is 1: the next in HRW order that is at or under the mean wins
    d = s.schedule(r, E, {order[0]: 2, order[1]: 1, order[2]: 0}, PrefixIndex(10))
    assert (d.reason, d.endpoints) == ("cold", (order[1], order[2], order[0]))
    # at equal load it is plain rendezvous
    d = sched().schedule(r, E, {A: 1, B: 1, C: 1}, PrefixIndex(10))
    assert list(d.endpoints) == order


# --- outstanding prefill tokens (track_prefill) -----------------------------------------------------------------
# Defaults: 4 characters per token, 16 tokens per block.
@pytest.mark.parametrize("prompt_chars,matched,expected_tokens", [
    (4000, 0, 1000.0),  # nothing cached: the whole prompt
    (4000, 10, 840.0),  # 10 blocks x 16 tokens cached
    (4000, 256, 0.0),  # a match longer than the prompt estimate never goes negative
    (0, 0, 0.0),
])
def test_prefill_tokens_are_added_at_pick_and_removed_at_release(prompt_chars, matched, expected_tokens):
    s, idx = sched(track_prefill=True), PrefixIndex(1000)
    r = chain(7, 256)
    r = InferenceRequest(kind="chat", path="/v1/chat/completions", block_hashes=r.block_hashes,
                         num_prompt_chars=prompt_chars)
    idx.record(r.block_hashes[:matched], A)
    d = s.schedule(r, E, {}, idx)
    assert d.matched_blocks == matched and (d.endpoints[0] == A or not matched)
    other = InferenceRequest(kind="chat", path="/v1/chat/completions", block_hashes=chain(8).block_hashes,
                             num_prompt_chars=400)
    d_other = s.schedule(other, E, {}, idx)
    before = s.policy.outstanding_prefill_tokens()
    expected = collections.Counter({d.endpoints[0]: expected_tokens})
    expected[d_other.endpoints[0]] += 100.0
    assert before == {ep: t for ep, t in expected.items() if t > 0}
    s.policy.on_release(r, d)
    s.policy.on_release(other, d_other)
    assert s.policy.outstanding_prefill_tokens() == {}
    s.policy.on_release(other, d_other)  # a release without a pick leaves nothing negative
    assert s.policy.outstanding_prefill_tokens() == {}


def test_prefill_is_not_counted_without_track_prefill():
    s = sched()
    r = InferenceRequest(kind="chat", path="/v1/chat/completions", block_hashes=chain(1).block_hashes,
                         num_prompt_chars=4000)
    d = s.schedule(r, E, {}, PrefixIndex(1000))
    s.policy.on_release(r, d)
    assert s.policy.outstanding_prefill_tokens() == {}


@pytest.mark.parametrize("track,first_prefill,expected_first", [
    (False, 100_000.0, True),  # requests alone: equal in-flight -> plain rendezvous
    (True, 100_000.0, False),  # its outstanding prefill is over the mean: the next light endpoint in HRW order
    (True, 0.0, True),  # nothing outstanding there: rendezvous
])
def test_cold_placement_bounds_outstanding_prefill_tokens(track, first_prefill, expected_first):
    pool = eps(4)
    r = chain(42)
    hrw = pickers.rendezvous_order(prefix_key(r, 4), pool)
    s = sched(track_prefill=track)
    # earlier picks left prefill outstanding: a long prompt on the rendezvous-first endpoint (or none), a
    # short one elsewhere, all at one request in flight each
    if track:
        s.policy._prefill.update({hrw[0]: first_prefill, hrw[1]: 500.0, hrw[2]: 500.0, hrw[3]: 500.0})
    d = s.schedule(r, pool, {ep: 1 for ep in hrw}, PrefixIndex(1000))
    assert d.reason == "cold"
    assert (d.endpoints[0] == hrw[0]) is expected_first
    if not expected_first:
        assert d.endpoints[0] == hrw[1]


# --- per-snapshot memo and vectorised rendezvous ----------------------------------------------------------------
@pytest.mark.parametrize("num_endpoints", [1, 5, pickers.RendezvousTable.SMALL + 1, 200])  # Python / numpy
def test_rendezvous_table_weights_equal_the_scalar_weight(num_endpoints):
    pool = [EndpointState(EndpointId(f"10.2.{i // 200}.{i % 200}:8000")) for i in range(num_endpoints)]
    table = pickers.RendezvousTable(pool)
    rnd = random.Random(3)
    for key in [0, 1, 2**64 - 1] + [rnd.getrandbits(64) for _ in range(50)]:
        assert table.weights(key).tolist() == [pickers.hrw_weight(key, s.endpoint) for s in pool]
        by_weight = sorted(pool, key=lambda s: pickers.hrw_weight(key, s.endpoint), reverse=True)
        assert [s.endpoint for s in table.ranked(key)] == [s.endpoint for s in by_weight]


def test_eligible_memo_is_kept_per_snapshot_object_and_rebuilt_when_it_changes():
    cache = filters.EligibleCache()
    snap = tuple(eps(4)) + (EndpointState(EndpointId("10.0.0.9:8000"), healthy=False),)
    v = cache.view(snap, "m")
    assert cache.view(snap, "m") is v and cache.view(snap, None) is not v
    assert v.endpoints == tuple(filters.eligible(snap, "m")) and len(v.endpoints) == 4
    equal_copy = snap[:2] + snap[2:]  # same content, new object: what the pool publishes after a scrape
    assert cache.view(equal_copy, "m") is not v
    changed = snap[:1] + (EndpointState(snap[1].endpoint, healthy=False),) + snap[2:]
    assert [s.endpoint for s in cache.view(changed, "m").endpoints] == [A, C, EndpointId("10.0.0.3:8000")]
    as_list = list(snap)  # a list may be changed in place: never memoised
    assert cache.view(as_list, "m") is not cache.view(as_list, "m")


class _ReferencePrefixPolicy(PrefixPolicy):
    """The prefix policy with the cold placement as it was before the table: one full rendezvous sort per group."""

    def _cold_order(self, inp, candidates, rest, mean_in_flight):
        k = self._k
        key = prefix_key(inp.request, self._settings.cold_key_blocks)
        if inp.in_flight:
            get = inp.in_flight.get
            bound = self._settings.cold_balance_factor * mean_in_flight
            light = [s for s in candidates if get(s.endpoint, 0) <= bound]
            if self._prefill and len(light) > 1:
                pbound = self._settings.cold_balance_factor * sum(self._prefill.values()) / len(inp.eligible)
                light = [s for s in light if self._prefill.get(s.endpoint, 0.0) <= pbound] or light
            if light and len(light) < len(candidates):
                order = pickers.rendezvous_order(key, light, k)
                if len(order) < k:
                    heavy = [s for s in candidates if get(s.endpoint, 0) > bound]
                    order += pickers.rendezvous_order(key, heavy, k - len(order))
                if len(order) < k and rest:
                    order += pickers.rendezvous_order(key, rest, k - len(order))
                return order
        order = pickers.rendezvous_order(key, candidates, k)
        if len(order) < k and rest:
            order += pickers.rendezvous_order(key, rest, k - len(order))
        return order


def _reference_schedule(policy, request, endpoints, in_flight, index):
    """Scheduler.schedule as it was before the memo: filters per request, no view."""
    eligible = filters.eligible(list(endpoints), request.model)
    if not eligible:
        return None
    matches = index.match(request.block_hashes) if request.block_hashes else {}
    holders = [s for s in eligible if s.endpoint in matches]
    matches = {s.endpoint: matches[s.endpoint] for s in holders}
    return policy.decide(PolicyInput(request=request, eligible=eligible, in_flight=in_flight, matches=matches,
                                     holders=holders))


@pytest.mark.parametrize("seed,num_endpoints,policy,track", [
    (1, 4, "prefix", False), (2, 40, "prefix", False), (3, 300, "prefix", False), (4, 40, "prefix", True),
    (5, 40, "consistent-hash", False), (6, 40, "round-robin", False), (7, 40, "least-load", False),
])
def test_memoised_decisions_equal_the_per_request_path_on_random_snapshots(seed, num_endpoints, policy, track):
    rnd = random.Random(seed)
    settings = RoutingSettings(policy=policy, rng_seed=seed, max_scored_endpoints=16)
    fast = Scheduler(settings, track_prefill=track)
    ref_policy = (_ReferencePrefixPolicy if policy == "prefix" else POLICY_CLASSES[policy])(
        settings, random.Random(seed), track_prefill=track)
    fast_index, ref_index = PrefixIndex(200), PrefixIndex(200)
    names = [EndpointId(f"10.1.{i // 200}.{i % 200}:8000") for i in range(num_endpoints)]
    snap: tuple[EndpointState, ...] = ()
    for step in range(600):
        if step % 25 == 0:  # a scrape lands: a new snapshot object (health and models change too)
            snap = tuple(EndpointState(n, healthy=rnd.random() > 0.15,
                                       models=rnd.choice([frozenset(), frozenset({"m"}), frozenset({"x"})]),
                                       num_requests_waiting=rnd.choice([None, 0, 3, 20]),
                                       kv_cache_usage_ratio=rnd.choice([None, 0.1, 0.9]))
                         for n in names if rnd.random() > 0.05)
        r = chain(rnd.randrange(40), rnd.choice([0, 1, 6]))
        r.model = rnd.choice([None, "m", "m", "x", "y"])
        if rnd.random() < 0.3:  # loads 0, 2, 4 over the eligible endpoints: some exactly at the mean (bounds)
            el = filters.eligible(snap, r.model)
            cut = len(el) - len(el) % 3
            in_flight = {s.endpoint: (2 * (i % 3) if i < cut else 2) for i, s in enumerate(el)}
        else:
            in_flight = {n: rnd.choice([0, 0, 1, 2, 5, 40]) for n in names if rnd.random() > 0.3}
        got = fast.schedule(r, snap, in_flight, fast_index)
        want = _reference_schedule(ref_policy, r, snap, in_flight, ref_index)
        if want is None:
            assert got.endpoints == ()
            continue
        assert got == want, step
        if got.endpoints and r.block_hashes:
            fast_index.record(r.block_hashes, got.endpoints[0])
            ref_index.record(r.block_hashes, want.endpoints[0])
        if track and rnd.random() < 0.5:
            fast.policy.on_release(r, got)
            ref_policy.on_release(r, want)


# --- the policy registry ---------------------------------------------------------------------------------------
def test_every_declared_policy_has_one_class_and_every_policy_class_is_declared():
    assert list(POLICY_CLASSES) == list(POLICIES)
    for name, cls in POLICY_CLASSES.items():
        assert issubclass(cls, Policy) and cls.name == name
    defined = {obj for obj in vars(policies_mod).values()
               if isinstance(obj, type) and issubclass(obj, Policy) and obj is not Policy}
    assert defined == set(POLICY_CLASSES.values())


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_decides_within_the_contract(name):
    s = sched(name, num_fallbacks=2)
    pool = eps(5)
    for key in range(20):
        d = s.schedule(chain(key), pool, {pool[key % 5].endpoint: 3}, PrefixIndex(100))
        assert d.policy == name
        assert len(d.endpoints) == 3 == len(set(d.endpoints))
        assert set(d.endpoints) <= {e.endpoint for e in pool}
