"""Golden KV-event payloads of released engines (tests/data/kv_events/<release>/, made by their own publishers:
tests/data/kv_events/generate.py): every batch decodes, its wire form is the one the release publishes, the
replay frames carry the same payloads, and the index equals the engine's GPU block set after every batch, the
prompts matching as many blocks as the engine holds for them."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from prefixroute.extproc.kv_events import KVEventIndex
from prefixroute.extproc.routing.hashing import hash_token_blocks, token_seed_for
from prefixroute.kv_events_wire import END_SEQ, BatchDecoder, BlockRemoved, BlockStored, GPU_MEDIA, seq_from_bytes

DATA = Path(__file__).resolve().parents[2] / "data" / "kv_events"
CAPTURES = sorted(DATA.glob("*/capture*.json"))
EP = "10.0.0.1:8000"
# The form each release publishes (kv_events module docstring), by the release's version.
ARRAY_RELEASES = {"vllm-0.9.0", "vllm-0.11.0", "vllm-0.17.0", "vllm-0.23.0", "sglang-0.5.10"}


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _frames(msg: list[str]) -> list[bytes]:
    return [base64.b64decode(f) for f in msg]


def test_the_releases_the_issue_names_are_all_captured():
    names = {p.parent.name for p in CAPTURES}
    assert {"vllm-0.9.0", "vllm-0.23.0", "vllm-0.24.0", "vllm-0.26.0", "vllm-0.33.0", "vllm-0.34.0",
            "sglang-0.5.23"} <= names
    assert (DATA / "vllm-0.33.0" / "capture-bytes-hashes.json").exists()
    assert (DATA / "vllm-0.34.0" / "capture-bytes-hashes.json").exists()


@pytest.mark.parametrize("path", CAPTURES, ids=[f"{p.parent.name}/{p.stem}" for p in CAPTURES])
def test_golden_payloads_decode_and_rebuild_the_engines_gpu_blocks(path):
    cap = _load(path)
    release, exp = cap["release"], cap["expected"]
    live = [_frames(m) for m in cap["live"]]
    assert len(live) == exp["num_batches"] == len(exp["checkpoints"])
    decoder = BatchDecoder()
    index = KVEventIndex(cap["block_size"])
    other_media: set[str] = set()
    for k, (frames, check) in enumerate(zip(live, exp["checkpoints"])):
        topic, raw_seq, payload = frames
        assert topic == cap["topic"].encode() and seq_from_bytes(raw_seq) == k
        batch = decoder.decode(payload)  # raises on anything it cannot read: 100% decode or the test fails
        assert decoder.form == ("array" if release in ARRAY_RELEASES else "mixed"), (release, decoder.form)
        other_media |= {e.medium for e in batch.events if type(e) in (BlockStored, BlockRemoved)
                        and e.medium not in GPU_MEDIA}
        index.apply_batch(EP, batch)
        assert index.server_hashes(EP) == set(check["gpu_blocks"]), f"{release}: after batch {k}"
        for name, want in check["prompts"].items():
            p = exp["prompts"][name]
            hashes = hash_token_blocks(p["tokens"], cap["block_size"], token_seed_for(p["lora_name"],
                                                                                      p["cache_salt"]))
            assert index.match(hashes).get(EP, 0) == want, f"{release}: prompt {name} after batch {k}"
    assert decoder.num_unknown_events == 0
    c = index.counters(EP)
    assert c.num_malformed_events == 0 and c.num_block_size_mismatch_blocks == 0
    if release in ("vllm-0.33.0", "vllm-0.34.0"):  # the offloading connector's CPU and STORAGE tiers, placeholders
        assert other_media == {"CPU", "STORAGE"}
    elif release == "sglang-0.5.23":
        assert other_media == {"CPU_PINNED"}


@pytest.mark.parametrize("path", CAPTURES, ids=[f"{p.parent.name}/{p.stem}" for p in CAPTURES])
def test_golden_replays_carry_the_live_payloads(path):
    cap = _load(path)
    live = [_frames(m)[2] for m in cap["live"]]
    three_frames = cap["release"] not in {"vllm-0.9.0", "vllm-0.11.0", "vllm-0.17.0", "vllm-0.23.0",
                                          "vllm-0.24.0", "sglang-0.5.10"}
    for msgs, start in ((cap["replay_from_0"], 0), (cap["replay_from_mid"]["messages"], cap["replay_from_mid"]["start"])):
        frames = [_frames(m) for m in msgs]
        assert frames[-1][-2:] == [END_SEQ, b""], "the end marker closes the replay"
        # After the DEALER's empty delimiter: (seq, payload) or, from vLLM 0.26 / SGLang 0.5.2x, (topic, seq, payload)
        assert {len(f) for f in frames} == {4 if three_frames else 3}
        got = [(seq_from_bytes(f[-2]), f[-1]) for f in frames[:-1]]
        assert got == list(enumerate(live))[start:]


@pytest.mark.parametrize("release", ["vllm-0.33.0", "vllm-0.34.0"])
def test_vllm_033_placeholders_and_bytes_hashes_are_what_the_release_sends(release):
    cap = _load(DATA / release / "capture.json")
    events = [e for m in cap["live"] for e in BatchDecoder().decode(_frames(m)[2]).events]
    placeholders = [e for e in events if type(e) is BlockStored and e.is_placeholder
                    and e.kv_cache_spec_kind != "mamba"]  # 0.34's state checkpoint: below
    assert placeholders and all(e.block_size == 0 and e.token_ids == [] and e.medium == "CPU" for e in placeholders)
    assert any(type(e) is BlockStored and e.locality == "REMOTE" and e.ownership == "tier-2" for e in events)
    assert any(type(e) is BlockStored and e.lookahead_token_ids for e in events)
    assert all(e.session_id == "sess-1" for e in events if type(e) is BlockStored and e.medium == "GPU")
    raw = _load(DATA / release / "capture-bytes-hashes.json")
    stored = [e for m in raw["live"] for e in BatchDecoder().decode(_frames(m)[2]).events if type(e) is BlockStored]
    assert all(isinstance(h, bytes) and len(h) == 32 for e in stored for h in e.block_hashes)


def test_vllm_034_same_bytes_as_033_and_a_mamba_state_checkpoint():
    """vLLM 0.34 sends the scenario 0.33 sends byte for byte (its kv_events.py is 0.33's); new in its offloading
    tracker: a recurrent group's chunk is a state checkpoint (last hash, parent, no tokens, block_size the
    group's, kind "mamba"), in its own group: not the router's attention blocks."""
    old, new = _load(DATA / "vllm-0.33.0" / "capture.json"), _load(DATA / "vllm-0.34.0" / "capture.json")
    assert new["live"][:len(old["live"]) - 2] == old["live"][:-2]  # frames: topic, seq, payload (its timestamp)
    events = [[BatchDecoder().decode(_frames(m)[2]).events for m in c["live"][-2:]] for c in (new, old)]
    assert events[0] == events[1]
    extra = new["live"][len(old["live"]) - 2]
    (ev,) = BatchDecoder().decode(_frames(extra)[2]).events
    assert type(ev) is BlockStored and ev.kv_cache_spec_kind == "mamba" and ev.group_idx == 1
    assert len(ev.block_hashes) == 1 and ev.parent_block_hash is not None
    assert ev.token_ids == [] and ev.block_size == 16 and ev.medium == "CPU" and ev.is_placeholder


def test_sglang_hashes_are_signed_int64():
    cap = _load(DATA / "sglang-0.5.23" / "capture.json")
    hashes = [h for m in cap["live"] for e in BatchDecoder().decode(_frames(m)[2]).events
              if type(e) is BlockStored for h in e.block_hashes]
    assert any(h < 0 for h in hashes) and all(-(1 << 63) <= h < (1 << 63) for h in hashes)


SPLIT_CAPTURES = [p for p in CAPTURES if _load(p)["block_size"] > 16]


def test_a_release_at_its_default_64_token_blocks_is_captured():
    assert [f"{p.parent.name}/{p.name}" for p in SPLIT_CAPTURES] == ["vllm-0.34.0/capture-block-64.json"]


@pytest.mark.parametrize("path", SPLIT_CAPTURES, ids=[f"{p.parent.name}/{p.stem}" for p in SPLIT_CAPTURES])
def test_a_router_at_16_token_blocks_follows_an_engine_at_64(path):
    """vLLM 0.34's own publisher at its default 64-token blocks, into an index hashing the router's default 16:
    after every batch it holds the engine's GPU blocks, and each prompt matches exactly k = 4 router blocks per
    engine block the engine holds for it (the sub-blocks `KVEventIndex` splits them into)."""
    cap = _load(path)
    exp = cap["expected"]
    k = cap["block_size"] // 16
    decoder = BatchDecoder()
    index = KVEventIndex(16)
    for n, (frames, check) in enumerate(zip((_frames(m) for m in cap["live"]), exp["checkpoints"])):
        index.apply_batch(EP, decoder.decode(frames[2]))
        assert index.server_hashes(EP) == set(check["gpu_blocks"]), f"after batch {n}"
        assert index.num_blocks(EP) == len(check["gpu_blocks"])
        for name, want in check["prompts"].items():
            p = exp["prompts"][name]
            hashes = hash_token_blocks(p["tokens"], 16, token_seed_for(p["lora_name"], p["cache_salt"]))
            assert index.match(hashes).get(EP, 0) == k * want, f"prompt {name} after batch {n}"
    c = index.counters(EP)
    assert c.num_malformed_events == 0 and c.num_block_size_mismatch_blocks == 0 and c.num_orphan_blocks == 0
    assert index.block_size_seen(EP) == 64 and index.block_size_mismatch(EP) is None and index.split_of(EP) == k


def test_sglang_at_its_default_page_of_1_token_is_merged_into_router_blocks():
    """SGLang 0.5.23's own recorder at page 1 (its default): a node's pages come as one event of n hashes and n
    tokens, and a branch forking inside a router block names a page in the middle of an earlier event as its
    parent (the split published nothing). The index at 16 follows it: pages held, prompts matched in whole router
    blocks, nothing orphaned or mismatched."""
    cap = _load(DATA / "sglang-0.5.23" / "capture-page-1.json")
    assert (cap["block_size"], cap["page_size"]) == (16, 1)
    batches = [BatchDecoder().decode(_frames(m)[2]) for m in cap["live"]]
    gpu_stores = [e for b in batches for e in b.events if type(e) is BlockStored and e.medium == "GPU"]
    assert all(e.block_size == 1 and len(e.token_ids) == len(e.block_hashes) > 1 for e in gpu_stores)
    earlier = [h for e in gpu_stores[:2] for h in e.block_hashes]
    fork = gpu_stores[2].parent_block_hash
    assert fork in earlier and fork != gpu_stores[0].block_hashes[-1] and earlier.index(fork) % 16 != 15
    index = KVEventIndex(16)
    for batch, check in zip(batches, cap["expected"]["checkpoints"]):
        index.apply_batch(EP, batch)
        assert index.num_blocks(EP) == len(check["gpu_blocks"])
        held = set()  # the router blocks the engine holds whole: each prompt's first `want` (shared ones once)
        for name, want in check["prompts"].items():
            p = cap["expected"]["prompts"][name]
            held.update(hash_token_blocks(p["tokens"], 16, token_seed_for(p["lora_name"], p["cache_salt"]))[:want])
        assert index.num_held_blocks(EP) == len(held)
    c = index.counters(EP)
    assert (c.num_orphan_blocks, c.num_unknown_removed_blocks, c.num_block_size_mismatch_blocks) == (0, 0, 0)
    assert index.block_size_seen(EP) == 1 and index.block_size_mismatch(EP) is None
