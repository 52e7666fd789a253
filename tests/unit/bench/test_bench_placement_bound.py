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


def _prefix(group: int, n: int = 10, tail: int = 0) -> ub.RequestBlocks:
    """A prompt of `n` shared blocks of `group` (chained: block i's hash names the group and i) and `tail` own."""
    hashes = tuple(group * 1000 + i for i in range(n)) + tuple(10**9 + group * 100 + tail * 10 + i for i in range(tail))
    return ub.RequestBlocks(num_tokens=16 * len(hashes) + 1, hashes=hashes)


def test_probation_takes_first_uses_and_promotes_a_returning_prefix_to_the_main_servers():
    # group 1 three times, group 2 once: first uses on server 0, the second use of group 1 moves to a main
    # server (one more prefill) and its third use stays there (affinity on the main servers)
    reqs = [_prefix(1), _prefix(2), _prefix(1), _prefix(1)]
    hit, counts = pb._segmented(reqs, 4, 1000, lambda r: r.hashes[0], admission=False)
    assert counts[0] == 2 and sum(counts[1:]) == 2 and max(counts[1:]) == 2
    # only the third use of group 1 hits (10 blocks of 16 tokens; the server's n - 1 cap does not bite)
    assert hit == 160 / sum(r.num_tokens for r in reqs)


def test_admission_sends_a_prefix_rarer_than_what_it_would_evict_to_probation():
    # each main server (1-3) fills with one group used twice (10 blocks, its whole capacity); group 4, new,
    # would evict blocks used twice: it goes to server 0, and group 1 still hits where it is
    reqs = [_prefix(g) for g in (1, 2, 3) for _ in range(2)] + [_prefix(4), _prefix(1)]
    total = sum(r.num_tokens for r in reqs)
    hit, counts = pb._segmented(reqs, 4, 10, lambda r: r.hashes[0], admission=True)
    assert counts[0] == 1 and sorted(counts[1:]) == [2, 2, 3]
    assert hit == 4 * 160 / total
    # probation instead: every first use on server 0 (4 groups), the second uses on the main servers
    hit, counts = pb._segmented(reqs, 4, 10, lambda r: r.hashes[0], admission=False)
    assert counts[0] == 4
