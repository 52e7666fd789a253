"""The tier-aware events index (issue 25): residency per medium from the servers' events, placeholders resolved
through the server-hash map, a CPU store never counted as GPU, a GPU removal of an offloaded block keeping it
CPU-resident, CPU blocks priced at their load time. Checked against vLLM 0.33's own offloading stream and
against a simulated engine with a CPU tier (what it would really load)."""

from __future__ import annotations

import base64
import json
import random
from itertools import takewhile
from pathlib import Path

import numpy as np
import pytest

from prefixroute.extproc.kv_events.tiers import TieredKVEventIndex
from prefixroute.extproc.routing.hashing import hash_token_blocks, token_bytes, token_seed_for
from prefixroute.extproc.routing.tier_pricing import cpu_block_weight
from prefixroute.extproc.routing.timemodel import TimeModel
from prefixroute.kv_events_wire import BatchDecoder, BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from prefixroute.model_servers.cost_model import fit
from prefixroute.model_servers.engine import EngineConfig, EngineCore, EngineRequest
from prefixroute.model_servers.kv_cache import root_hash
from prefixroute.model_servers.kv_events_publisher import materialize

DATA = Path(__file__).resolve().parents[2] / "data" / "kv_events"
EP = "10.0.0.1:8000"


def _router_hashes(tokens, lora=None, salt=None):
    return hash_token_blocks(token_bytes(list(tokens)), 16, token_seed_for(lora, salt))


@pytest.mark.parametrize(("release", "name"), [
    ("vllm-0.33.0", "capture.json"), ("vllm-0.33.0", "capture-bytes-hashes.json"),
    ("vllm-0.34.0", "capture.json"), ("vllm-0.34.0", "capture-bytes-hashes.json"),  # 0.34: a Mamba group too
    ("vllm-0.34.0", "capture-block-64.json")])  # its default 64-token blocks, split into the router's 16
def test_vllm_033_offloading_stream_gives_gpu_and_cpu_residency(name, release):
    cap = json.loads((DATA / release / name).read_text())
    k = cap["block_size"] // 16  # router blocks per engine block
    decoder = BatchDecoder()
    index = TieredKVEventIndex(16)
    for msg in cap["live"]:
        index.apply_batch(EP, decoder.decode(base64.b64decode(msg[2])))
    e = cap["expected"]["prompts"]["e"]
    hashes = _router_hashes(e["tokens"])
    # GPU: blocks 0-1 (2-3 evicted after their offload, 4-5 evicted); CPU: chunks 0-1 and 2-3 stored (with tokens),
    # block 5 and 3 as placeholders; then chunk 0-1 and block 5 removed from the CPU: 2-3 stay host-resident.
    assert index.tiers(hashes)[EP] == (2 * k, 2 * k)
    assert index.num_cpu_blocks(EP) == 2
    c = index.tier_counters(EP)
    assert c.num_cpu_placeholder_blocks == k and c.num_cpu_unresolved_blocks == 0  # block 5 (3 was stored already)
    # the base index's GPU view is unchanged by the CPU events
    assert index.server_hashes(EP) == set(cap["expected"]["checkpoints"][-1]["gpu_blocks"])
    assert index.match(hashes)[EP] == 4 * k  # unpriced: weight 1


