"""The blocks a vLLM server holds, as vLLM's own code reads its KV events (run by the vLLM environment's Python).

``python vllm_blocks.py`` reads one JSON line per query from stdin: ``{"replay": REPLAY_ENDPOINT, "dump": FILE
or null}``. For each it asks the server's replay socket for every batch it buffered (from sequence 0), decodes
each with vLLM's own `KVEventBatch` (vllm/distributed/kv_events.py), applies them in order (`BlockStored` adds,
`BlockRemoved` drops, `AllBlocksCleared` empties; GPU medium, group 0) and prints one JSON line:
``{"blocks": N, "block_size": S, "last_seq": Q, "batches": B, "cleared": C}``. The reference the router's index
is compared with: the engine's own event classes, not ours. A ``dump`` file gets the raw payloads
(``[[seq, hex], ...]``, for golden files). One process answers many queries (importing vLLM takes ~10 s).
"""

from __future__ import annotations

import json
import sys

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def read(ctx: zmq.Context, replay: str, dump: str | None) -> dict:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(replay)
    sock.send_multipart((b"", (0).to_bytes(8, "big")))
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    held: set = set()
    block_size = None
    last_seq, batches, cleared, raw = -1, 0, 0, []
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        if not poller.poll(10_000):
            sock.close()
            return {"error": "no end-of-replay marker within 10 s"}
        _, topic, seq_bytes, payload = sock.recv_multipart()
        if seq_bytes == END_SEQ:
            break
        seq = int.from_bytes(seq_bytes, "big")
        raw.append([seq, payload.hex()])
        batch = decoder.decode(payload)
        last_seq, batches = seq, batches + 1
        for ev in batch.events:
            if isinstance(ev, BlockStored) and (ev.medium or "GPU") == "GPU" and not ev.group_idx:
                held.update(ev.block_hashes if not isinstance(ev.block_hashes[0], bytes) else
                            [h.hex() for h in ev.block_hashes])
                block_size = ev.block_size
            elif isinstance(ev, BlockRemoved) and (ev.medium or "GPU") == "GPU" and not ev.group_idx:
                held.difference_update(h.hex() if isinstance(h, bytes) else h for h in ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                held.clear()
                cleared += 1
    sock.close()
    if dump:
        with open(dump, "w") as f:
            json.dump(raw, f)
    return {"blocks": len(held), "block_size": block_size, "last_seq": last_seq, "batches": batches,
            "cleared": cleared}


def main() -> None:
    ctx = zmq.Context()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        q = json.loads(line)
        print(json.dumps(read(ctx, q["replay"], q.get("dump"))), flush=True)


if __name__ == "__main__":
    main()
