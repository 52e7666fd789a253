"""Placement under cache pressure (routing/scheduling/placement.py) on the real KV-events index and scheduler."""

from __future__ import annotations

import random

import pytest

from prefixroute.extproc.kv_events.index import KVEventIndex
from prefixroute.extproc.routing.hashing import hash_token_blocks, token_seed_for
from prefixroute.extproc.routing.index_sources import SourcedIndex
from prefixroute.extproc.routing.prefix_index import PrefixIndex
from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.extproc.routing.scheduling.placement import FrequencySketch
from prefixroute.extproc.routing.scheduling.scheduler import Scheduler
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.kv_events_wire import BlockRemoved, BlockStored
from prefixroute.types import EndpointId, EndpointState

BS = 16
A, B = EndpointId("10.0.0.1:8000"), EndpointId("10.0.0.2:8000")


def tokens(key: int, num_blocks: int) -> list[int]:
    return [key * 10_000 + i for i in range(num_blocks * BS)]


def stored(toks: list[int], salt: int) -> BlockStored:
    """One BlockStored of a whole prompt, with server hashes of its own (vLLM's are random)."""
    n = len(toks) // BS
    return BlockStored(block_hashes=[salt * 1_000_000 + i for i in range(n)], parent_block_hash=None,
                       token_ids=toks, block_size=BS, lora_id=None, medium="GPU")


def hashes(toks: list[int]) -> list:
    return hash_token_blocks(toks, BS, token_seed_for(None, None))


def request(toks: list[int]) -> InferenceRequest:
    return InferenceRequest(kind="chat", path="/v1/chat/completions", block_hashes=hashes(toks),
                            num_prompt_chars=4 * len(toks), num_prompt_tokens=len(toks))


# --- eviction order in the events index ------------------------------------------------------------------------
def test_eviction_order_follows_stores_tail_first_and_picks_and_forgets_removals():
    idx = KVEventIndex(BS)
    p, q = tokens(1, 3), tokens(2, 3)
    hp, hq = hashes(p), hashes(q)
    idx.apply_batch(A, type("B", (), {"events": [stored(p, 1), stored(q, 2)]})())
    # vLLM frees a request's blocks tail first: its last block goes first
    assert idx.lru_oldest(A, 6) == [*reversed(hp), *reversed(hq)]
    idx.touch(A, hp)  # a pick of p: its blocks become the most recently used, its first block last
    assert idx.lru_oldest(A, 6) == [*reversed(hq), *reversed(hp)]
    assert idx.lru_oldest(A, 2) == list(reversed(hq))[:2]
    idx.apply_batch(A, type("B", (), {"events": [BlockRemoved(block_hashes=[2_000_002], medium="GPU")]})())
    assert idx.lru_oldest(A, 6) == [hq[1], hq[0], *reversed(hp)]
    assert idx.num_held_blocks(A) == 5 and idx.match(hq) == {A: 2}  # touching changes no match
    idx.touch(B, hp)  # an endpoint never seen: nothing to do
    assert idx.lru_oldest(B, 3) == [] and idx.num_held_blocks(B) == 0


# --- the frequency sketch --------------------------------------------------------------------------------------
def test_sketch_never_undercounts_and_halves_every_window():
    rng = random.Random(7)
    sketch = FrequencySketch(width=1 << 8, window_requests=1000)  # small: collisions happen
    keys = [rng.getrandbits(64) for _ in range(300)]
    truth = {k: 0 for k in keys}
    for _ in range(200):
        used = rng.sample(keys, 20)
        sketch.add(used)
        for k in used:
            truth[k] += 1
    est = sketch.estimate(keys)
    assert all(e >= truth[k] for e, k in zip(est, keys))
    assert sum(e == truth[k] for e, k in zip(est, keys)) > 150  # exact for most despite 300 keys in 256 slots
    aged = FrequencySketch(width=1 << 12, window_requests=4)
    for _ in range(3):
        aged.add([keys[0]])
    assert aged.estimate([keys[0]])[0] == 3
    aged.add([keys[0]])  # the 4th request ends the window: 4 -> 2
    assert aged.estimate([keys[0]])[0] == 2
    with pytest.raises(ValueError):
        FrequencySketch(width=1000)


