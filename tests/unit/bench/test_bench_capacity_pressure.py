"""The capacity-pressure workload and its sizing against the fleet's KV capacity (issue 13's benchmark)."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from prefixroute import settings as settings_mod
from prefixroute.bench import cli
from prefixroute.bench import upper_bound as ub
from prefixroute.bench import workloads as w
from prefixroute.bench.settings import BenchSettings
from prefixroute.bench.workload_spec import CHARS_PER_TOKEN, RequestSpec

SMALL = dict(num_groups=12, min_prefix_tokens=256, max_prefix_tokens=1024, num_requests=80, seed=5)


def _prefix_tokens(r: RequestSpec) -> int:
    # system = instructions (64 tokens) + the group's prefix; 4 characters per token.
    return len(r.messages[0]["content"]) // CHARS_PER_TOKEN - 64


def test_structure_shared_prefix_per_group_unique_question_lengths_in_range():
    wl = w.capacity_pressure(**SMALL)
    assert wl.name == "capacity-pressure" and len(wl.requests) == 80
    by_group: dict[str, set[str]] = collections.defaultdict(set)
    questions = set()
    for r in wl.requests:
        assert 256 <= _prefix_tokens(r) <= 1024
        by_group[r.group_id].add(r.messages[0]["content"])
        questions.add(r.messages[1]["content"])
    assert all(len(texts) == 1 for texts in by_group.values())  # one prefix text per group
    assert len({t for texts in by_group.values() for t in texts}) == len(by_group)  # distinct across groups
    assert len(questions) == 80  # every follow-up question is unique
    # Every request shares the instruction block, so all system prompts share their first 64 tokens.
    firsts = {r.messages[0]["content"][:256] for r in wl.requests}
    assert len(firsts) == 1


def test_zipf_popularity_a_hot_head_and_a_cold_tail():
    wl = w.capacity_pressure(num_groups=50, min_prefix_tokens=32, max_prefix_tokens=64, num_requests=2000,
                             zipf_s=0.8, seed=1)
    counts = sorted(collections.Counter(r.group_id for r in wl.requests).values(), reverse=True)
    # weights 1/(rank+1)^0.8 over 50 groups: the hottest gets ~12% of requests, the 50th ~0.6%.
    assert counts[0] > 2000 * 0.08 and counts[0] > 8 * counts[-1]
    assert len(counts) == 50


@pytest.mark.parametrize("kw", [dict(num_groups=0), dict(min_prefix_tokens=100, max_prefix_tokens=50),
                                dict(zipf_s=-1.0), dict(num_requests=0)])
def test_invalid_sizes_are_rejected(kw):
    with pytest.raises(ValueError):
        w.capacity_pressure(**{**SMALL, **kw})


@pytest.mark.parametrize("servers,kv_ratio", [(4, 0.5), (2, 0.5), (4, 0.25), (8, 1.0)])
def test_gpu_blocks_for_gives_the_fleet_that_fraction_of_the_shared_working_set(servers, kv_ratio):
    wl = w.capacity_pressure(**SMALL)
    reqs = ub.request_blocks(wl)
    shared = ub.working_set(reqs).shared_blocks
    n = ub.gpu_blocks_for(wl, servers, kv_ratio)
    longest = max(-(-r.num_tokens // ub.CACHE_BLOCK_TOKENS) for r in reqs)
    assert n >= longest  # a server always fits its longest request
    if shared * kv_ratio / servers > longest + 1:
        assert servers * n == pytest.approx(shared * kv_ratio, abs=servers)


def test_working_set_counts_distinct_and_shared_blocks_by_hand():
    a = ub.RequestBlocks(33, (1, 2))
    b = ub.RequestBlocks(49, (1, 2, 3))
    c = ub.RequestBlocks(17, (9,))
    assert ub.working_set([a, b, c, a]) == ub.WorkingSet(distinct_blocks=4, shared_blocks=2)


def test_default_workload_puts_the_fleet_under_pressure():
    """The defaults (300 requests, 4 servers, half the shared working set) as the docstring states them: the
    infinite-cache bound near the issue's 0.69, MIN at capacity clearly below it and a pooled LRU far below."""
    wl = w.capacity_pressure()
    n = ub.gpu_blocks_for(wl, 4, 0.5)
    b = ub.fleet_bounds(wl, 4, "llama-3.1-70b-h200-tp4", (f"--num-gpu-blocks={n}",))
    assert 2000 <= n <= 3000
    assert b["shared_working_set_blocks"] < b["working_set_blocks"] <= 2 * b["shared_working_set_blocks"]
    assert 0.6 <= b["infinite_cache_hit_ratio"] <= 0.72
    assert b["belady_hit_ratio"] <= b["infinite_cache_hit_ratio"] - 0.02
    assert b["lru_pooled_hit_ratio"] <= b["belady_hit_ratio"] - 0.1
    # Ten times the room: no pressure, MIN reaches the infinite cache.
    roomy = ub.fleet_bounds(wl, 4, "llama-3.1-70b-h200-tp4", (f"--num-gpu-blocks={10 * n}",))
    assert roomy["belady_hit_ratio"] == pytest.approx(roomy["infinite_cache_hit_ratio"], abs=1e-6)


def _settings(**kw) -> BenchSettings:
    return dataclasses.replace(settings_mod.from_namespace(BenchSettings), **kw)


@pytest.mark.parametrize("kw,sized", [
    (dict(workload="capacity-pressure"), True),
    (dict(workload="capacity-pressure", server_args=("--num-gpu-blocks=999",)), False),
    (dict(workload="capacity-pressure", server_args=("--num-gpu-blocks", "999")), False),
    (dict(workload="capacity-pressure", pressure_kv_ratio=0.0), False),
    (dict(workload="documents"), False),
])
def test_the_bench_sizes_the_servers_only_for_capacity_pressure_without_a_choice(kw, sized):
    s = _settings(num_requests=60, pressure_num_groups=10, pressure_min_prefix_tokens=128,
                  pressure_max_prefix_tokens=512, **kw)
    wl = cli.build_workload(s)
    got = cli.pressure_server_args(s, wl)
    if sized:
        assert got == (f"--num-gpu-blocks={ub.gpu_blocks_for(wl, s.servers, s.pressure_kv_ratio)}",)
    else:
        assert got == ()


def test_cli_knobs_reach_the_workload():
    s = _settings(workload="capacity-pressure", num_requests=30, pressure_num_groups=3,
                  pressure_min_prefix_tokens=100, pressure_max_prefix_tokens=100, pressure_zipf_s=1.5)
    wl = cli.build_workload(s)
    assert wl.params["num_groups"] == 3 and wl.params["zipf_s"] == 1.5
    assert {_prefix_tokens(r) for r in wl.requests} == {100}
    assert len({r.group_id for r in wl.requests}) <= 3
