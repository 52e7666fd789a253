"""KV events of the simulated engine: a consumer applying them in order holds exactly `KVCache.cached`.

Every batch goes through the wire (materialize -> encode_batch -> decode_batch), and every `BlockStored` is
checked against the engine's own hashing: its token ids re-hash, chained from its parent (or from the root of
the request's model/adapter and cache_salt, read back from lora_name and extra_keys), to its block hashes.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.kv_events_wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from prefixroute.model_servers.cost_model import fit
from prefixroute.model_servers.engine import RUNNING, EngineConfig, EngineCore, EngineRequest
from prefixroute.model_servers.kv_cache import hash_block, root_hash
from prefixroute.model_servers.kv_events_publisher import materialize

COST = fit("llama-3.1-8b")
BASE = "base-model"
LORAS = ("adapter-a", "adapter-b")


class Replayer:
    """What a subscriber holds: the set of stored hashes, updated batch by batch from the wire."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.held: set[int] = set()
        self.num_batches = 0
        self.kinds: set[str] = set()

    def __call__(self, events: list) -> None:
        batch = decode_batch(encode_batch(EventBatch(1.0, materialize(events), 0)))
        assert batch.events, "the engine published an empty batch"
        self.num_batches += 1
        for ev in batch.events:
            self.kinds.add(type(ev).__name__)
            if isinstance(ev, BlockStored):
                self._check_stored(ev)
                assert not self.held & set(ev.block_hashes), "a hash stored twice"
                self.held.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert ev.medium == "GPU"
                assert set(ev.block_hashes) <= self.held, "removed a hash never stored"
                self.held.difference_update(ev.block_hashes)
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.held.clear()

    def _check_stored(self, ev: BlockStored) -> None:
        bs = self.bs
        n = len(ev.block_hashes)
        assert ev.block_size == bs and ev.medium == "GPU" and len(ev.token_ids) == n * bs
        lora = ev.lora_name
        salt = None
        if ev.extra_keys is not None:
            assert len(ev.extra_keys) == n
            for i, ek in enumerate(ev.extra_keys):
                ek = None if ek is None else tuple(ek)  # msgpack arrays: tuples come back as lists
                want_lora = (lora,) if lora is not None else ()
                if i == 0 and ev.parent_block_hash is None and ek is not None and len(ek) > len(want_lora):
                    salt = ek[-1]
                    assert ek == (*want_lora, salt)
                else:
                    assert ek == (want_lora or None), (i, ek)
        else:
            assert lora is None
        assert (ev.lora_id is None) == (lora is None)
        parent = ev.parent_block_hash
        if parent is None:
            parent = root_hash((lora or BASE, salt))
        for i, h in enumerate(ev.block_hashes):
            parent = hash_block(parent, ev.token_ids[i * bs:(i + 1) * bs])
            assert parent == h, f"block {i} of a BlockStored does not hash to its block hash"


def make_core(num_blocks: int, budget: int, max_seqs: int, sink) -> EngineCore:
    return EngineCore(EngineConfig(num_blocks, 16, max_seqs, budget, 1.0), COST, on_kv_events=sink)


