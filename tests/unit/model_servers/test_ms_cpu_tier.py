"""The simulated servers' CPU KV tier (vLLM native offloading): LRU, loads at a transfer cost, per-medium KV events
in vLLM 0.33's forms (checked against the release's own golden payloads), metrics, flags."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import msgspec
import numpy as np
import pytest

from prefixroute.kv_events_wire import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch,
                                        encode_batch)
from prefixroute.model_servers import metrics
from prefixroute.model_servers.cost_model import fit
from prefixroute.model_servers.cpu_tier import CPUTier, num_cpu_blocks
from prefixroute.model_servers.engine import RUNNING, EngineConfig, EngineCore, EngineRequest
from prefixroute.model_servers.kv_cache import root_hash
from prefixroute.model_servers.kv_events_publisher import materialize
from prefixroute.model_servers.profiles import EngineSpec
from prefixroute.model_servers.server_settings import ServerSettings

COST = fit("llama-3.1-8b")
GOLDEN = Path(__file__).resolve().parents[2] / "data" / "kv_events" / "vllm-0.33.0" / "capture.json"
ROOT = root_hash(("m", None))


class MediumReplayer:
    """What a subscriber holds per medium, from the wire."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
        self.placeholders = 0

    def __call__(self, events: list) -> None:
        batch = decode_batch(encode_batch(EventBatch(1.0, materialize(events), 0)))
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.medium == "CPU":
                    assert ev.is_placeholder and len(ev.block_hashes) == 1
                    self.placeholders += 1
                held = self.held[ev.medium]
                assert not held & set(ev.block_hashes), "a hash stored twice in one medium"
                held.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                held = self.held[ev.medium]
                assert set(ev.block_hashes) <= held, "removed a hash never stored"
                held.difference_update(ev.block_hashes)
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.held["GPU"].clear()


def core_with_tier(num_blocks: int, num_cpu: int, sink=None, load_s: float = 1e-4) -> EngineCore:
    return EngineCore(EngineConfig(num_blocks, 16, 8, 4096, 1.0, num_cpu, load_s, 2 << 20), COST, on_kv_events=sink)


def run_one(core: EngineCore, ids: np.ndarray, t: float = 0.0) -> tuple[EngineRequest, float]:
    """Run one request to completion; returns it and the duration of its first step."""
    r = EngineRequest(f"r{random.random()}", ids, 1, block_size=16, root=ROOT, arrival_s=t)
    core.add_request(r)
    first = None
    while core.has_work():
        plan = core.plan_step()
        first = plan.duration_s if first is None else first
        t += plan.duration_s
        core.finish_step(plan, t)
    return r, first


def test_tier_lru_touch_and_capacity():
    tier = CPUTier(3, 0.001)
    tier.enable_events()
    tier.offload([1, 2, 3])
    assert tier.num_leading([1, 9]) == 1  # 1 touched: 2 is now the least recently used
    tier.offload([4])
    assert list(tier.lru) == [3, 1, 4]
    ev = tier.take_events()
    assert [type(e).__name__ for e in ev] == ["BlockStored"] * 4 + ["BlockRemoved"]
    assert ev[-1].block_hashes == [2] and ev[-1].medium == "CPU"
    assert tier.load_time_s(10) == pytest.approx(0.01)


def test_evicted_prefix_is_loaded_from_cpu_at_transfer_cost():
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 100000, 32 * 16 + 1), rng.integers(0, 100000, 40 * 16 + 1)
    load_s = 0.002
    with_tier = core_with_tier(48, 200, load_s=load_s)
    without = EngineCore(EngineConfig(48, 16, 8, 4096, 1.0), COST)
    for core in (with_tier, without):
        run_one(core, a)
        run_one(core, b)  # evicts most of a's blocks from the GPU
    ra, step_t = run_one(with_tier, a)
    rn, step_n = run_one(without, a)
    assert rn.num_cached_tokens < 32 * 16 // 2  # the GPU alone lost most of a
    assert ra.num_cached_tokens == 32 * 16  # the CPU tier gave the rest back
    loaded = ra.num_cpu_cached_tokens // 16
    assert loaded == 32 - rn.num_cached_tokens // 16 and loaded > 0
    # the step pays the transfer, and far less than recomputing those blocks
    assert step_t > loaded * load_s
    assert step_t - loaded * load_s < step_n
    st = with_tier.stats
    assert st.external_prefix_cache_hits == ra.num_cpu_cached_tokens
    assert st.prefix_cache_hits + st.external_prefix_cache_hits == 32 * 16 + 0  # a's hit; b and a's first: cold


