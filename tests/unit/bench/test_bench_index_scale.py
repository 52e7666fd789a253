"""The index-scale benchmark (bench/index_scale.py) builds what it says it measures: every endpoint full to its
block count, a quarter of its blocks in chains several endpoints share, events ingestion that really stores and
removes blocks of a full index."""

from __future__ import annotations

import argparse
import collections

from prefixroute.bench import index_scale


def _args(**kw) -> argparse.Namespace:
    base = dict(decisions=50, ingest_s=0.2, blocks_per_batch=32, batches_per_s_per_endpoint=10.0,
                decisions_per_s=200.0, chunk_blocks=64, seconds=0.2, rounds=1)
    base.update(kw)
    return argparse.Namespace(**base)


def _assert_queries_hit(out: dict) -> None:
    """Decisions are timed on prompts the index holds: shared chains at several endpoints, own chains at one."""
    by = out["by_query"]
    assert by["shared"]["mean_holders"] >= 2 and by["own"]["mean_holders"] == 1 and by["cold"]["mean_holders"] == 0


def test_plan_shares_a_quarter_of_each_endpoints_blocks_among_several_endpoints():
    n, blocks = 64, 32 * index_scale.CHAIN_BLOCKS
    num_shared, distinct_per_ep, shared_of = index_scale._plan(n, blocks, seed=1)
    per_ep = len(shared_of[0]) + distinct_per_ep
    assert per_ep * index_scale.CHAIN_BLOCKS == blocks
    assert len(shared_of[0]) / per_ep == index_scale.SHARED_RATIO
    holders = collections.Counter(c for chains in shared_of for c in chains)
    assert max(holders) < num_shared
    mean_holders = sum(holders.values()) / num_shared
    assert index_scale.SHARED_HOLDERS * 0.9 <= mean_holders <= index_scale.SHARED_HOLDERS * 1.1


def test_own_index_fill_holds_every_block_of_every_endpoint():
    out = index_scale._own(16, 4 * index_scale.CHAIN_BLOCKS, _args())
    assert out["entries"] == 16 * 4 * index_scale.CHAIN_BLOCKS
    _assert_queries_hit(out)
    assert out["decision_p50_us"] > 0 and out["decision_p99_us"] >= out["decision_p50_us"]


def test_events_fill_and_ingestion_store_and_remove_real_blocks():
    n, blocks = 16, 4 * index_scale.CHAIN_BLOCKS
    out = index_scale._events(n, blocks, _args())
    assert out["entries"] == n * blocks
    _assert_queries_hit(out)
    check = out["ingest_check"]
    assert check["num_orphan_blocks"] == 0
    # Past the first half-ring (whose removals name blocks not stored yet), every removal finds its blocks.
    assert check["num_removed_blocks"] > 0
    assert check["num_unknown_removed_blocks"] == n * (index_scale.RING // 2) * 32
    assert out["ingest_blocks_per_s"] > 0 and 0 < out["kept_up_ratio"]
    assert out["idle_p99_us"] > 0 and out["events_p99_us"] > 0
