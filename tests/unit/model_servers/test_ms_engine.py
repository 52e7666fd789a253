"""Scheduler: token budget with chunked prefill, max_num_seqs, prefix hits, preemption, exact max_tokens."""

from __future__ import annotations

import numpy as np
import pytest

from prefixroute.model_servers.cost_model import fit
from prefixroute.model_servers.engine import FINISHED, EngineConfig, EngineCore, EngineRequest

COST = fit("llama-3.1-8b")


def make(num_blocks=1000, budget=8192, max_seqs=256, bs=16):
    return EngineCore(EngineConfig(num_blocks, bs, max_seqs, budget, 1.0), COST)


def req(core, n, max_tokens=4, seed=0, rid="r"):
    ids = np.random.default_rng(seed).integers(0, 128000, n)
    return EngineRequest(rid, ids, max_tokens, block_size=core.block_size, root=1)


def run_all(core, t=0.0):
    steps = []
    while (plan := core.plan_step()) is not None:
        t += plan.duration_s
        steps.append(plan)
        core.finish_step(plan, t)
    return steps


@pytest.mark.parametrize(("prompt", "budget", "prefill_steps"), [(100, 8192, 1), (2000, 512, 4), (2048, 512, 4),
                                                                  (2049, 512, 5)])
def test_chunked_prefill_respects_budget(prompt, budget, prefill_steps):
    core = make(budget=budget)
    r = req(core, prompt, max_tokens=3)
    core.add_request(r)
    steps = run_all(core)
    assert all(p.num_new_tokens <= budget for p in steps)
    assert [p.scheduled[0][1] for p in steps[:prefill_steps]][-1] == prompt - budget * (prefill_steps - 1)
    assert len(steps) == prefill_steps + 2  # then 2 decode steps for tokens 2 and 3
    assert r.num_output == 3 and r.status == FINISHED and core.cache.num_held == 0


def test_batch_budget_and_max_num_seqs():
    core = make(budget=1000, max_seqs=3)
    reqs = [req(core, 400, max_tokens=2, seed=i, rid=str(i)) for i in range(5)]
    for r in reqs:
        core.add_request(r)
    plan = core.plan_step()
    assert [n for _, n in plan.scheduled] == [400, 400, 200]  # budget splits the third prompt
    assert core.num_running == 3 and core.num_waiting == 2
    core.finish_step(plan, 1.0)
    plan = core.plan_step()
    # running first: two decodes and the rest of the third prompt; no 4th request (max_num_seqs)
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("0", 1), ("1", 1), ("2", 200)]


@pytest.mark.parametrize(("prompt", "cached"), [(160, 144), (161, 160), (175, 160), (20, 16), (16, 0)])
def test_full_hit_still_computes_last_token(prompt, cached):
    core = make()
    a = req(core, prompt, max_tokens=1)
    core.add_request(a)
    run_all(core)
    b = req(core, prompt, max_tokens=1)
    core.add_request(b)
    run_all(core)
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == cached
    assert core.stats.prefix_cache_hits == cached and core.stats.prefix_cache_queries == 2 * prompt


def test_shared_prefix_hit_and_step_cost_drops():
    core = make()
    base = np.random.default_rng(1).integers(0, 128000, 4000)
    a = EngineRequest("a", base, 1, block_size=16, root=1)
    core.add_request(a)
    cold = run_all(core)[0].duration_s
    b = EngineRequest("b", np.concatenate([base[:3800], base[:256]]), 1, block_size=16, root=1)
    core.add_request(b)
    warm = run_all(core)[0].duration_s
    assert b.num_cached_tokens == 3792
    assert warm < 0.2 * cold
    c = EngineRequest("c", base, 1, block_size=16, root=2)  # other model/salt: no hit
    core.add_request(c)
    run_all(core)
    assert c.num_cached_tokens == 0


def test_preemption_when_blocks_run_out_then_all_finish():
    core = make(num_blocks=20)  # 320 tokens
    # both fit at admission (2 x 7 blocks) but grow to 2 x 14 blocks while decoding
    reqs = [req(core, 100, max_tokens=120, seed=i, rid=str(i)) for i in range(2)]
    for r in reqs:
        core.add_request(r)
    t = 0.0
    max_held = 0
    while (plan := core.plan_step()) is not None:
        max_held = max(max_held, core.cache.num_held)
        t += plan.duration_s
        core.finish_step(plan, t)
    assert max_held <= 20
    assert core.stats.num_preemptions >= 1
    assert reqs[-1].num_preemptions >= 1 and reqs[0].num_preemptions == 0  # the newest is preempted first
    assert all(r.status == FINISHED and r.num_output == 120 for r in reqs)
    assert core.cache.num_held == 0
    assert core.stats.generation_tokens == 240


def test_abort_releases_blocks():
    core = make()
    r = req(core, 500, max_tokens=50)
    core.add_request(r)
    plan = core.plan_step()
    assert core.cache.num_held == 32
    core.abort_request(r)
    assert core.cache.num_held == 0 and core.num_running == 0
    assert core.finish_step(plan, 1.0) == []
    core.abort_request(r)
    assert core.stats.num_aborted == 1


def test_decode_batch_costs_one_step_for_all():
    core = make()
    rs = [req(core, 64, max_tokens=10, seed=i, rid=str(i)) for i in range(8)]
    for r in rs:
        core.add_request(r)
    steps = run_all(core)
    assert len(steps) == 10
    assert steps[-1].duration_s == pytest.approx(COST.decode_time_s(8, 73), rel=0.05)