# --- placement through the scheduler ---------------------------------------------------------------------------
def _fleet(placement: str) -> tuple[Scheduler, SourcedIndex, tuple[EndpointState, ...]]:
    """Two full endpoints of 64 blocks: A holds a hot 64-block prompt, B two 32-block prompts nobody reused."""
    settings = RoutingSettings(tokenizer="sim", kv_block_tokens=BS, index_source="events", rng_seed=1,
                               placement_victims=placement, placement_victim_weight=1.0)
    events = KVEventIndex(BS)
    idx = SourcedIndex(PrefixIndex(1000), events, own_source="none", event_endpoints=[A, B])
    hot = tokens(1, 64)
    events.apply_batch(A, type("B", (), {"events": [stored(hot, 1)]})())
    events.apply_batch(B, type("B", (), {"events": [stored(tokens(2, 32), 2), stored(tokens(3, 32), 3)]})())
    pool = (EndpointState(A, num_gpu_blocks=64, block_size=BS), EndpointState(B, num_gpu_blocks=64, block_size=BS))
    sched = Scheduler(settings)
    for _ in range(4):  # the hot prompt is used again and again (the sketch counts it)
        assert sched.schedule(request(hot), pool, {}, idx).endpoints[0] == A
    return sched, idx, pool


@pytest.mark.parametrize("placement", ["all", "oneoff"])
def test_a_new_prompt_goes_where_it_evicts_blocks_nobody_reused(placement):
    sched, idx, pool = _fleet(placement)
    picks = [sched.schedule(request(tokens(100 + k, 32)), pool, {}, idx).endpoints[0] for k in range(12)]
    assert picks == [B] * 12
    # without placement the same new prompts are spread by rendezvous and load: some evict the hot prompt
    sched_off, idx_off, pool_off = _fleet("off")
    picks_off = [sched_off.schedule(request(tokens(100 + k, 32)), pool_off, {}, idx_off).endpoints[0]
                 for k in range(12)]
    assert A in picks_off


def test_oneoff_mode_leaves_a_prompt_seen_before_to_load():
    sched, idx, pool = _fleet("oneoff")
    sketch = sched.policy.placement.victims.sketch  # type: ignore[attr-defined]
    new = [sched.schedule(request(tokens(200 + k, 32)), pool, {}, idx).endpoints[0] for k in range(12)]
    assert new == [B] * 12  # never seen: placed where the victims are worth nothing
    for k in range(12):
        sketch.add(hashes(tokens(300 + k, 32)))  # seen before (and evicted since): placed as without placement
    again = [sched.schedule(request(tokens(300 + k, 32)), pool, {}, idx).endpoints[0] for k in range(12)]
    assert A in again


def test_free_blocks_are_no_victims():
    sched, idx, pool = _fleet("all")
    roomy = (EndpointState(A, num_gpu_blocks=1000, block_size=BS), EndpointState(B, num_gpu_blocks=64, block_size=BS))
    picks = [sched.schedule(request(tokens(100 + k, 32)), roomy, {}, idx).endpoints[0] for k in range(12)]
    assert A in picks  # A has room: placing there evicts nothing, B would (blocks worth 0): both are free


def test_placement_settings_are_validated():
    with pytest.raises(ValueError, match="placement_victims"):
        RoutingSettings(placement_victims="some")
    with pytest.raises(ValueError, match="placement_replica_weight"):
        RoutingSettings(placement_replica_weight=-1)


def test_a_replica_pays_for_the_blocks_it_duplicates():
    from prefixroute.extproc.routing.scheduling.placement import Placement
    from prefixroute.extproc.routing.timemodel import TimeModel
    settings = RoutingSettings(kv_block_tokens=BS, placement_replica_weight=2.0)
    model = TimeModel(12_800.0)
    placement = Placement(settings, model)
    a, b = EndpointState(A), EndpointState(B)
    block_s = BS / 12_800.0
    # B is predicted 10 ms faster, but would duplicate the 40 blocks A holds: 2 x 40 x 1.25 ms = 100 ms more
    scored = [(0.50, 0.50, b, 32 * BS, 0), (0.51, 0.51, a, 0.0, 0)]
    out = placement.adjust(request(tokens(1, 40)), scored, {A: 40}, None)
    assert [x[2].endpoint for x in out] == [A, B]
    assert out[1][0] == pytest.approx(0.50 + 2.0 * 40 * block_s) and out[1][1] == 0.50  # the prediction stays
    # nobody holds it: no replica to pay for, the order stays
    assert placement.adjust(request(tokens(2, 40)), scored, {}, None) == scored
