"""Filters, pickers and policies (routing/scheduling/); the time model itself: test_routing_timemodel.py."""

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
from prefixroute.extproc.routing.settings import POLICIES, RoutingSettings
from prefixroute.types import BlockHash, EndpointId, EndpointState


def eps(n: int, **kw) -> list[EndpointState]:
    return [EndpointState(EndpointId(f"10.0.0.{i}:8000"), **kw) for i in range(n)]


def req(*blocks: int, model: str | None = None) -> InferenceRequest:
    """A prompt of exactly these blocks (64 characters each, the default block size)."""
    return InferenceRequest(kind="chat", path="/v1/chat/completions", model=model,
                            block_hashes=[BlockHash(b) for b in blocks], num_prompt_chars=64 * len(blocks))


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


# --- pickers ---------------------------------------------------------------------------------------------------
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
    assert d.endpoints[0] == pickers.rendezvous_order(key, E)[0] and len(set(d.endpoints)) == 3
    idx.record(r.block_hashes, d.endpoints[0])
    d2 = s.schedule(r, E, {d.endpoints[0]: 2}, idx)  # 2 decoding there cost far less than 640 tokens of prefill
    assert (d2.reason, d2.endpoints[0], d2.matched_blocks, d2.predicted_hit_ratio) == ("affinity", d.endpoints[0], 40,
                                                                                       1.0)


def test_requests_sharing_a_system_prompt_converge_cold():
    # same first cold_key_blocks blocks, different tails, each seen by a fresh router (replicas, or a restart):
    # every one is cold yet lands together
    firsts = {sched().schedule(req(1, 2, 3, 4, 100 + i, 200 + i), E, {}, PrefixIndex(10)).endpoints[0]
              for i in range(20)}
    assert len(firsts) == 1


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


def test_consistent_hash_ignores_load():
    s, idx = sched("consistent-hash"), PrefixIndex(10)
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
    # prompts without blocks go by load among a random sample: as picks add load, every endpoint is used
    in_flight: collections.Counter = collections.Counter()
    picks = collections.Counter()
    for _ in range(300):
        ep = s.schedule(req(), pool, in_flight, idx).endpoints[0]
        in_flight[ep] += 1
        picks[ep] += 1
    assert len(picks) >= 90 and max(picks.values()) <= 6


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


def test_spill_in_a_large_pool_leaves_a_holder_whose_queue_outweighs_a_cold_prefill():
    s, idx = sched(max_scored_endpoints=4, track_prefill=True), PrefixIndex(1000)
    pool = eps(30)
    r = chain(2, 40)
    holder = pool[5].endpoint
    idx.record(r.block_hashes, holder)
    s.policy.model.add_pending("earlier", holder, 50_000.0)  # ~4 s of prefill queued there
    d = s.schedule(r, pool, {holder: 1}, idx)
    assert d.reason == "spill" and d.endpoints[0] != holder


def test_equal_holders_at_equal_load_split_by_rendezvous_and_the_less_loaded_wins():
    s, idx = sched(), PrefixIndex(1000)
    r = chain(6, 40)
    idx.record(r.block_hashes, A)
    idx.record(r.block_hashes, B)
    first = pickers.rendezvous_order(prefix_key(r, 4), [E[0], E[1]])[0]
    assert {s.schedule(r, E, {}, idx).endpoints[0] for _ in range(50)} == {first}
    other = B if first == A else A
    assert s.schedule(r, E, {first: 3}, idx).endpoints[0] == first  # 3 decoding: within the tie margin
    assert s.schedule(r, E, {first: 40}, idx).endpoints[0] == other  # 40 x 2 tokens per step: > 5% + 1 ms


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


def test_sequential_requests_of_one_prefix_keep_affinity_at_zero_load():
    """Requests one at a time (nothing in flight): an idle holder is always the fastest."""
    s, idx = sched(), PrefixIndex(1000)
    r = chain(5, 40)
    firsts = []
    for _ in range(40):
        d = s.schedule(r, E, {}, idx)
        idx.record(r.block_hashes, d.endpoints[0])
        firsts.append(d.endpoints[0])
    assert len(set(firsts)) == 1


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
    ref_policy = POLICY_CLASSES[policy](settings, random.Random(seed), track_prefill=track)
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
        if track and rnd.random() < 0.5 and isinstance(ref_policy, PrefixPolicy):
            fast.policy.learner.on_release(r, got)  # type: ignore[attr-defined]
            ref_policy.learner.on_release(r, want)


# --- the policy registry ---------------------------------------------------------------------------------------
def test_every_declared_policy_has_one_class_and_every_policy_class_is_declared():
    assert list(POLICY_CLASSES) == list(POLICIES)
    for name, cls in POLICY_CLASSES.items():
        assert issubclass(cls, Policy) and cls.name == name
    # Every concrete policy; `ScoredPolicy` is a base that composes a scorer (docs/extending.md), not a policy.
    defined = {obj for obj in vars(policies_mod).values()
               if isinstance(obj, type) and issubclass(obj, Policy) and obj not in (Policy, policies_mod.ScoredPolicy)}
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