def test_cpu_store_is_not_gpu_and_gpu_removal_keeps_cpu_copy():
    tokens = list(range(1000, 1000 + 64))
    r = _router_hashes(tokens)
    index = TieredKVEventIndex(16, cpu_weight=0.5)
    server = [11, 12, 13, 14]
    gpu = BlockStored(server, None, tokens, 16, None, "GPU")
    index.apply_batch(EP, EventBatch(0.0, [gpu]))
    assert index.tiers(r)[EP] == (4, 0)
    # blocks 2-3 leave the GPU and go to the host (placeholders, as our servers publish them)
    index.apply_batch(EP, EventBatch(1.0, [BlockRemoved([13, 14], "GPU"),
                                           BlockStored([13], None, [], 0, None, "CPU", group_idx=0),
                                           BlockStored([14], None, [], 0, None, "CPU", group_idx=0)]))
    assert index.tiers(r)[EP] == (2, 2)
    assert index.match(r)[EP] == 2 + 1  # 2 GPU blocks + 2 CPU blocks at weight 0.5
    # a CPU store alone does not make a GPU hit; a CPU removal drops only the CPU copy
    index.apply_batch(EP, EventBatch(2.0, [BlockRemoved([11, 12], "GPU"),
                                           BlockStored([11], None, [], 0, None, "CPU", group_idx=0)]))
    assert index.tiers(r)[EP] == (0, 1)
    assert EP not in KVEventIndexMatch(index, r)
    index.apply_batch(EP, EventBatch(3.0, [BlockRemoved([11], "CPU")]))
    assert EP not in index.tiers(r)
    # a placeholder nobody can resolve is dropped and counted
    index.apply_batch(EP, EventBatch(4.0, [BlockStored([999], None, [], 0, None, "CPU")]))
    assert index.tier_counters(EP).num_cpu_unresolved_blocks == 1


def KVEventIndexMatch(index: TieredKVEventIndex, hashes) -> dict:
    """The GPU-only match of the base class."""
    return super(TieredKVEventIndex, index).match(hashes)


@pytest.mark.parametrize("server_block_size", [16, 64])  # 64: vLLM 0.34's default, split into the router's 16
@pytest.mark.parametrize("seed", range(4))
def test_index_predicts_what_a_tiered_engine_loads(seed, server_block_size):
    """A simulated engine with a CPU tier, its events over the wire into the index: for every prompt, the index's
    (GPU, CPU) blocks equal the engine's GPU prefix hit and the CPU blocks it would load after it, in the router's
    16-token blocks (k of them per server block)."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    index = TieredKVEventIndex(16)
    bs = server_block_size
    k = bs // 16

    def sink(events):
        index.apply_batch(EP, decode_batch(encode_batch(EventBatch(1.0, materialize(events), 0))))

    core = EngineCore(EngineConfig(64, bs, 8, 4096 * k, 1.0, 96, 1e-5, 1 << 20),
                      fit("llama-3.1-8b"), sink)
    root = root_hash(("m", None))
    prompts = [nrng.integers(0, 100000, rng.randint(3, 12) * bs + 1) for _ in range(10)]
    for i in range(120):
        ids = prompts[rng.randrange(len(prompts))]
        core.add_request(EngineRequest(f"r{i}", ids, 2, block_size=bs, root=root))
        while core.has_work():
            core.finish_step(core.plan_step(), 1.0)
        for p in prompts:
            er = EngineRequest("q", p, 1, block_size=bs, root=root)
            max_hit = (len(p) - 1) // bs
            g = core.cache.num_cached_prefix_blocks(er.block_hashes[:max_hit])
            c = sum(1 for _ in takewhile(core.tier.lru.__contains__, er.block_hashes[g:max_hit]))
            got = index.tiers(_router_hashes(p)[:max_hit * k]).get(EP, (0, 0))
            assert got == (g * k, c * k), (i, got, (g, c))
    assert index.tier_counters(EP).num_cpu_placeholder_blocks > 0
    assert index.num_cpu_blocks(EP) == len(core.tier.lru) and index.split_of(EP) == k


def test_cpu_blocks_are_priced_at_their_load_time():
    model = TimeModel(35_000.0, 0.015)
    index = TieredKVEventIndex(16, 2.38)
    index.price_with(model)
    w = index.cpu_weight(EP)
    assert w == pytest.approx(1 - 2.38e-6 * 35_000)
    # the time model's cost of a CPU-resident block = its load time exactly: (1 - w) x 16 tokens / rate
    assert (1 - w) * 16 / 35_000 == pytest.approx(16 * 2.38e-6)
    assert cpu_block_weight(1.0, 35_000) == 0.0 and cpu_block_weight(0.0, 35_000) == 1.0
    assert cpu_block_weight(1e-6, 0) == 0.0