def run_workload(seed: int, *, num_blocks: int = 96, num_requests: int = 120, decode_runs: bool = False) -> Replayer:
    """A seeded random workload: shared prefixes (system prompts) + random suffixes, LoRA adapters, salts,
    aborts, resets, a cache small enough that eviction and preemption happen. Checks the replayed set against
    the cache after every step."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    prefixes = [nrng.integers(0, 128000, rng.randint(1, 12) * 16 + rng.randint(0, 15)) for _ in range(6)]
    rep = Replayer(16)
    core = make_core(num_blocks, rng.choice((64, 256, 1024)), rng.choice((2, 4, 16)), rep)
    cache = core.cache
    live: list[EngineRequest] = []
    t = 0.0
    sent = 0
    while sent < num_requests or core.has_work():
        if sent < num_requests and rng.random() < 0.6:
            p = prefixes[rng.randrange(len(prefixes))]
            suffix = nrng.integers(0, 128000, rng.randint(0, 80))
            ids = np.concatenate([p, suffix]) if rng.random() < 0.85 else suffix + 1
            if len(ids) < 2:
                ids = np.concatenate([ids, [5, 6]])
            ids = ids[: (num_blocks - 8) * 16 // 2]  # prompt + output fits the pool
            lora = rng.choice((None, None, *LORAS))
            salt = rng.choice((None, None, None, "tenant-1", "tenant-2"))
            r = EngineRequest(f"r{sent}", ids, rng.randint(1, 6), block_size=16,
                              root=root_hash((lora or BASE, salt)), lora_name=lora,
                              lora_id=LORAS.index(lora) + 1 if lora else None, cache_salt=salt)
            core.add_request(r)
            live.append(r)
            sent += 1
        x = rng.random()
        if x < 0.03 and live:
            core.abort_request(live[rng.randrange(len(live))])
        elif x < 0.06:
            n = rep.num_batches
            core.reset_prefix_cache(reset_running_requests=rng.random() < 0.5)
            assert rep.num_batches == n  # queued for the next step's batch, as vLLM's
        if decode_runs and (run := core.plan_decode_run()) is not None:
            k = rng.randint(1, run.num_steps)
            t = run.end_s(k)
            core.finish_decode_run(run, k, t)
        else:
            plan = core.plan_step()
            if plan is None:
                continue
            t += plan.duration_s
            core.finish_step(plan, t)
        assert rep.held == set(cache.cached), "replayed events differ from the cache"
        live = [r for r in live if r.status in (0, RUNNING)]
    return rep


@pytest.mark.parametrize("seed", range(8))
def test_events_replay_to_exactly_the_cached_set(seed):
    rep = run_workload(seed)
    assert {"BlockStored", "BlockRemoved"} <= rep.kinds  # evictions really happened, not only stores


@pytest.mark.parametrize("seed", range(3))
def test_events_exact_with_virtual_decode_runs(seed):
    rep = run_workload(100 + seed, decode_runs=True)
    assert "BlockStored" in rep.kinds


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(24, 200))
def test_events_exact_property(seed, num_blocks):
    run_workload(seed, num_blocks=num_blocks, num_requests=40)


def test_duplicate_prompt_in_one_step_is_stored_once():
    """Two requests with the same prompt scheduled in one step: the first holder wins, the second's blocks get
    no event (vLLM emits none either), and the events still equal the cache."""
    batches: list[list] = []
    core = make_core(200, 4096, 8, batches.append)
    ids = np.arange(64 * 16 + 3)
    for i in range(2):
        core.add_request(EngineRequest(f"r{i}", ids, 1, block_size=16, root=root_hash((BASE, None))))
    plan = core.plan_step()
    assert len(plan.scheduled) == 2
    assert len(batches) == 1
    stored = [e for e in batches[0] if isinstance(e, BlockStored)]
    assert len(stored) == 1 and len(stored[0].block_hashes) == 64
    assert stored[0].parent_block_hash is None and stored[0].lora_name is None and stored[0].extra_keys is None


def test_chunked_prefill_events_chain_parent():
    """A prompt prefilled over several steps: one batch per step, each later BlockStored's parent is the last
    hash of the one before."""
    batches: list[list] = []
    core = make_core(400, 256, 4, batches.append)
    r = EngineRequest("r", np.arange(1000), 1, block_size=16, root=root_hash((BASE, "s")), cache_salt="s")
    core.add_request(r)
    while (plan := core.plan_step()) is not None:
        core.finish_step(plan, 0.0)
    stored = [e for b in batches for e in b]
    assert len(batches) == len(stored) == 4  # 62 full blocks over 256-token steps
    assert stored[0].parent_block_hash is None and stored[0].extra_keys[0] == ("s",)
    for a, b in zip(stored, stored[1:]):
        assert b.parent_block_hash == a.block_hashes[-1] and b.extra_keys is None
    assert [h for e in stored for h in e.block_hashes] == r.block_hashes


def test_reset_refused_while_held_then_forced():
    batches: list[list] = []
    core = make_core(100, 4096, 4, batches.append)
    r = EngineRequest("r", np.arange(200), 50, block_size=16, root=1)
    core.add_request(r)
    core.finish_step(core.plan_step(), 0.0)
    n = len(batches)
    assert core.reset_prefix_cache() is False and len(batches) == n and core.cache.cached
    assert core.reset_prefix_cache(reset_running_requests=True) is True
    assert core.cache.cached == {} and core.cache.num_held == 0 and r.status == 0  # back to waiting
    assert len(batches) == n  # AllBlocksCleared waits for the next step
    while (plan := core.plan_step()) is not None:  # the preempted request recomputes and finishes
        core.finish_step(plan, 0.0)
    assert isinstance(batches[n][0], AllBlocksCleared)
    assert r.finished


def test_events_off_records_nothing():
    core = make_core(50, 4096, 4, None)
    core.add_request(EngineRequest("r", np.arange(700), 2, block_size=16, root=1))
    while (plan := core.plan_step()) is not None:
        core.finish_step(plan, 0.0)
    assert core.cache.events is None and core.cache.take_events() == []


def test_reset_publishes_all_blocks_cleared_with_the_next_step_as_vllm():
    """vLLM queues AllBlocksCleared at the reset and publishes it with the next engine step's events (first in
    that batch); an idle server publishes nothing until its next request. Subscribers hold the cleared blocks
    until then."""
    batches: list[list] = []
    core = make_core(100, 4096, 4, batches.append)
    first = EngineRequest("a", np.arange(100), 2, block_size=16, root=1)
    core.add_request(first)
    while (plan := core.plan_step()) is not None:
        core.finish_step(plan, 0.0)
    n = len(batches)
    assert core.reset_prefix_cache() is True and core.cache.cached == {}
    assert core.plan_step() is None  # an idle step: still nothing to publish
    assert len(batches) == n
    nxt = EngineRequest("b", np.arange(1000, 1100), 2, block_size=16, root=1)
    core.add_request(nxt)
    core.finish_step(core.plan_step(), 0.0)
    assert len(batches) == n + 1
    kinds = [type(ev).__name__ for ev in batches[n]]
    assert kinds[0] == "AllBlocksCleared" and "BlockStored" in kinds[1:], kinds
