"""bench/placement_bound.py: placement strategies through per-server LRU caches."""

from __future__ import annotations

from prefixroute.bench import placement_bound as pb
from prefixroute.bench import upper_bound as ub
from prefixroute.bench.workloads import capacity_pressure


def _requests():
    return ub.request_blocks(capacity_pressure(num_groups=24, min_prefix_tokens=256, max_prefix_tokens=1024,
                                               num_requests=120))


def test_one_server_is_one_lru_whatever_the_strategy():
    reqs = _requests()
    out = pb.strategies(reqs, 1, 300)
    assert len({hit for hit, _ in out.values()}) == 1
    assert all(counts == [len(reqs)] for _, counts in out.values())
    # the same LRU as the report's pooled one but for the order a request's blocks enter it: tail first here
    # (vLLM frees them so), first block first there -- which loses the leading blocks first
    total = sum(r.num_tokens for r in reqs)
    forward = sum(c for _, c in ub.replay_lru(reqs, 300)) / total
    assert next(iter(out.values()))[0] >= forward


def test_strategies_stay_under_the_infinite_cache_and_place_every_request():
    reqs = _requests()
    total = sum(r.num_tokens for r in reqs)
    infinite = sum(c for _, c in ub.replay_lru(reqs, 10**9)) / total
    out = pb.strategies(reqs, 4, 150)
    for name, (hit, counts) in out.items():
        assert 0.0 <= hit <= infinite + 1e-9, name
        assert sum(counts) == len(reqs)
    assert pb.static_top(reqs, 10**9) <= infinite + 1e-9
    assert pb.static_top(reqs, 0) == 0.0