@pytest.mark.parametrize("seed", range(6))
def test_per_medium_events_replay_to_gpu_cache_and_cpu_tier(seed):
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    prefixes = [nrng.integers(0, 128000, rng.randint(2, 10) * 16 + 3) for _ in range(8)]
    rep = MediumReplayer()
    core = core_with_tier(64, rng.choice((16, 40, 120)), rep)
    for i in range(150):
        ids = np.concatenate([prefixes[rng.randrange(8)], nrng.integers(0, 128000, rng.randint(0, 40))])
        core.add_request(EngineRequest(f"r{i}", ids[:400], rng.randint(1, 4), block_size=16, root=ROOT))
        for _ in range(rng.randint(0, 3)):
            plan = core.plan_step()
            if plan is not None:
                core.finish_step(plan, 1.0)
            assert rep.held["GPU"] == set(core.cache.cached)
            assert rep.held["CPU"] == set(core.tier.lru)
    while core.has_work():
        core.finish_step(core.plan_step(), 1.0)
    assert rep.held["CPU"] == set(core.tier.lru) and rep.placeholders > 0
    assert core.stats.external_prefix_cache_hits > 0
    assert all(r.status != RUNNING for r in core.running)


def _golden_events() -> list:
    cap = json.loads(GOLDEN.read_text())
    out = []
    for fr in cap["live"]:
        raw = msgspec.msgpack.decode(base64.b64decode(fr["payload"] if isinstance(fr, dict) else fr[2]))
        out.extend(raw[1])
    return out


def test_cpu_events_have_the_form_vllm_033_publishes():
    """Our placeholder store and CPU removal, as bytes on the wire, equal the 0.33 release's own (legacy tracker,
    no token snapshot) events for the same hashes."""
    golden = _golden_events()
    g_store = next(e for e in golden if e["type"] == "BlockStored" and e["block_size"] == 0
                   and e.get("kv_cache_spec_kind") is None)
    g_removed = next(e for e in golden if e["type"] == "BlockRemoved" and e["medium"] == "CPU"
                     and "locality" not in e)
    tier = CPUTier(1, 0.0)
    tier.enable_events()
    tier.offload(g_store["block_hashes"])
    tier.offload(g_removed["block_hashes"])  # capacity 1: the first is removed
    ours = msgspec.msgpack.decode(encode_batch(EventBatch(0.0, tier.take_events(), 0)))[1]
    assert ours[0] == g_store
    assert ours[2] == {**g_removed, "block_hashes": g_store["block_hashes"]}


def test_flags_metrics_and_sizes():
    s = ServerSettings(kv_offloading_size=4.0)
    spec = EngineSpec.from_settings(s)
    # 4 GiB of 8B blocks (128 KiB x 16 tokens = 2 MiB): 2,048 blocks; 55 GB/s per rank
    assert spec.config.num_cpu_blocks == 2048
    assert spec.config.cpu_load_s_per_block == pytest.approx((2 << 20) / 55e9)
    assert num_cpu_blocks(None, 1, 16) == 0
    with pytest.raises(ValueError, match="backend"):
        ServerSettings(kv_offloading_backend="lmcache")
    core = spec.new_engine()
    page = metrics.render(core, model_name="m", process=False)
    for name in ("vllm:external_prefix_cache_hits_total", "vllm:kv_offload_load_bytes_total",
                 "vllm:kv_offload_config_info", "prefixroute:kv_offload_cpu_usage_perc"):
        assert name in page
    plain = metrics.render(EngineSpec.from_settings(ServerSettings()).new_engine(), model_name="m", process=False)
    assert "kv_offload" not in plain
    # the tier's info gauge in vLLM 0.33/0.34's own form (CPUOffloadingInfo, one block per chunk: vLLM's default)
    page = metrics.render(core, model_name="m", process=False, max_model_len=131072)
    assert ('vllm:kv_offload_config_info{cpu_blocks_per_chunk="1",cpu_kv_cache_size_bytes="4294967296",'
            'cpu_kv_cache_size_tokens="32768",cpu_num_chunks="2048",engine="0",model_name="m"} 1.0') in page
    assert 'cpu_kv_cache_size_tokens="None"' in metrics.render(core, model_name="m", process=False)
