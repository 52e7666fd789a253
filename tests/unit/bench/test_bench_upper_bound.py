"""The infinite-cache upper bound, checked against hand-computed token counts."""

from __future__ import annotations

import numpy as np
import pytest

from prefixroute.bench import upper_bound as ub
from prefixroute.bench import workloads as w
from prefixroute.bench.traces import TraceRecord, trace_workload


@pytest.mark.parametrize("lengths_and_prefixes,expected", [
    # (num tokens, id of the shared-prefix source, shared tokens) -> cached tokens per request
    ([(64, "a", 64), (64, "a", 64)], [0, 48]),       # identical 64-token prompts: cap at n-1 -> 3 blocks
    ([(64, "a", 64), (80, "a", 64)], [0, 64]),       # 64 shared + 16 new: 4 blocks
    ([(64, "a", 40), (64, "a", 40)], [0, 32]),       # 40 shared tokens -> 2 full blocks
    ([(64, "a", 0), (64, "b", 0)], [0, 0]),          # nothing shared
    ([(15, "a", 15), (15, "a", 15)], [0, 0]),        # shorter than one block: never cached
    ([(33, "a", 33), (33, "a", 33), (50, "a", 33)], [0, 32, 32]),
])
def test_replay_infinite_cache_hand_computed(lengths_and_prefixes, expected):
    rng = np.random.default_rng(0)
    shared = {"a": rng.integers(0, 1000, 200), "b": rng.integers(1000, 2000, 200)}
    lists = []
    for n, src, k in lengths_and_prefixes:
        tail = rng.integers(5000, 9000, n - k)  # unique tails
        lists.append(np.concatenate([shared[src][:k], tail]).astype(np.int64))
    got = list(ub.replay_infinite_cache(lists, 16))
    assert [c for _, c in got] == expected
    assert [n for n, _ in got] == [n for n, _, _ in lengths_and_prefixes]


def test_chained_hashes_name_the_whole_prefix():
    a = np.arange(48, dtype=np.int64)
    b = a.copy()
    b[0] = 999  # differs in block 0 only: blocks 1 and 2 have equal tokens but different chained hashes
    ha, hb = ub.chained_block_hashes(a), ub.chained_block_hashes(b)
    assert len(ha) == 3 and not set(ha) & set(hb)


def test_shared_prompts_bound_matches_counting_by_hand():
    # G groups, each first occurrence misses; every later request hits its group's whole prefix blocks.
    wl = w.shared_prompts(num_groups=2, prefix_tokens=256, question_tokens=32, num_requests=10, seed=0)
    bound = ub.upper_bound(wl)
    tokens = [ub.prompt_token_ids(r) for r in wl.requests]
    assert bound.prompt_tokens == sum(len(t) for t in tokens)
    seen_groups: set[str] = set()
    expected = 0
    for r, t in zip(wl.requests, tokens):
        if r.group_id in seen_groups:
            # Shared part = template head + the 256-token system prompt: the full blocks inside it.
            other = next(ub.prompt_token_ids(o) for o in wl.requests if o.group_id == r.group_id and o is not r)
            common = int(np.argmin(t[: len(other)] == other[: len(t)]))
            expected += common // 16 * 16
        seen_groups.add(r.group_id)
    assert bound.cached_tokens == expected
    assert 0.5 < bound.hit_ratio < 1.0


def test_trace_bound_counts_shared_trace_blocks(tmp_path):
    recs = [TraceRecord(0, 1024, 1, (1, 2)), TraceRecord(1, 1024, 1, (1, 2)), TraceRecord(2, 600, 1, (3, 4))]
    wl = trace_workload(recs, api="completions")
    bound = ub.upper_bound(wl)
    assert bound.prompt_tokens == 1024 + 1024 + 600
    assert bound.cached_tokens == 1024 - 16  # identical 2nd prompt: all but the last block
